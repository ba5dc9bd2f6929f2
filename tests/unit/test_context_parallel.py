"""Context parallelism without a process: ring attention and Ulysses on gloo ranks that are
threads of the test (``labkit.dist.on_threads``) against dense attention computed in one piece
by torch, the zig-zag schedule's per-rank work counted, and the cp knobs' validation."""

from __future__ import annotations

import pytest
import torch

from labkit.config import RunConfig
from labkit.labs import long_sequences as ls
from labkit.strategies import cp

TOL = 1e-12  # float64: what rounding alone leaves


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_forward_and_backward_equal_dense_attention(n, layout, causal):
    df = ls.on_threads(n, layout, "ring", causal=causal, seq_len=8 * n)
    assert len(df) == n
    assert (df[["out", "dq", "dk", "dv"]] < TOL).all().all(), df


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [True, False])
def test_ulysses_forward_and_backward_equal_dense_attention(n, layout, causal):
    df = ls.on_threads(n, layout, "ulysses", causal=causal, seq_len=8 * n, heads=4)
    assert (df[["out", "dq", "dk", "dv"]] < TOL).all().all(), df


def test_a_merge_without_the_log_sum_exp_weights_is_caught():
    def average(out, lse, block_out, block_lse):  # the blocks' outputs averaged, unweighted
        return (out + block_out) / 2, torch.maximum(lse, block_lse)

    df = ls.on_threads(2, "zigzag", merge=average, seq_len=16)
    assert (df["out"] > 1e-3).any()


def test_zigzag_gives_every_rank_the_same_work_and_contiguous_does_not():
    for n in (2, 3, 4, 8):
        zig, con = ls.work(n, "zigzag"), ls.work(n, "contiguous")
        # zig-zag: 2N-1 full tiles, 2 diagonal, 2N-1 skipped on every rank
        assert (zig["full"] == 2 * n - 1).all() and (zig["diagonal"] == 2).all()
        assert (zig["skipped"] == 2 * n - 1).all()
        assert zig["flops_forward"].nunique() == 1
        # contiguous: rank r computes r whole tiles and its diagonal: the last rank N times
        # the first's work (in (s/2N)^2 units: 4 per s/N tile); zig-zag 2N + 1 units each
        assert con["full"].tolist() == list(range(n))
        assert con["flops_forward"].tolist() == [4.0 * (r + 1) for r in range(n)]
        assert zig["flops_forward"].tolist() == [2.0 * n + 1] * n
        assert con["imbalance"].max() == pytest.approx(2 * n / (n + 1))


def test_the_work_each_rank_counted_while_running_is_the_schedule_s():
    for layout in ("contiguous", "zigzag"):
        ran = ls.on_threads(4, layout, seq_len=32)
        counted = ls.work(4, layout)
        for kind in (cp.FULL, cp.DIAGONAL, cp.SKIPPED):
            assert ran[kind].tolist() == counted[kind].tolist(), (layout, kind)


def test_each_rank_holds_a_piece_of_every_position_once_and_someone_holds_the_last():
    for n in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            held = torch.cat([cp.positions(r, n, 24, layout) for r in range(n)])
            assert sorted(held.tolist()) == list(range(24))
            owner = cp.last_position_owner(n, 24, layout)
            assert int(cp.positions(owner, n, 24, layout)[-1]) == 23
    assert cp.chunk_ids(1, 4, "zigzag") == (1, 6)
    assert cp.last_position_owner(4, 24, "zigzag") == 0
    assert cp.last_position_owner(4, 24, "contiguous") == 3


def test_the_ring_visits_every_rank_once():
    for n in (2, 3, 5):
        for r in range(n):
            steps = cp.schedule(r, n, "zigzag")
            assert [s.kv_from for s in steps] == [(r - s) % n for s in range(n)]
            assert sorted(s.kv_from for s in steps) == list(range(n))


