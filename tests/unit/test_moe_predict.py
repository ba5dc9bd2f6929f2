"""The calculator and the advisor with an expert-parallel degree (labkit.predict.memory's
moe_parameters, moe_states, moe_split; labkit.predict.layout's all_to_all_s and moe_evaluate),
on cases worked by hand and against a published mixture of experts (Mixtral 8x7B)."""

from __future__ import annotations

import pytest

from labkit.config import RunConfig
from labkit.models import make_model
from labkit.predict import layout as L
from labkit.predict import memory as M
from labkit.predict.collectives import AlphaBeta


def test_mixtral_8x7b_has_its_published_parameter_counts():
    """Jiang et al. 2024 (arXiv:2401.04088) and Mistral AI: 46.7B in all, 12.9B per token."""
    p = L.MIXTRAL_8X7B.parameters()
    assert round(p["total"] / 1e9, 1) == 46.7 and round(p["active"] / 1e9, 1) == 12.9
    # by hand: a layer's attention 2*4096^2 + 2*4096*1024, its 8 experts 3*4096*14336 each
    assert p["per_expert"] == 3 * 4096 * 14336 == 176_160_768
    assert p["experts"] == 32 * 8 * 176_160_768
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024
    layer = attention + 4096 * 8 + 2 * 4096
    assert p["dense"] == 32 * layer + 2 * 32000 * 4096 + 4096


def test_expert_states_divide_by_ep_and_zero_shards_over_their_replicas():
    # 1e9 dense and 8e9 expert parameters, 16 bytes each (2 + 2 + Adam's 12)
    assert M.moe_states(1e9, 8e9, ep=8, dp=8)["total"] == 16e9 + 16e9  # 1e9 experts per GPU
    assert M.moe_states(1e9, 8e9, ep=1, dp=8)["total"] == 144e9  # plain data parallelism
    # ZeRO-1: dense 4 + 12/8, experts (dp/ep = 1 replica) 4 + 12 per parameter
    assert M.moe_states(1e9, 8e9, ep=8, dp=8, zero=1)["total"] == pytest.approx(21.5e9)
    # dp 16: two GPUs hold each expert, ZeRO-1 halves their optimizer state: 4e9 + 6e9
    z1 = M.moe_states(1e9, 8e9, ep=8, dp=16, zero=1)
    assert z1["total"] == pytest.approx(4.75e9 + 10e9)
    with pytest.raises(ValueError, match="choose ep among the divisors of 8"):
        M.moe_states(1e9, 8e9, ep=3, dp=8)


def test_moe_split_counts_labkits_experts():
    cfg = RunConfig(strategy="single", world_size=1, model="transformer", experts=4, width=32)
    dense, experts = M.moe_split(make_model(cfg))
    h = 32  # per expert: fc1 h x 4h + 4h, fc2 4h x h + h
    assert experts == cfg.depth * 4 * (2 * h * 4 * h + 4 * h + h)
    assert dense + experts == sum(p.numel() for p in make_model(cfg).parameters())


def test_an_all_to_all_costs_n_minus_one_messages_of_a_nth():
    link = AlphaBeta(1e-6, 1e9)
    assert L.all_to_all_s(link, 8e6, 4) == pytest.approx(3e-6 + 0.75 * 8e-3)
    assert L.all_to_all_s(link, 8e6, 1) == 0.0


def test_the_advisors_all_to_all_term_worked_by_hand():
    shape = L.MoEShape("tiny", 2, 1024, 8, 8, 4096, 8, 2, 1000)
    lay = L.moe_evaluate(shape, gpus=8, ep=8, seq=128, global_batch=16, microbatch=1)
    # m = 16 / (8 x 1) = 2 micro-batches; each all-to-all hands in 1 x 128 x 2 rows of 1024
    # 16-bit values = 524,288 bytes; NVLink 4: 7 x 3 us + 7/8 x 524,288 / 450e9 s
    one = 7 * 3e-6 + 7 / 8 * 524_288 / 450e9
    assert lay.a2a_s == pytest.approx(6 * 2 * 2 * one)  # 6 per layer and micro-batch, 2 layers
    assert lay.a2a_bytes == 6 * 2 * 2 * 524_288
    alone = L.moe_evaluate(shape, gpus=8, ep=1, seq=128, global_batch=16, microbatch=1)
    assert alone.a2a_s == 0 and alone.params_bytes > lay.params_bytes


def test_mixtral_needs_expert_parallelism_to_fit_on_h100s():
    plans = L.moe_plan(L.MIXTRAL_8X7B, gpus=8, seq=4096, global_batch=64, zero_stages=(0,))
    by_ep = {lay.ep: lay for lay in plans if lay.microbatch == 1}
    assert not by_ep[1].fits and by_ep[1].mem_per_gpu_bytes > 700e9  # 46.7B x 16 bytes
    assert by_ep[8].mem_per_gpu_bytes < by_ep[4].mem_per_gpu_bytes < by_ep[2].mem_per_gpu_bytes
