"""The communication lab: collective benchmark arithmetic, the alpha-beta fit, the step-time
predictor (exact on synthetic profiles, within a tolerance on real runs), and DDP's knobs
(accumulation, compression hooks, the PowerSGD guard) with real ranks on gloo.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_comm.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from labkit import RunConfig
from labkit.labs import comm
from labkit.predict import collectives, step
from labkit.predict.collectives import AlphaBeta, CollectiveModel

# ---- benchmark arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("broadcast", 4, 1.0),
    ],
)
def test_busbw_uses_the_nccl_tests_factor(op, n, factor):
    row = comm.row(op, 2**20, n, [0.002, 0.001, 0.003], "gloo", "cpu")
    assert row["time_s"] == 0.002
    assert row["algbw"] == pytest.approx(2**20 / 0.002 / 1e9)
    assert row["busbw"] == pytest.approx(row["algbw"] * factor)
    assert row["p10_s"] <= row["time_s"] <= row["p90_s"]


def test_sizes_parse_and_bad_ones_say_how():
    assert comm.size_range("1KiB-64KiB") == [1024, 4096, 16384, 65536]
    assert comm.size_range("4096,1MiB") == [4096, 2**20]
    for bad in ("64MiB-1KiB", "lots", "2"):
        with pytest.raises(ValueError, match="size"):
            comm.size_range(bad)


# ---- alpha-beta -----------------------------------------------------------------------------


@pytest.mark.parametrize("op", collectives.OPS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_alpha_beta_recovered_exactly_from_synthetic_times(op, n):
    truth = AlphaBeta(40e-6, 3e9)
    sizes = [2**k for k in range(10, 27, 2)]
    fitted = collectives.fit(op, n, sizes, [truth.time(op, s, n) for s in sizes])
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-9)
    model, held = collectives.held_out_fit(op, n, sizes, [truth.time(op, s, n) for s in sizes])
    assert held and max(r["error"] for r in held) < 1e-9


def test_ring_all_reduce_formula():
    link = AlphaBeta(1e-3, 1e9)
    # 2(n-1) alpha + 2(n-1)/n S/beta at n=4, S=1e9: 6 ms + 1.5 s
    assert link.time("all_reduce", 1e9, 4) == pytest.approx(6e-3 + 1.5)
    assert link.time("all_reduce", 1e9, 1) == 0.0


# ---- the predictor on synthetic profiles (exact) --------------------------------------------


def synthetic_profile() -> step.Profile:
    """Three layers at 10 samples per rank, 1 MB of gradients each (bias 0)."""
    layer = lambda i: step.Layer(
        f"l{i}",
        forward_s=0.01,
        backward_s=0.02,  # noqa: E731
        grad_bytes=(10**6,),
        activation_bytes=1000.0,
        flops=1e6,
    )
    return step.Profile(
        batch=10, layers=tuple(layer(i) for i in range(3)), optimizer_s=0.005, data_s=0.001
    )


def test_ddp_prediction_overlaps_buckets_with_backward_exactly():
    net = CollectiveModel.uniform(AlphaBeta(0.0, 1e8))  # 1 MB all-reduce at n=2: 10 ms
    p = step.predict(synthetic_profile(), net, "ddp", 2, 20, bucket_cap_mb=0.9)
    # one bucket per layer, ready at 20, 40, 60 ms of backward; each takes 10 ms: the last
    # ends at 70 ms, backward at 60 ms -> 10 ms exposed, 20 ms hidden
    assert [b["ready_s"] for b in p.buckets] == pytest.approx([0.02, 0.04, 0.06])
    assert p.comm_total_s == pytest.approx(0.03)
    assert p.exposed_s == pytest.approx(0.01)
    assert p.hidden_s == pytest.approx(0.02)
    assert p.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.01 + 0.005)
    one = step.predict(synthetic_profile(), net, "ddp", 2, 20, bucket_cap_mb=100)
    assert one.exposed_s == pytest.approx(0.03) and len(one.buckets) == 1  # waits for all


def test_ddp_overlap_on_a_shared_core_hides_nothing():
    """gloo with no spare core: while a bucket reduces, it and backward each run at half speed."""
    net = CollectiveModel.uniform(AlphaBeta(0.0, 1e8))  # 1 MB all-reduce at n=2: 10 ms
    prof = replace(synthetic_profile(), comm_shares_core=True)
    p = step.predict(prof, net, "ddp", 2, 20, bucket_cap_mb=0.9)
    # bucket 0 ready at 20 ms, shares the core until 40 ms (10 ms of backward done, half of
    # layer 1's); layer 1 ends at 50 ms; bucket 1 shares from 50 to 70 ms; layer 0's last 10 ms
    # of backward alone to 80; bucket 2 alone from 80 to 90 ms
    times = [b[k] for b in p.buckets for k in ("ready_s", "start_s", "end_s")]
    assert times == pytest.approx([0.02, 0.02, 0.04, 0.05, 0.05, 0.07, 0.08, 0.08, 0.09])
    assert p.exposed_s == pytest.approx(0.03)  # all of the 30 ms of communication
    assert p.comm_total_s == pytest.approx(0.05)  # in flight longer, at half speed
    assert p.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.03 + 0.005)


def test_compute_after_a_wait_is_interpolated_and_added():
    prof = replace(
        synthetic_profile(), after_wait_s=((0.002, 0.004), (0.008, 0.003), (0.032, 0.010))
    )
    assert prof.after_wait(0.0) == 0.0
    assert prof.after_wait(0.001) == pytest.approx(0.002)  # on the line from (0, 0)
    assert prof.after_wait(0.008) == pytest.approx(0.004)  # never less after a longer wait
    assert prof.after_wait(0.020) == pytest.approx(0.007)
    assert prof.after_wait(1.0) == pytest.approx(0.010)  # held at the longest gap's
    net = CollectiveModel.uniform(AlphaBeta(1e-3, 1e8))  # 3 tensors x 12 ms = 36 ms
    naive = step.predict(prof, net, "ddp_naive", 2, 20)
    assert naive.after_wait_s == pytest.approx(prof.after_wait(0.036))
    assert naive.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.036 + 0.005 + naive.after_wait_s)
    assert step.predict(prof, net, "single", 1, 10).after_wait_s == 0.0  # nothing to wait for
    assert prof.on_device(1e12, "fast").after_wait(0.01) == 0.0  # not measured there


def test_naive_accumulation_and_compression_predictions():
    net = CollectiveModel.uniform(AlphaBeta(1e-3, 1e8))  # per tensor: 2 ms + 10 ms
    prof = synthetic_profile()
    naive = step.predict(prof, net, "ddp_naive", 2, 20)
    assert naive.exposed_s == pytest.approx(3 * 0.012) and naive.hidden_s == 0
    acc = step.predict(prof, net, "ddp_naive", 2, 80, accumulate=4)  # same micro-batch
    assert acc.forward_s == pytest.approx(4 * naive.forward_s)
    assert acc.comm_bytes == naive.comm_bytes  # one sync per step
    every = step.predict(prof, net, "ddp_naive", 2, 80, accumulate=4, no_sync=False)
    assert every.comm_bytes == 4 * acc.comm_bytes
    half = step.predict(prof, net, "ddp_naive", 2, 20, compression=0.5)
    assert half.exposed_s == pytest.approx(3 * (0.002 + 0.005))
    single = step.predict(prof, net, "single", 1, 10)
    assert single.exposed_s == 0 and single.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.005)


def test_pipeline_prediction_uses_the_schedule_simulator():
    net = CollectiveModel.uniform(AlphaBeta(0.0, math.inf))
    prof = step.Profile(
        batch=4, layers=tuple(step.Layer(f"l{i}", 0.01, 0.02, ()) for i in range(2))
    )
    p = step.predict(prof, net, "pipeline_gpipe", 2, 16, microbatches=4)
    assert p.bubble == pytest.approx(1 / 5)  # (P-1)/(M+P-1) with free hand-offs
    assert p.step_s == pytest.approx(5 * 0.01 + 5 * 0.02)  # (M+P-1) forwards and backwards


def test_batch_scaling_and_device_rescaling():
    prof = synthetic_profile()
    assert prof.at_batch(20).layers[0].forward_s == pytest.approx(0.02)
    fixed = step.Profile(10, (step.Layer("l", 0.01, 0.02, (), forward_fixed_s=0.004),))
    assert fixed.at_batch(20).layers[0].forward_s == pytest.approx(0.016)
    fast = prof.on_device(1e12, "fast")
    assert fast.layers[0].forward_s == pytest.approx(1e6 * 10 / 1e12)
    with pytest.raises(ValueError, match="FLOP"):
        step.Profile(10, (step.Layer("l", 1, 1, ()),)).on_device(1e12, "x")


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(strategy="ddp_naive", comm_hook="fp16"), "DDP communication hook"),
        (dict(strategy="pipeline_1f1b", accumulate=2), "set microbatches instead"),
        (dict(accumulate=3, global_batch=64), "multiple of 6"),
        (dict(bucket_cap_mb=0), "bucket_cap_mb must be positive"),
        (dict(comm_hook="int8"), "unknown comm_hook .int8.: choose one of none, fp16"),
    ],
)
def test_bad_knobs_are_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**changes)