def test_bytes_formulas_by_hand():
    # b=1, s=8, h=2, float32: b s h = 64 bytes
    assert ls.bytes_formula("ring", 2, batch=1, seq_len=8, hidden=2) == {
        "forward": 64.0,  # 2 (N-1)/N x 64
        "backward": 128.0,
    }
    assert ls.bytes_formula("ulysses", 4, batch=1, seq_len=8, hidden=2) == {
        "forward": 4 * 0.75 * 64 / 4,
        "backward": 48.0,
    }


@pytest.mark.parametrize(
    "changes, says",
    [
        (dict(strategy="cp", world_size=2), "model='transformer'"),
        (dict(strategy="cp", world_size=2, model="transformer", seq_len=18), "multiple of 4"),
        (
            dict(strategy="cp", world_size=3, model="transformer", seq_len=9),
            "cp_layout='contiguous'",
        ),
        (dict(strategy="cp", world_size=4, model="transformer", cp=2), "cp == world_size"),
        (
            dict(strategy="cp_ulysses", world_size=8, model="transformer", heads=4, seq_len=16),
            "heads that are a multiple of 8",
        ),
        (dict(strategy="dp_cp", world_size=4, model="transformer", cp=3), "divisor of 4"),
        (dict(strategy="ddp", cp=2), "drop them"),
        (dict(strategy="ddp", cp_layout="contiguous"), "knob of cp"),
    ],
)
def test_cp_knobs_are_refused_with_the_fix(changes, says):
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        RunConfig(**changes)


def test_a_cp_config_trains_the_whole_batch_on_every_rank_of_a_ring():
    cfg = RunConfig(strategy="cp", world_size=4, model="transformer", global_batch=8)
    assert cfg.context_parallel == 4 and cfg.data_ranks == 1 and cfg.batch_per_rank == 8
    two = RunConfig(strategy="dp_cp", world_size=4, cp=2, model="transformer", global_batch=8)
    assert two.context_parallel == 2 and two.data_ranks == 2 and two.batch_per_rank == 4


# ---- the calculator and the advisor know a cp degree -------------------------------------------


def test_activations_divide_by_cp_by_hand():
    from labkit.predict import memory

    shape = dict(seq=8, micro_batch=1, hidden=4, heads=2)
    assert memory.layer_activations(**shape) == 8 * 1 * 4 * (34 + 5 * 2 * 8 / 4)  # 1728
    assert memory.layer_activations(**shape, cp=2) == 864
    big = dict(layers=4, hidden=64, heads=4, seq=1024, vocab=100, micro_batch=2, tp=2, pp=2)
    one = memory.transformer_layout(**big, recompute="selective")
    four = memory.transformer_layout(**big, recompute="selective", cp=4)
    assert four["activations"] == pytest.approx(one["activations"] / 4)
    assert four["params"] == one["params"]


def test_the_ring_hides_behind_attention_only_when_a_block_computes_longer_than_it_travels():
    from labkit.predict.collectives import AlphaBeta
    from labkit.predict.layout import ring_pass_s

    link = AlphaBeta(1e-6, 1e9, "by hand")
    assert ring_pass_s(link, 1e6, 4) == pytest.approx(3 * (1e-6 + 1e-3))
    assert ring_pass_s(link, 1e6, 4, block_compute_s=5e-4) == pytest.approx(3 * 5.01e-4)
    assert ring_pass_s(link, 1e6, 4, block_compute_s=2e-3) == 0.0
    assert ring_pass_s(link, 1e6, 1) == 0.0


