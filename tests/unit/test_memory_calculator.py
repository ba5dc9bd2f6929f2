"""The memory calculator's large-model formulas (labkit.predict.memory): every strategy it names
is modelled against the ZeRO paper's figures, what it does not model is refused before anything
runs, full recomputation has one definition, and its DeepSpeed recipe reproduces DeepSpeed's
published estimators, written out here from DeepSpeed's source. Pure arithmetic: no rank
process is started."""

from __future__ import annotations

import math

import pytest
from torch import nn

from labkit import RunConfig, experiment
from labkit.labs import memory
from labkit.predict.memory import (
    activation_bytes,
    calculate,
    layer_activations,
    model_states,
    parameters,
    shard_numels,
    transformer,
    transformer_layout,
)

PSI = 7.5e9  # the ZeRO paper's Figure 1: 7.5B parameters, N = 64, K = 12 (Adam)
SEVEN_B = dict(layers=32, hidden=4096, heads=32, seq=4096, micro_batch=1)


def _states(row: dict) -> float:
    return row["params"] + row["grads"] + row["optimizer"]


# ---- every strategy named is modelled ---------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, extra, gb",
    [
        ("ddp", {}, 16 * PSI / 1e9),  # 120: nothing sharded
        ("zero1", {}, (4 * PSI + 12 * PSI / 64) / 1e9),  # 31.4
        ("zero2", {}, 16.640625),  # 2 psi + (2 + K) psi / N, worked by hand: 15 + 1.640625
        ("zero3", {}, 1.875),  # 16 psi / N
        ("fsdp", {}, 1.875),
        ("hsdp", {"shard_size": 8}, 15.0),  # 16 psi / 8: sharded in groups of 8, not over 64
    ],
)
def test_each_strategy_holds_the_zero_papers_model_states(strategy, extra, gb):
    row = transformer(PSI, strategy=strategy, world_size=64, **extra)
    assert _states(row) == pytest.approx(gb * 1e9, rel=1e-12), row
    assert row["strategy"] == strategy


def test_zero2_at_figure_1_is_16_641_gb_by_both_entry_points():
    by_strategy = _states(transformer(PSI, strategy="zero2", world_size=64))
    by_stage = sum(model_states(PSI, dp=64, zero=2).values())
    assert round(by_strategy / 1e9, 3) == round(by_stage / 1e9, 3) == 16.641


def test_hsdp_divides_by_the_shard_group_not_the_world():
    hsdp = transformer(PSI, strategy="hsdp", world_size=64, shard_size=8)
    assert _states(hsdp) == 8 * _states(transformer(PSI, strategy="fsdp", world_size=64))
    assert hsdp["rest"] == transformer(PSI, strategy="fsdp", world_size=8)["rest"] > 0


