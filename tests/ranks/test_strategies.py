"""Data-parallel strategies on real 2-rank gloo groups: equal to single, measured, summarised.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_strategies.py."""

import time

import pytest
import torch
from torch import nn

from labkit import RunConfig, experiment, launch
from labkit.data import ToyClassification
from labkit.labs import equivalence
from labkit.rank import watch
from labkit.rank.probes import TIME_COLUMNS
from labkit.records import BUSY_SHARE, summarize
from labkit.strategies import run_rank
from tests.helpers.models import centred_mlp

SMALL = RunConfig(width=64, depth=2, global_batch=32, dataset_size=512, steps=4, warmup=1)


def test_every_data_parallel_strategy_matches_single_at_world_size_2():
    result = equivalence.check(SMALL, ["dataparallel", "ddp", "ddp_naive"], world_size=2, steps=5)
    assert list(result["strategy"]) == ["dataparallel", "ddp", "ddp_naive"]
    assert result["ok"].all(), result
    assert (result["max_abs_diff"] <= 1e-5).all()


def test_check_catches_a_strategy_that_differs():
    # check itself, on a model DDP really changes (each rank centres its half of the batch):
    # it must fail the row, not pass vacuously; the same model on single alone is not at fault
    table = equivalence.check(SMALL, ["ddp"], world_size=2, steps=3, model_fn=centred_mlp)
    row = table.iloc[0]
    assert not row["ok"] and row["max_abs_diff"] > 10 * row["tol"], table.to_dict("records")
    assert equivalence.check(SMALL, ["ddp"], world_size=2, steps=3)["ok"].all()


def test_records_carry_the_contract_and_phases_add_up():
    res = experiment.run(SMALL.replace(strategy="ddp", world_size=2))
    df = res.records
    assert sorted(df["rank"].unique()) == [0, 1]
    assert sorted(df["step"].unique()) == list(range(SMALL.steps))
    for col in (
        "strategy",
        "world_size",
        "rank",
        "step",
        "device",
        "loss",
        "shard_loss",
        "samples",
        "threads",
        "start_s",
        "compute_cpu_share",
        "peak_mem_bytes",
        "comm_bytes",
        *TIME_COLUMNS,
    ):
        assert col in df, col
    phases = df[[c for c in TIME_COLUMNS if c != "step_s"]].sum(axis=1)
    assert ((phases - df["step_s"]).abs() <= 1e-4 + 0.02 * df["step_s"]).all()
    assert (df["samples"] == SMALL.global_batch // 2).all()
    n_params = sum(
        p.numel()
        for p in nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)).parameters()
    )
    # counted where they travel: one all-reduce of the fp32 gradients per step, which on 2 ranks
    # sends 2(n-1)/n = 1 x their bytes (labkit.wire)
    assert (df["comm_bytes"] == 4 * n_params).all()
    assert (df["comm_calls"] == 1).all()


def test_user_model_and_dataset_factories_run_under_ddp():
    def my_model(cfg):  # defined here: travels to the ranks by value
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))

    def my_data(cfg):
        return ToyClassification(256, in_features=8, classes=3, seed=cfg.seed)

    cfg = SMALL.replace(strategy="ddp", deterministic=True)
    res = experiment.run(cfg, model_fn=my_model, data_fn=my_data)
    assert set(res.params) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    ref = experiment.run(
        cfg.replace(strategy="single", world_size=1), model_fn=my_model, data_fn=my_data
    )
    assert max((res.params[k] - ref.params[k]).abs().max().item() for k in ref.params) < 1e-5


def test_dataparallel_on_cpu_says_it_uses_one_device():
    res = experiment.run(SMALL.replace(strategy="dataparallel", world_size=2))
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: DataParallel really splits the batch here")
    assert any("DataParallel found no GPU" in n and "DDP" in n for n in res.notes)


def test_oversubscribed_runs_are_flagged():
    res = experiment.run(SMALL.replace(strategy="ddp", world_size=4, steps=2))
    from labkit.env import cpu_cores

    assert res.records["oversubscribed"].all() == (4 > cpu_cores())
    if 4 > cpu_cores():
        assert any("time-share" in n for n in res.notes)


def test_ddp_per_step_loss_is_the_global_batch_loss():
    cfg = SMALL.replace(deterministic=True)
    single = experiment.run(cfg.replace(strategy="single", world_size=1)).records
    ddp = experiment.run(cfg.replace(strategy="ddp", world_size=2)).records
    ref = single.set_index("step")["loss"]
    got = ddp.groupby("step")["loss"].agg(["min", "max"])
    assert (got["max"] - got["min"]).max() == 0.0  # every rank's record: one number
    assert (got["min"] - ref).abs().max() <= 1e-5, (got, ref)
    shards = ddp.pivot(index="step", columns="rank", values="shard_loss")
    assert (shards[0] - shards[1]).abs().max() > 1e-3  # the ranks' own losses differ