def test_the_advisor_s_cp_term_by_hand():
    from labkit.predict import layout as L

    gpu = L.DEVICES["A100 80GB"]
    link = L.LINKS[gpu.nvlink]  # tp x cp = 2 GPUs: inside a node
    args = dict(layers=2, hidden=1024, heads=8, vocab=1000, gpus=16, global_batch=16, tp=1, pp=1)
    args.update(zero=0, microbatch=1, recompute="none", gpu=gpu)
    for seq, hidden_by_compute in ((256, False), (4096, True)):
        one = L.evaluate(**args, seq=seq, cp=1, dp=16)
        two = L.evaluate(**args, seq=seq, cp=2, dp=8)
        assert two.activations_bytes == pytest.approx(one.activations_bytes / 2)
        assert two.compute_s == one.compute_s and one.cp_comm_s == 0.0
        block = 2 * 2 * (seq / 2) * 1024  # K and V of s/cp positions, 16-bit
        tile = 4 * (seq / 2) ** 2 * 1024 / (gpu.peak_flops * L.MFU)
        per_layer = L.ring_pass_s(link, block, 2, tile) + L.ring_pass_s(
            link, 2 * block, 2, 2 * tile
        )
        assert two.cp_comm_s == pytest.approx(2 * 2 * per_layer)  # 2 layers x 2 micro-batches
        assert (two.cp_comm_s == 0.0) == hidden_by_compute  # long blocks hide their transfer


def test_the_advisor_reaches_for_cp_when_the_sequence_does_not_fit_otherwise():
    from labkit.predict import layout as L

    model = dict(layers=32, hidden=4096, heads=32, seq=131072, vocab=32000)
    layouts = L.plan(
        **model, gpus=64, global_batch=64, device="H100 SXM 80GB", cp_choices=(1, 2, 4, 8)
    )
    assert layouts[0].fits and layouts[0].cp > 1
    assert not any(lay.fits for lay in layouts if lay.cp == 1)
    assert {lay.cp for lay in layouts} == {1, 2, 4, 8}
    assert all(lay.cp == 1 for lay in L.plan(**model, gpus=64, global_batch=64))  # default


def test_llama3_s_published_128k_layout_fits_and_the_same_gpus_without_cp_do_not():
    table = ls.published_long_context().set_index("cp")
    assert table.loc[16, "fits"] and not table.loc[1, "fits"]
    assert table.loc[1, "activations_GB"] == pytest.approx(16 * table.loc[16, "activations_GB"])
    # by hand: 128 layers of 2 s b h / (t cp) bytes in flight (1F1B: 8 layers x 16 micro-
    # batches on the first stage) plus one layer rebuilt, 34 s b h / (t cp)
    sbh_t = 131072 * 16384 / 8
    assert table.loc[16, "activations_GB"] == pytest.approx((128 * 2 + 34) * sbh_t / 16 / 1e9)


# ---- the graded fill-in: ring attention's step (the grader's messages; no rank starts) ----------


def _total(out, lse, block_out, block_lse):  # the two outputs added
    return out + block_out, torch.logaddexp(lse, block_lse)


def _larger(out, lse, block_out, block_lse):  # the max instead of the log-sum-exp
    new = torch.maximum(lse, block_lse)
    keep, take = torch.exp(lse - new), torch.exp(block_lse - new)
    return keep.unsqueeze(-1) * out + take.unsqueeze(-1) * block_out, new


def _overflows(out, lse, block_out, block_lse):  # exp of a log-sum-exp alone
    new = torch.log(torch.exp(lse) + torch.exp(block_lse))
    keep, take = torch.exp(lse - new), torch.exp(block_lse - new)
    return keep.unsqueeze(-1) * out + take.unsqueeze(-1) * block_out, new


def _not_rescaled(out, lse, block_out, block_lse):  # the running output kept as it was
    new = torch.logaddexp(lse, block_lse)
    return out + torch.exp(block_lse - new).unsqueeze(-1) * block_out, new


@pytest.mark.parametrize(
    "fn, says",
    [
        (_total, "You added the two outputs"),
        (_larger, "the larger of the two"),
        (_overflows, "exp(1000) overflows"),
        (_not_rescaled, "was not rescaled"),
    ],
)
def test_each_catalogued_wrong_merge_gets_its_message(fn, says):
    from labkit import exercises

    verdict = exercises.check("ring_attention_step", fn)
    assert verdict.passed is False and says in verdict.message, verdict.message


def test_a_blank_merge_is_not_written_yet():
    from labkit import exercises

    def my_combine(out, lse, block_out, block_lse):
        raise NotImplementedError

    verdict = exercises.check("ring_attention_step", my_combine)
    assert verdict.passed is None and "NotImplementedError" in verdict.message