# ---- what is not modelled is refused ----------------------------------------------------------


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: transformer(PSI, strategy="bogus"),
            "one of single, dataparallel, ddp, ddp_naive, zero1, fsdp, hsdp, zero2, zero3",
        ),
        (lambda: transformer(PSI, strategy="hsdp", world_size=64), "set shard_size to a divisor"),
        (lambda: transformer(PSI, strategy="hsdp", shard_size=6), "divisor of 64"),
        (lambda: transformer(PSI, strategy="fsdp", shard_size=8), "use strategy='hsdp'"),
        (lambda: transformer(PSI, strategy="single", world_size=8), "set world_size=1"),
        (lambda: transformer(PSI, optimizer="lion"), "optimizer must be one of"),
        (lambda: transformer(PSI, recipe="megatron"), "recipe must be 'paper'"),
        (lambda: transformer(PSI, strategy="zero1", recipe="deepspeed"), "ZeRO-2 and ZeRO-3"),
        (lambda: transformer(-1.0), "n_params must be a positive"),
        (lambda: model_states(PSI, zero=4), "ZeRO stage 0, 1, 2 or 3"),
        (lambda: model_states(PSI, zero=True), "ZeRO stage 0, 1, 2 or 3"),
        (lambda: model_states(PSI, dp=0), "dp must be a whole number"),
        (lambda: model_states(PSI, zero=1, recipe="deepspeed"), "or recipe='paper'"),
        (lambda: layer_activations(seq=8, micro_batch=1, hidden=8, heads=2, tp=0), "tp must"),
        (lambda: shard_numels([(4, 4)], "zero3", 2), "transformer\\(\\) or model_states"),
        (
            lambda: shard_numels([(4, 4)], "bogus", 2),
            "one of single, dataparallel, ddp, ddp_naive, zero1, fsdp, hsdp",
        ),
        (lambda: activation_bytes(nn.Linear(4, 2), (1, 4), 2, precision="fp8"), "fp32, bf16"),
    ],
)
def test_what_is_not_modelled_is_an_error_naming_the_choices(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layout_refuses_unknown_stages_and_recipes():
    kw = dict(layers=4, hidden=64, heads=4, seq=16, vocab=100, micro_batch=1, dp=8)
    with pytest.raises(ValueError, match="ZeRO stage"):
        transformer_layout(**kw, zero=5)
    with pytest.raises(ValueError, match="recipe must be"):
        transformer_layout(**kw, zero=3, recipe="zero_paper")
    with pytest.raises(ValueError, match="microbatches_in_flight must be a whole number"):
        transformer_layout(**kw, microbatches_in_flight=0)


def test_calculate_refuses_strategies_it_does_not_trace():
    kw = dict(input_shape=(4,), classes=2, global_batch=4, world_size=2)
    with pytest.raises(ValueError, match="fsdp, hsdp, got 'zero2'.*transformer\\(\\)"):
        calculate(nn.Linear(4, 2), strategy="zero2", **kw)
    with pytest.raises(ValueError, match="set shard_size to a divisor of 2"):
        calculate(nn.Linear(4, 2), strategy="hsdp", **kw)
    with pytest.raises(ValueError, match="recipe must be 'autocast'.*DeepSpeed's estimators"):
        calculate(nn.Linear(4, 2), strategy="ddp", recipe="deepspeed", **kw)
    hsdp = calculate(nn.Linear(4, 2), strategy="hsdp", shard_size=1, **kw)
    assert (hsdp["params"] == 4 * (4 * 2 + 2)).all()  # shard groups of one: whole copies


def test_a_run_the_calculator_does_not_model_is_refused_before_it_starts(monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("a rank was started before the strategy was checked")

    monkeypatch.setattr(experiment, "run", must_not_run)
    with pytest.raises(ValueError, match="models single, dataparallel, ddp, ddp_naive.*not tp"):
        memory.measure(RunConfig(), strategies=("ddp", "tp"))
    with pytest.raises(ValueError, match="not local_sgd"):
        memory.predict(RunConfig(strategy="local_sgd", world_size=2))
    hsdp = memory.predict(RunConfig(strategy="hsdp", world_size=4, shard_size=2))
    ddp = memory.predict(RunConfig(strategy="ddp", world_size=4))
    assert (2 * hsdp["params"] == ddp["params"]).all()  # each rank holds half of one copy


# ---- one definition of full recomputation -----------------------------------------------------


def test_full_recomputation_is_one_number_in_both_functions():
    """Korthikanti et al. 2022: full recomputation keeps each layer's input, 2sbh bytes in
    16-bit; during backward one layer at a time rebuilds its s*b*h*(34 + 5as/h) bytes. For the
    7B shape (s = h = 4096, b = 1, a = 32, L = 32), worked by hand: 32 * 2 * 4096^2 = 1 GiB kept,
    plus 4096^2 * (34 + 160 - 2) = 3 GiB rebuilt: 4 GiB."""
    by_hand = 32 * 2 * 4096**2 + 4096**2 * (34 + 160 - 2)
    assert by_hand == 4 * 2**30
    row = transformer(7e9, **SEVEN_B, checkpoint=True)
    layout = transformer_layout(**SEVEN_B, vocab=51200, recompute="full")
    assert row["activations"] == layout["activations"] == by_hand
    plain = transformer(7e9, **SEVEN_B, checkpoint=False)["activations"]
    assert plain == transformer_layout(**SEVEN_B, vocab=51200)["activations"]
    assert plain == 32 * 4096**2 * (34 + 160)


def test_zero3_working_copy_is_the_same_bytes_in_both_functions():
    """transformer() keeps ZeRO-3's gathered layer in rest (the five categories' home for
    parameter copies); transformer_layout adds it to params: per GPU, the totals agree."""
    shape = dict(layers=24, hidden=2048, seq=2048, vocab=51200)
    psi = parameters(**shape)
    row = transformer(
        psi, layers=24, hidden=2048, heads=32, seq=2048, strategy="zero3", world_size=16
    )
    layout = transformer_layout(**{**SEVEN_B, **shape}, dp=16, zero=3)
    assert row["rest"] == 4 * (12 * 2048**2 + 13 * 2048)
    assert _states(row) + row["rest"] == pytest.approx(_states(layout), rel=1e-12)


# ---- DeepSpeed's recipe against DeepSpeed's estimators -----------------------------------------


def deepspeed_zero2_gpu_bytes(total_params, num_gpus_per_node=1, num_nodes=1):
    """``estimate_zero2_model_states_mem_needs(..., cpu_offload=False)``'s gpu_mem, as written in
    deepspeedai/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py (since PR #5099, June 2024;
    its comment: 2 = params_16bit, 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit +
    8_optimizer_states_32bit)."""
    total_gpus = num_nodes * num_gpus_per_node
    gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
    return int(gpu_mem)


def deepspeed_zero3_gpu_bytes(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1):
    """``estimate_zero3_model_states_mem_needs(..., cpu_offload=False)``'s gpu_mem, as written in
    deepspeedai/DeepSpeed deepspeed/runtime/zero/stage3.py."""
    total_gpus = num_nodes * num_gpus_per_node
    largest_layer_memory = 4 * largest_layer_params
    gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
    return int(gpu_mem)


@pytest.mark.parametrize("psi, nodes, per_node", [(PSI, 8, 8), (2851e6, 1, 8), (1.3e9, 1, 1)])
def test_deepspeed_recipe_reproduces_deepspeeds_zero2_estimator(psi, nodes, per_node):
    gpus = nodes * per_node
    ours = sum(model_states(psi, dp=gpus, zero=2, recipe="deepspeed").values())
    assert abs(ours - deepspeed_zero2_gpu_bytes(psi, per_node, nodes)) < 1  # DeepSpeed's int()
    row = transformer(psi, strategy="zero2", world_size=gpus, recipe="deepspeed")
    assert _states(row) == ours
    # the difference from the paper is the fp32 gradient partition, 4 bytes per sharded parameter
    paper = sum(model_states(psi, dp=gpus, zero=2).values())
    assert ours - paper == pytest.approx(4 * psi / gpus, rel=1e-12)


@pytest.mark.parametrize("hidden, layers, gpus", [(4096, 32, 64), (2048, 24, 8), (1024, 4, 1)])
def test_deepspeed_recipe_reproduces_deepspeeds_zero3_estimator(hidden, layers, gpus):
    """The unit ZeRO-3 gathers is one transformer layer, 12h^2 + 13h parameters (DeepSpeed's
    ``largest_layer_params`` when a layer is what it fetches at once)."""
    shape = dict(layers=layers, hidden=hidden, seq=2048, vocab=51200)
    psi, layer = parameters(**shape), 12 * hidden**2 + 13 * hidden
    expected = deepspeed_zero3_gpu_bytes(psi, layer, num_gpus_per_node=gpus)
    layout = transformer_layout(
        **shape, heads=16, micro_batch=1, dp=gpus, zero=3, recipe="deepspeed"
    )
    assert abs(_states(layout) - expected) < 1
    row = transformer(
        psi, layers=layers, hidden=hidden, heads=16, strategy="zero3", world_size=gpus,
        recipe="deepspeed",
    )  # fmt: skip
    assert abs(_states(row) + row["rest"] - expected) < 1
    sharded = model_states(psi, dp=gpus, zero=3, recipe="deepspeed")
    assert math.isclose(_states(sharded) * gpus / psi, 18)  # DeepSpeed's bytes per parameter