@pytest.mark.parametrize("strategy", ["ddp", "ddp_naive"])
def test_world_size_1_claims_no_communication(strategy):
    df = experiment.run(SMALL.replace(strategy=strategy, world_size=1)).records
    assert (df["comm_s"] == 0).all()
    assert (df["sync_overhead_s"] > 0).any()  # DDP's reducer, a one-rank all-reduce


# a load the test controls: a process pinned to one core (argv[1]) that says so, then spins
SPINNER = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
print("spinning", flush=True)
while True:
    pass
"""
SPINNERS_PER_CORE = 3


def test_a_busy_machine_is_flagged_instead_of_reported_as_speed():
    """Three spinners on each core the ranks run on, each spinning there before the run starts,
    and a step whose compute outlasts a scheduler's time slice (a shorter one can run whole
    before the spinners get their turn): a rank gets about a quarter of its core, far under
    ``BUSY_SHARE`` however fast or idle the machine is otherwise. The summary must flag the run
    busy rather than report its speed."""
    import os
    import subprocess
    import sys

    from labkit.env import usable_cores
    from labkit.launch import own_cores

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("pinning the test's load to the ranks' cores needs Linux's sched_setaffinity")
    cfg = SMALL.replace(
        strategy="ddp", width=1024, depth=3, global_batch=256, steps=8, warmup=1, threads=1
    )
    placed = own_cores(cfg.world_size, cfg.threads)  # None: the OS places the ranks anywhere
    cores = sorted({c for rank in placed for c in rank}) if placed else usable_cores()
    spinners = [
        subprocess.Popen([sys.executable, "-c", SPINNER, str(core)], stdout=subprocess.PIPE)
        for core in cores
        for _ in range(SPINNERS_PER_CORE)
    ]
    try:
        for p in spinners:  # each one on its core and running before the ranks start
            assert p.stdout.readline() == b"spinning\n", "a spinner did not start"
        df = experiment.run(cfg).records
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    table = summarize(df)
    assert table["busy"].all(), table[["run", "cpu_share"]]
    assert table["cpu_share"].iloc[0] < BUSY_SHARE


def test_phases_hold_the_work_put_in_them_and_steps_match_an_outside_clock(tmp_path):
    """Known work in forward (20 ms) and backward (30 ms): each phase must hold it, and the
    probe's step time must match the interval between forwards, read by the model itself."""
    import time

    import torch

    stamps = str(tmp_path / "forward")

    def model_fn(cfg):  # defined here: travels to the ranks by value, classes and all
        class SleepInBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, grad):
                time.sleep(0.030)
                return grad

        class Work(nn.Module):
            def forward(self, x):
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else -1
                with open(f"{stamps}.{rank}", "a") as f:  # a clock the probe never reads
                    f.write(f"{time.perf_counter()}\n")
                time.sleep(0.020)
                return SleepInBackward.apply(x)

        return nn.Sequential(nn.Linear(32, 16), Work(), nn.Linear(16, 10))

    cfg = SMALL.replace(strategy="ddp_naive", steps=6, warmup=1, threads=1)
    records = experiment.run(cfg, model_fn=model_fn).records
    assert (records["forward_s"] >= 0.020).all() and (records["backward_s"] >= 0.030).all()
    assert records["forward_s"].median() < 0.045  # not backward's work too
    for rank in (0, 1):  # each rank's forwards, warm-up's first (file -1: the caller's dry run)
        starts = [float(t) for t in open(f"{stamps}.{rank}").read().split()][cfg.warmup :]
        between = [b - a for a, b in zip(starts, starts[1:])]
        step = records[records["rank"] == rank].sort_values("step")["step_s"].iloc[: len(between)]
        gap = sorted(b - s for b, s in zip(between, step))[len(between) // 2]
        assert 0 <= gap < 0.005, (between, list(step))  # forward to forward = step + a little


def _calibration_slow_on_rank_0(ctx, cfg):
    """DDP's rank, rank 0 finishing its calibration 0.5 s after rank 1."""
    timed = watch.backward_time_without_comm

    def slow(*args, **kwargs):
        seconds = timed(*args, **kwargs)  # (its first forward may meet the peer: DDP's bucket
        if ctx.rank == 0:  # rebuild broadcasts; so the delay comes after it)
            time.sleep(0.5)
        return seconds

    watch.backward_time_without_comm = slow
    return run_rank(ctx, cfg)


def test_a_rank_that_calibrates_later_is_not_read_as_the_next_step_s_communication():
    # each rank times its backward alone before the first measured step: rank 1, done 0.5 s
    # sooner, waits for rank 0 at the calibration's barrier, not in that step's all-reduce
    cfg = SMALL.replace(strategy="ddp", world_size=2)
    first = [r["records"][0] for r in launch(_calibration_slow_on_rank_0, 2, args=(cfg,))]
    for rec in first:
        assert rec["comm_s"] < 0.25 and rec["step_s"] < 0.25, rec
