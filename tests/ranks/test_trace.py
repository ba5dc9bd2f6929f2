"""Chrome traces of runs (labkit.trace): what a trace reader needs, and the records' numbers.

Perfetto's trace processor cannot be installed offline here, so the trace is checked against
the Trace Event Format's documented fields (the JSON object form: ``traceEvents``; complete
events ``ph: "X"`` with ``ts`` and ``dur`` in microseconds; instant events ``ph: "i"`` with a
scope; metadata events ``ph: "M"`` naming processes and threads) by a reader written here from
that document, not by labkit's writer, and against the records it was made from: for one
strategy of each kind, events on every thread nest, a rank's steps follow each other, each
step's events add up to its measured ``step_s`` and each phase to its column, and the median
step, gated by the slowest rank, is the table's.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_trace.py."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from labkit import RunConfig, experiment
from labkit.rank.probes import TIME_COLUMNS
from labkit.records import summarize
from labkit.trace import to_chrome_trace
from tests.helpers.torchrun import torchrun_standalone
from tests.helpers.traces import EVERY_KIND, NS, crossings, timeline

SMALL = RunConfig(width=64, depth=2, steps=3, warmup=1, global_batch=32, dataset_size=512)
KEYS = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "i": {"name", "ph", "ts", "pid"},
        "M": {"name", "ph", "pid", "args"}}  # fmt: skip


def read(path) -> dict:
    """A Trace Event Format reader: every event well formed, names per process and thread."""
    trace = json.loads(open(path).read())
    assert isinstance(trace["traceEvents"], list)
    processes, threads = {}, {}
    for e in trace["traceEvents"]:
        assert KEYS.get(e["ph"], {"ph"}) <= set(e), e  # other kinds (flows...): their own
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
        if e["ph"] == "i":
            assert e.get("s", "t") in ("g", "p", "t"), e  # scope: global, process, thread
        if e["ph"] == "M" and e["name"] == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        if e["ph"] == "M" and e["name"] == "thread_name":
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    return {"trace": trace, "processes": processes, "threads": threads}


def test_a_ddp_and_a_pipeline_run_trace_one_process_per_rank_on_one_clock(tmp_path):
    ddp = experiment.run(SMALL.replace(strategy="ddp")).records
    pipe = experiment.run(SMALL.replace(strategy="pipeline_1f1b", microbatches=4)).records
    both = pd.concat([ddp, pipe], ignore_index=True)
    to_chrome_trace(both, tmp_path / "t.json", meta={"command": "test"})
    got = read(tmp_path / "t.json")
    assert sorted(got["processes"].values()) == [
        "rank 0 (ddp@2)", "rank 0 (pipeline_1f1b@2)", "rank 1 (ddp@2)", "rank 1 (pipeline_1f1b@2)"
    ]  # fmt: skip
    assert set(got["threads"].values()) == {"compute", "communication in flight"}
    events = got["trace"]["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    pid = {name: p for p, name in got["processes"].items()}
    # ddp: each rank's compute phases add up to its step_s, in the records' order
    for rank in (0, 1):
        mine = [e for e in complete if e["pid"] == pid[f"rank {rank} (ddp@2)"] and e["tid"] == 0]
        steps = ddp[ddp["rank"] == rank].set_index("step")["step_s"]
        for step, want in steps.items():
            total = sum(e["dur"] for e in mine if e["args"]["step"] == step) / 1e6
            assert total == pytest.approx(want, abs=1e-5)
        assert {"forward", "backward", "optimizer"} <= {e["name"] for e in mine}
        comm = [e for e in complete if e["pid"] == mine[0]["pid"] and e["tid"] >= 1]
        assert len(comm) == ddp[ddp["rank"] == rank]["comm_calls"].sum()  # one per collective
        assert all(e["name"] == "all_reduce" for e in comm)
    # the pipeline: each stage's forward and backward per micro-batch, stage and index in args
    stage0 = [e for e in complete if e["pid"] == pid["rank 0 (pipeline_1f1b@2)"]]
    fwd = [e for e in stage0 if e["name"].startswith("forward mb")]
    assert len(fwd) == SMALL.steps * 4 and {e["args"]["microbatch"] for e in fwd} == {0, 1, 2, 3}
    assert {e["args"]["stage"] for e in fwd} == {0}
    # one clock: stage 1 starts micro-batch m's forward after stage 0 has finished it
    stage1 = [e for e in complete if e["pid"] == pid["rank 1 (pipeline_1f1b@2)"]]
    for e in (e for e in stage1 if e["name"].startswith("forward mb")):
        done = next(f for f in fwd if f["args"]["step"] == e["args"]["step"]
                    and f["args"]["microbatch"] == e["args"]["microbatch"])  # fmt: skip
        assert e["ts"] >= done["ts"] + done["dur"] - 1  # (rounded to the microsecond)
    steps = [e for e in events if e["ph"] == "i" and e["name"].startswith("step ")]
    assert len(steps) == 4 * SMALL.steps  # 2 runs x 2 ranks
    other = got["trace"]["otherData"]
    assert other["world_sizes"] == [2] and other["command"] == "test" and "busy" in other


PHASES = {c.removesuffix("_s") for c in TIME_COLUMNS} - {"step"}  # a record's phase columns


@pytest.mark.parametrize("strategy", list(EVERY_KIND))
def test_every_strategys_trace_nests_and_tiles_its_measured_steps(strategy, tmp_path):
    records = experiment.run(SMALL.replace(strategy=strategy, **EVERY_KIND[strategy])).records
    to_chrome_trace(records, tmp_path / "t.json")
    got = timeline(read(tmp_path / "t.json")["trace"])
    for (pid, tid), spans in got["threads"].items():
        assert crossings(spans) == [], (got["ranks"][pid], tid)
    drawn = {}  # (rank, step) -> the ns its events add up to
    for pid, rank in got["ranks"].items():
        mine = [s for s in got["threads"][pid, 0] if "phase" in s[2]["args"]]
        recs = records[records["rank"] == rank].set_index("step")
        assert sorted({s[2]["args"]["step"] for s in mine}) == sorted(recs.index)
        previous_end = None
        for step, rec in recs.sort_index().iterrows():
            spans = [s for s in mine if s[2]["args"]["step"] == step]
            begin, end = min(s[0] for s in spans), max(s[1] for s in spans)
            assert previous_end is None or previous_end <= begin, (rank, step)  # in turn
            previous_end = end
            total = sum(s[1] - s[0] for s in spans)
            want = rec["step_s"] * 1e9
            assert total == pytest.approx(want, rel=0.01) and end - begin == pytest.approx(
                want, rel=0.01
            ), (rank, step)
            assert {s[2]["args"]["phase"] for s in spans} <= PHASES
            for phase in PHASES:  # each of the record's phases, drawn in full
                part = sum(s[1] - s[0] for s in spans if s[2]["args"]["phase"] == phase)
                assert part == pytest.approx(rec[f"{phase}_s"] * 1e9, rel=0.01, abs=1e3), (
                    rank, step, phase
                )  # fmt: skip
            drawn[rank, step] = total
    # the table's step: each step gated by its slowest rank, the lower median of those
    gated = sorted(
        max(ns for (_, s), ns in drawn.items() if s == step) for step in {s for _, s in drawn}
    )
    median_ms = gated[(len(gated) - 1) // 2] / 1e6
    assert median_ms == pytest.approx(summarize(records)["step_ms"].iloc[0], abs=1e-3)
    if strategy == "async_ps":  # the server's update: wait for a push, apply it, reply
        pid = next(pid for pid, rank in got["ranks"].items() if rank == 0)
        server = [s for s in got["threads"][pid, 0] if "phase" in s[2]["args"]]
        for step in {s[2]["args"]["step"] for s in server}:
            order = [s[2]["args"]["phase"] for s in sorted(server) if s[2]["args"]["step"] == step]
            assert order == ["wait", "optimizer", "comm"], (step, order)


@pytest.mark.parametrize("strategy", ["pipeline_gpipe", "pipeline_1f1b"])
def test_a_pipelines_receives_are_drawn_per_micro_batch_after_their_sender(strategy, tmp_path):
    M = 4
    records = experiment.run(SMALL.replace(strategy=strategy, microbatches=M)).records
    to_chrome_trace(records, tmp_path / "t.json")
    got = timeline(read(tmp_path / "t.json")["trace"])
    by_rank = {rank: got["threads"][pid, 0] for pid, rank in got["ranks"].items()}

    def ends(rank: int, prefix: str) -> dict:
        return {(s[2]["args"]["step"], s[2]["args"]["microbatch"]): s[1]
                for s in by_rank[rank] if s[2]["name"].startswith(prefix)}  # fmt: skip

    every = {(step, m) for step in range(SMALL.steps) for m in range(M)}
    # stage 1 receives each micro-batch's activations once stage 0's forward has made them;
    # stage 0 each gradient once stage 1's backward has
    for receiver, recv, sender, made in ((1, "recv activations", 0, "forward mb"),
                                         (0, "recv gradient", 1, "backward mb")):  # fmt: skip
        got_at, made_at = ends(receiver, recv), ends(sender, made)
        assert set(got_at) == set(made_at) == every
        assert all(got_at[k] >= made_at[k] - NS for k in every), (recv, got_at, made_at)
    for rank in (0, 1):  # the sends' completion closes each stage's schedule
        sends = [s for s in by_rank[rank] if s[2]["name"] == "wait for sends"]
        assert {s[2]["args"]["step"] for s in sends} == set(range(SMALL.steps))


def test_checkpoint_saves_are_marked(tmp_path):
    cfg = SMALL.replace(strategy="ddp", checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    records = experiment.run(cfg.replace(steps=4)).records
    trace = to_chrome_trace(records)
    saves = [e for e in trace["traceEvents"] if e["name"] == "checkpoint save"]
    # after optimizer steps 2 and 4 (one warm-up step first: measured steps 0 and 2) and the
    # last (measured step 3), as labkit.rank.resume writes them
    assert {e["args"]["step"] for e in saves} == {0, 2, 3}
    assert all(e["dur"] > 0 for e in saves)


def test_profile_dir_writes_one_torch_profiler_trace_per_rank_with_labkits_phases(tmp_path):
    cfg = SMALL.replace(strategy="ddp", steps=4, profile_dir=str(tmp_path / "prof"))
    experiment.run(cfg)
    files = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert files == ["ddp@2_rank0.json", "ddp@2_rank1.json"]
    for name in files:
        trace = read(tmp_path / "prof" / name)["trace"]
        names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
        # labkit's phases as ranges, PyTorch's own operators inside them
        assert {"data", "forward", "backward", "comm", "optimizer"} <= names, sorted(names)[:40]
        assert any(n.startswith("aten::") for n in names)
        assert any("allreduce" in n.replace("_", "") for n in names), sorted(names)
        steps = [e for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep")]
        assert 1 <= len(steps) <= 5


def test_compare_and_the_torchrun_worker_write_traces(tmp_path):
    import os
    import subprocess
    import sys

    small = ["--steps", "3", "--warmup", "1", "--width", "64", "--depth", "2",
             "--global-batch", "32", "--dataset-size", "512"]  # fmt: skip
    r = subprocess.run(
        [sys.executable, "-m", "labkit", "compare", "--strategies", "ddp,pipeline_1f1b",
         "--world-sizes", "2", *small, "--trace", str(tmp_path / "c.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert len(read(tmp_path / "c.json")["processes"]) == 4  # 2 runs x 2 ranks
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = torchrun_standalone(
        "--strategy", "ddp", *small, "--trace", str(tmp_path / "w.json"), env=env
    )
    assert r.returncode == 0, r.stdout + r.stderr
    got = read(tmp_path / "w.json")
    assert sorted(got["processes"].values()) == ["rank 0, node 0", "rank 1, node 0"]
