"""Model parallelism and pipelines: schedules and theory, equivalence with single-device
training, the measured bubble against (P-1)/(M+P-1), stage balancing, and the CLI records.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_pipeline.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from labkit import RunConfig, models
from labkit.experiment import run
from labkit.labs import equivalence, pipeline_bubble
from labkit.models import even_bounds, make_model
from labkit.pipeline_schedules import rank_actions
from labkit.rank.layer_timing import layer_costs
from labkit.rank.probes import TIME_COLUMNS
from labkit.registry import STRATEGIES

# A small model: equivalence runs are about arithmetic, not speed.
SMALL = RunConfig(
    strategy="single",
    world_size=1,
    steps=3,
    warmup=1,
    global_batch=32,
    width=64,
    depth=4,
    dataset_size=256,
    deterministic=True,
    timeout_s=120,
)


# ---- equivalence with single -------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_params():
    return run(SMALL).params


@pytest.mark.parametrize(
    "strategy,impl,stages,microbatches,virtual",
    [
        ("model_parallel", "scratch", 2, 1, None),
        ("pipeline_gpipe", "scratch", 2, 4, None),
        ("pipeline_1f1b", "scratch", 2, 4, None),
        ("pipeline_gpipe", "torch", 2, 4, None),
        ("pipeline_1f1b", "torch", 2, 4, None),
        ("pipeline_1f1b", "scratch", 3, 8, None),
        ("pipeline_interleaved", "scratch", 2, 4, 2),
        ("pipeline_interleaved", "torch", 2, 4, 2),
        ("pipeline_zb", "torch", 2, 4, 1),
        ("pipeline_zb", "torch", 2, 4, 2),
        ("pipeline_zbv", "torch", 2, 4, None),
        ("pipeline_dualpipev", "torch", 2, 4, None),
    ],
)
def test_same_parameters_as_single(single_params, strategy, impl, stages, microbatches, virtual):
    cfg = SMALL.replace(
        strategy=strategy,
        world_size=stages,
        stages=stages,
        microbatches=microbatches,
        pipeline_impl=impl,
        virtual_stages=virtual,
    )
    res = run(cfg)
    assert set(res.params) == set(single_params)
    diff = max((res.params[k] - v).abs().max().item() for k, v in single_params.items())
    assert diff < 1e-5, f"{strategy}/{impl} differs from single by {diff:g}"

    df = res.records
    M = 1 if strategy == "model_parallel" else microbatches
    schedule = STRATEGIES[strategy].schedule
    order = pipeline_bubble.schedule_order(strategy, stages, M, virtual)
    v = order["virtual"]
    assert len(df) == stages * cfg.steps and set(df["stage"]) == set(range(stages))
    assert (df["microbatches"] == M).all() and (df["impl"] == impl).all()
    assert (df["virtual_stages"] == v).all()
    held = pipeline_bubble.activations_in_flight(order["events"])
    for rec in df.to_dict("records"):
        events = sorted(rec["events"], key=lambda e: e["start"])
        ran = [(e["kind"], e["microbatch"], e["chunk"]) for e in events]
        # what ran is what the executor was told (labkit's order, or what torch's schedule
        # object lowered, read in the rank) and what the simulator runs (read apart, here)
        assert ran == [tuple(a) for a in rec["planned"]], rec["stage"]
        assert ran == rank_actions(schedule, stages, M, rec["stage"], v), rec["stage"]
        assert all(0 <= e["start"] <= e["end"] <= rec["step_s"] for e in rec["events"])
        # the meter's micro-batch chunks held at once: the order's own count
        assert rec["activations_peak"] == held[rec["stage"]], (rec["stage"], held)
        assert rec["activation_bytes_peak"] > 0 and 0 <= rec["bubble_fraction"] < 1
        phases = sum(rec[c] for c in TIME_COLUMNS if c != "step_s")
        assert phases == pytest.approx(rec["step_s"], rel=1e-6)  # "other" is the rest, by name
        if impl == "scratch" and stages > 1:  # every stage waits for a message: timed where
            assert rec["comm_s"] > 0 and rec["comm_bytes"] > 0  # it blocks, counted where sent
    # every chunk ran every micro-batch forward once and backward once (B, or I then W)
    for _, g in df.groupby("step"):
        done = sorted((e["chunk"], e["microbatch"], e["kind"]) for evs in g["events"] for e in evs)
        want = "FIW" if STRATEGIES[strategy].schedule in ("zb",) else None
        for c in range(stages * v):
            for m in range(M):
                kinds = "".join(sorted(k for cc, mm, k in done if (cc, mm) == (c, m)))
                assert kinds in ("BF", "FIW") and (want is None or kinds == want), (c, m, kinds)
    # activation bytes: the order's in-flight chunks x each chunk's bytes from the calculator
    memory = pipeline_bubble.activation_table(df, cfg)
    assert (memory["bytes_error"] == 0).all(), memory.to_dict("records")
    # every stage reports the global batch's loss, which the last stage computed
    assert df.groupby("step")["loss"].nunique().eq(1).all()


def test_interleaved_on_three_ranks_equals_single():
    # three ranks, two chunks each: activations and gradients cross every pair of neighbours,
    # the last rank's chunk hands on to the first rank's (the loop wraps round)
    cfg = SMALL.replace(strategy="pipeline_interleaved", depth=6, stages=3, world_size=3,
                        microbatches=6, global_batch=48)  # fmt: skip
    for impl in ("scratch", "torch"):
        table = equivalence.check(cfg.replace(pipeline_impl=impl), ["pipeline_interleaved"],
                                  world_size=3, steps=3)  # fmt: skip
        assert table["ok"].all(), table.to_dict("records")


def test_gpipe_holds_more_activation_bytes_than_1f1b():
    cfg = SMALL.replace(
        strategy="pipeline_gpipe",
        world_size=2,
        stages=2,
        microbatches=8,
        deterministic=False,
        steps=2,
    )
    held = {
        s: run(cfg.replace(strategy=s)).records.query("stage == 0")["activation_bytes_peak"].max()
        for s in ("pipeline_gpipe", "pipeline_1f1b")
    }
    # stage 0 holds all 8 micro-batches under GPipe and P=2 under 1F1B: 4x the bytes
    assert held["pipeline_gpipe"] == 4 * held["pipeline_1f1b"]


# ---- the measured bubble against the prediction and the theory -------------------------------

# The bubble predicted from other runs. Whether a prediction lands near a real measurement
# depends on the machine (at the defaults a hand-off costs about a micro-batch's compute and one
# scheduler tick moves a step; this test failed on its first attempt once when it asserted
# 0.2), so no test asserts it: tests/unit/test_pipeline.py holds bubble_table to a seeded
# pretend machine (deterministic, and it fails with a wrong predictor), and notebooks 04 and 05
# show the error on this machine. Here, real runs at width 1024 (compute dominates) through the
# same table: calibration at the smallest and largest M, predictions at the others, the error
# the difference, the closed forms the papers'.
WIDE = RunConfig(
    strategy="pipeline_gpipe", world_size=2, stages=2, steps=6, warmup=1, threads=1,
    timeout_s=180, global_batch=1024, width=1024, depth=5, dataset_size=1024,
)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,counts",
    [("pipeline_1f1b", (1, 2, 4, 8)), ("pipeline_interleaved", (2, 4, 8)),
     ("pipeline_zb", (2, 4, 8))],
)  # fmt: skip
def test_bubble_table_predicts_real_runs_out_of_sample(schedule, counts):
    runs = [run(WIDE.replace(strategy=schedule, microbatches=M)).records for M in counts]
    table = pipeline_bubble.bubble_table(pd.concat(runs, ignore_index=True), min_cpu_share=None)
    report = table.round(3).to_dict("records")
    predicted = table[table["role"] == "predicted"]
    assert list(predicted["microbatches"]) == list(counts[1:-1]), report
    assert predicted["bubble_predicted"].between(0, 1).all(), report
    assert (
        predicted["error"] == predicted["bubble_predicted"] - predicted["bubble_fraction"]
    ).all()
    assert table.loc[table["role"] == "calibration", "bubble_predicted"].isna().all()
    P, v = 2, int(table["virtual_stages"].iloc[0])
    for row in table.to_dict("records"):
        M = row["microbatches"]
        want = {"1f1b": (P - 1) / M, "interleaved": (P - 1) / (v * M), "zb": (P - 1) / (3 * M)}
        assert row["closed_form"] == pytest.approx(want[row["schedule"]]), row
    print(table.round(3).to_string())  # the error on this machine: pytest -s


@pytest.mark.parametrize("impl", ["scratch", "torch"])
@pytest.mark.parametrize("stages", [2, 3])
def test_every_rank_s_events_share_one_clock(impl, stages):
    # causality on one clock: no stage starts micro-batch m's forward before the previous stage
    # has finished it, nor its backward before the next stage has (the hand-off comes on top)
    cfg = SMALL.replace(
        strategy="pipeline_1f1b",
        world_size=stages,
        stages=stages,
        microbatches=4,
        deterministic=False,
        pipeline_impl=impl,
        steps=4,
    )
    df = run(cfg).records
    for step, g in df.groupby("step"):
        end = {
            (e["kind"], e["stage"], e["microbatch"]): e["end"] for evs in g["events"] for e in evs
        }
        for evs in g["events"]:
            for e in evs:
                s, m = e["stage"], e["microbatch"]
                dep = ("F", s - 1, m) if e["kind"] == "F" else ("B", s + 1, m)
                if dep in end:
                    assert e["start"] >= end[dep], (step, e, dep, end[dep])
        assert min(e["start"] for evs in g["events"] for e in evs) >= 0


# ---- stage balancing ---------------------------------------------------------------------------


def test_balancing_evens_out_the_stages():
    cfg = RunConfig(
        strategy="pipeline_1f1b",
        world_size=2,
        stages=2,
        microbatches=4,
        steps=8,
        warmup=1,
        model="unbalanced_mlp",
        width=512,
        depth=4,
        global_batch=256,
        dataset_size=512,
        threads=1,
        timeout_s=120,
    )
    model = make_model(cfg)
    costs = layer_costs(model, torch.randn(cfg.global_batch // 4, cfg.in_features))
    balanced = models.partition(costs, 2)
    even = even_bounds(len(model), 2)
    assert balanced != even
    assert max(models.stage_costs(costs, balanced)) < max(models.stage_costs(costs, even))

    def imbalance(df):  # the busiest stage's compute over the idlest's (medians over steps)
        per_stage = (df["forward_s"] + df["backward_s"]).groupby(df["rank"]).median()
        return per_stage.max() / per_stage.min()

    # a ratio within each run, so the VM's drift (one run's step moved by 30 % from the next, and
    # a fresh clone once measured both runs ~40 % slower than here) cancels; measured here:
    # 6.3-7.6 with equal layer counts, 1.75-2.2 balanced
    before, after = run(cfg).records, run(cfg.replace(balance_stages=True)).records
    assert imbalance(after) < 0.5 * imbalance(before), (imbalance(before), imbalance(after))


# ---- the command line --------------------------------------------------------------------------


def test_cli_compare_records_carry_events_and_bubble(tmp_path):
    out = tmp_path / "pp.json"
    cmd = [
        sys.executable,
        "-m",
        "labkit",
        "compare",
        "--strategies",
        "model_parallel,pipeline_gpipe,pipeline_1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--width",
        "64",
        "--dataset-size",
        "256",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = json.loads(out.read_text())["records"]
    assert {r["strategy"] for r in records} == {"model_parallel", "pipeline_gpipe", "pipeline_1f1b"}
    for r in records:
        assert 0 <= r["bubble_fraction"] < 1 and r["events"]
        assert set(r["events"][0]) == {"stage", "chunk", "microbatch", "kind", "start", "end"}


def test_cli_check_accepts_pipeline_strategies():
    cmd = [
        sys.executable,
        "-m",
        "labkit",
        "check",
        "--strategies",
        "model_parallel,pipeline_gpipe,pipeline_1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--steps",
        "2",
        "--width",
        "64",
        "--dataset-size",
        "256",
        "--pipeline-impl",
        "torch",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "all strategies match single" in proc.stdout


def test_cli_check_runs_the_schedules_beyond_1f1b():
    # the command: interleaved on labkit's executor, zero bubble on torch's ("auto")
    cmd = [sys.executable, "-m", "labkit", "check", "--strategies",
           "pipeline_interleaved,pipeline_zb,pipeline_zbv,pipeline_dualpipev", "--world-size",
           "2", "--steps", "3", "--width", "64", "--dataset-size", "256"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "all strategies match single within 1e-05" in proc.stdout


def test_data_times_pipeline_equals_single_and_runs_one_pipeline_per_replica():
    # 2 copies of a 2-stage pipeline on 4 ranks (oversubscribed on 2 cores: exact all the same)
    cfg = SMALL.replace(strategy="dp_pp", world_size=4, stages=2, microbatches=2, steps=3)
    table = equivalence.check(cfg, ["dp_pp"], world_size=4, steps=3)
    assert table["ok"].all(), table.to_dict("records")
    df = run(cfg).records
    assert sorted({(r, s) for r, s in zip(df["replica"], df["stage"])}) == [
        (0, 0), (0, 1), (1, 0), (1, 1)
    ]  # fmt: skip
    assert (df["samples"] == cfg.global_batch // 2).all()  # each replica: half the batch
    assert df["bubble_fraction"].between(0, 1).all()
    # each stage averages with its twin in the other replica: one all-reduce of its weights
    model = make_model(cfg)
    halves = models.split(model, even_bounds(len(model), 2))
    params = [sum(p.numel() * 4 for p in half.parameters()) for half in halves]
    act = cfg.global_batch // 2 * cfg.width * 4  # a replica's activations, forward or back
    for (replica, stage), g in df.groupby(["replica", "stage"]):
        # at 2 replicas the ring all-reduce sends the stage's weights once; plus the messages
        assert (g["comm_bytes"] == params[stage] + act).all(), (replica, stage, g["comm_bytes"])


def test_pipeline_records_memory_by_category_per_stage():
    """Each stage counts its own parameters (the split, weighed apart from the meter), their
    gradients and SGD's momentum (one of each per parameter), and the activations its schedule
    held at once: GPipe all M micro-batches', 1F1B at most P - stage (M=4, P=2: stage 0 holds
    2, stage 1 holds 1)."""
    cfg = RunConfig(strategy="pipeline_gpipe", world_size=2, stages=2, microbatches=4, steps=1)
    model = make_model(cfg)
    own = [
        sum(p.numel() * 4 for p in s.parameters())
        for s in models.split(model, even_bounds(len(model), 2))
    ]
    held = {}
    for strategy in ("pipeline_gpipe", "pipeline_1f1b"):
        r = run(cfg.replace(strategy=strategy)).records.set_index("stage")
        for col in ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes"):
            assert r[col].tolist() == own, (strategy, col)
        held[strategy] = r["mem_activations_bytes"]
    assert (held["pipeline_gpipe"] / held["pipeline_1f1b"]).tolist() == [4 / 2, 4 / 1]
