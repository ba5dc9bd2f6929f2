"""Bytes counted where they travel (labkit.wire) against the formulas, strategy by strategy.

Each count comes from the process group's own hooks, which see the tensors every collective is
handed; each expected value comes from the model's parameters (counted here, apart) and the
ring formulas. A hook that was not installed, a ``no_sync`` that did not hold, or a strategy
that sent something else would change the count, not the formula.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_wire.py."""

from __future__ import annotations

import pytest

from labkit import RunConfig, experiment, launch
from labkit.models import make_model
from labkit.strategies import run_rank

SMALL = RunConfig(width=64, depth=2, steps=3, warmup=1, global_batch=32, dataset_size=512)
PSI = sum(p.numel() * p.element_size() for p in make_model(SMALL).parameters())  # the model


def step(cfg: RunConfig, **changes):
    """The records of the second measured step, one row per rank."""
    records = experiment.run(cfg.replace(**changes)).records
    return records[records["step"] == 1].sort_values("rank")


def test_ddp_sends_its_gradients_once_per_step_through_a_ring():
    got = step(SMALL, strategy="ddp")
    # at 2 ranks a ring all-reduce sends 2(n-1)/n = 1 x the buffer
    assert (got["comm_bytes"] == PSI).all() and (got["comm_payload_bytes"] == PSI).all()
    assert (got["comm_calls"] == 1).all()  # one bucket: the model is smaller than 1 MiB


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_a_compression_hook_halves_the_bytes_on_the_wire(hook):
    got = step(SMALL, strategy="ddp", comm_hook=hook)
    assert (got["comm_bytes"] == PSI // 2).all()  # the hook's 16-bit buffer, not the fp32 one


def test_powersgd_sends_its_low_rank_factors():
    got = step(SMALL, strategy="ddp", comm_hook="powersgd", warmup=2)
    assert (got["comm_bytes"] < PSI / 4).all() and (got["comm_calls"] > 1).all()


def test_ddp_naive_sends_one_message_per_parameter_tensor():
    got = step(SMALL, strategy="ddp_naive")
    tensors = len(list(make_model(SMALL).parameters()))
    assert (got["comm_calls"] == tensors).all() and (got["comm_bytes"] == PSI).all()


def test_fsdp_sends_one_and_a_half_times_ddp():
    # two all-gathers of the parameters and a reduce-scatter of the gradients, each (n-1)/n:
    # 3(n-1)/n against DDP's 2(n-1)/n
    got = step(SMALL, strategy="fsdp")
    assert (got["comm_bytes"] == 1.5 * PSI).all()


def test_zero1_adds_one_broadcast_of_each_partition():
    # torch's ZeroRedundancyOptimizer: DDP's all-reduce, then every rank broadcasts the
    # partition it updated; in a chain from the root the last link forwards nothing, so at
    # 2 ranks each rank sends its own partition: over both ranks, the model once more
    got = step(SMALL, strategy="zero1")
    assert (got["comm_bytes"] > PSI).all()
    assert got["comm_bytes"].sum() == 2 * PSI + PSI


def test_accumulation_syncs_once_unless_told_to_sync_every_micro_batch():
    quiet = step(SMALL, strategy="ddp", accumulate=2)
    every = step(SMALL, strategy="ddp", accumulate=2, sync_every_microstep=True)
    assert (quiet["comm_calls"] == 1).all() and (quiet["comm_bytes"] == PSI).all()
    assert (every["comm_calls"] == 2).all() and (every["comm_bytes"] == 2 * PSI).all()


def test_local_sgd_communicates_on_averaging_steps_only():
    records = experiment.run(SMALL.replace(strategy="local_sgd", period=2, steps=4)).records
    sent_by_step = records.groupby("step")["comm_bytes"].max()
    averaged = records.groupby("step")["averaged"].max()
    assert (sent_by_step[averaged == 1] == PSI).all() and (sent_by_step[averaged == 0] == 0).all()


def test_a_pipeline_stage_sends_its_activations_or_their_gradients():
    got = step(SMALL, strategy="pipeline_1f1b", microbatches=4)
    activation = SMALL.global_batch * SMALL.width * 4  # M micro-batches of (B/M) x width fp32
    assert (got["comm_bytes"] == activation).all()  # stage 0 forward, stage 1 backward


def test_one_rank_calls_the_collective_but_sends_nothing():
    # the ranks' own records, before labkit.records.finalize reads them
    cfg = SMALL.replace(strategy="ddp", world_size=1)
    (result,) = launch(run_rank, 1, args=(cfg,), timeout_s=120)
    raw = result["records"]
    assert all(r["comm_calls"] == 1 and r["comm_payload_bytes"] == PSI for r in raw)
    assert all(r["comm_bytes"] == 0 for r in raw)


@pytest.mark.parametrize("shard_size, factor", [(2, 2.0), (1, 1.5)])
def test_hsdp_sends_fsdp_inside_its_groups_and_ddp_across_them(shard_size, factor):
    # 4 ranks, groups of s: FSDP's 3(s-1)/s of the model inside a group, then the all-reduce of
    # its 1/s shard across the r = 4/s copies, 2(r-1)/r: s=2 gives 3/2 + 1/2 = 2, s=1 (no
    # sharding, four copies) DDP's 2 x 3/4 = 1.5. The widths split evenly: no padding.
    got = step(SMALL, strategy="hsdp", world_size=4, shard_size=shard_size)
    assert (got["comm_bytes"] == factor * PSI).all()


def _timed_while_the_gil_is_held(ctx, ops: int, hold_s: float) -> dict:
    """Issue ``ops`` timed all-reduces, then hold the GIL for ``hold_s`` (a pure-Python loop,
    the switch interval longer than the loop): which of them completed meanwhile."""
    import sys
    import time

    import torch
    import torch.distributed as dist

    from labkit import wire

    wire.watch()
    wire.traffic().timing = True
    works = [dist.all_reduce(torch.ones(1000), async_op=True) for _ in range(ops)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10 * hold_s)
    try:
        end = time.perf_counter() + hold_s
        while time.perf_counter() < end:
            pass
        completed = sum(w.is_completed() for w in works)
    finally:
        sys.setswitchinterval(interval)
    for w in works:
        w.wait()
    spans = wire.traffic().take(settle_s=5.0)["spans"]
    return {
        "completed": completed,
        "spans": len(spans),
        "ordered": all(a <= b for _, a, b, _ in spans),
    }


def test_timing_a_gloo_collective_never_stalls_gloo_behind_the_gil():
    # Each timed collective's end is read by labkit's own waiting thread. Read in a callback on
    # gloo's thread instead, that thread waits for the GIL after a collective finishes and starts
    # no other meanwhile (0 of the 8 completed with the callback), so DDP's next bucket waited
    # while the main thread ran Python (benchmarks/README.md).
    results = launch(_timed_while_the_gil_is_held, 2, args=(8, 1.0), device="cpu")
    for r in results:
        assert r["completed"] == 8, r
        assert r["spans"] == 8 and r["ordered"], r
