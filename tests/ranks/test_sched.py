"""The scheduling lab: every policy on tiny hand-computed traces (exact JCTs), the trace format's
errors, determinism by seed, the CLI's argument checks and the real replay on a 3-job trace.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_sched.py."""

from __future__ import annotations

import subprocess
import sys

from labkit.labs.sched import traces
from tests.helpers.procs import pid_alive, wait_gone


def test_cli_prints_a_table_per_policy(tmp_path):
    trace = tmp_path / "t.csv"
    traces.to_csv(traces.generate(40, seed=1, rate_per_hour=3), str(trace))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "labkit",
            "schedule",
            "--trace",
            str(trace),
            "--cluster",
            "2x8",
            "--policy",
            "fifo,las,elastic",
            "--json",
            str(tmp_path / "m.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for p in ("fifo", "las", "elastic"):
        assert p in out.stdout
    assert "mean JCT" in out.stdout
    import json

    rows = json.loads((tmp_path / "m.json").read_text())["metrics"]
    assert [r["policy"] for r in rows] == ["fifo", "las", "elastic"]


def _children() -> set:
    """Every live process below this one but multiprocessing's own helpers (the forkserver and
    the resource tracker, started once and kept): a rank the forkserver forked counts."""
    import psutil

    me = psutil.Process()
    helpers = set()
    for p in me.children():
        try:
            if any(h in " ".join(p.cmdline()) for h in ("forkserver", "resource_tracker")):
                helpers.add(p.pid)
        except psutil.Error:  # gone, or a zombie whose command line cannot be read
            continue
    return {p.pid for p in me.children(recursive=True) if p.pid not in helpers and pid_alive(p.pid)}


def _left_after(before: set, grace_s: float = 2.0) -> set:
    """What this test started and is still running ``grace_s`` after it returned (a launch
    reaps its killed ranks on a background thread: a dying rank gets that long to exit)."""
    wait_gone(_children() - before, grace_s)
    return _children() - before


# each replayed step lasts at least this long (RunConfig.pace_s): a job of n steps runs for at
# least n x PACE_S whatever the machine's speed, so the trace's arrivals meet it while it runs
PACE_S = 0.05


def test_replay_on_a_three_job_trace_preempts_for_real_and_leaves_no_process(monkeypatch):
    """Job 0's 80 paced steps last at least 4 s, so job 1 (high priority, arriving at 1 s)
    always finds it running: however fast or idle the machine, the replay must evict it."""
    from labkit.labs.sched import replay

    paces, handle = [], replay._Handle  # the pace every real run was launched with
    monkeypatch.setattr(replay, "_Handle", lambda cfg: paces.append(cfg.pace_s) or handle(cfg))

    cal = replay.Calibration({1: 20.0, 2: 30.0}, {1: 0.5, 2: 0.7}, 0.1)  # for the simulator
    trace = [
        replay.ReplayJob(0, 0.0, 1, 80),
        replay.ReplayJob(1, 1.0, 2, 12, priority=1),
        replay.ReplayJob(2, 1.2, 1, 10),
    ]
    before = _children()
    report = replay.check(trace, ["priority"], calibration=cal, pace_s=PACE_S)
    jobs = report.real["priority"][0]
    assert all(j.finish_s is not None for j in jobs)
    # job 1 (high priority, 2 workers) arrives while job 0 runs and evicts it: a real stop, and
    # later a resume from job 0's checkpoint; the simulator makes the same decision
    assert jobs[0].restarts == 1 and jobs[0].start_s < 1.0
    assert paces == [PACE_S] * 4  # job 0, job 1, job 0 resumed, job 2
    assert report.jobs["real_restarts"].sum() == report.jobs["sim_restarts"].sum() == 1
    assert set(report.table.columns) >= {"policy", "sim_mean_jct_s", "real_mean_jct_s", "error"}
    assert _left_after(before) == set()


def test_replay_resizes_an_elastic_job_for_real():
    """Job 0's 120 paced steps last at least 6 s: it is still running at the 1 s round."""
    from labkit.labs.sched import replay

    cal = replay.Calibration({1: 20.0, 2: 30.0}, {1: 0.5, 2: 0.7}, 0.1)  # 2 workers gain 0.5
    trace = [replay.ReplayJob(0, 0.0, 1, 120), replay.ReplayJob(1, 1.5, 1, 10)]
    before = _children()
    jobs, gantt = replay.execute(trace, "elastic", cal, round_s=1.0, pace_s=PACE_S)
    assert all(j.finish_s is not None for j in jobs)
    # alone at the 1 s round, job 0 grows to 2 workers: its 1-worker run is stopped and its
    # checkpoint resumed by a 2-rank ddp run
    assert jobs[0].restarts >= 1
    assert any(g["job_id"] == 0 and g["gpus"] == 2 for g in gantt), gantt
    assert _left_after(before) == set()


def test_cli_replay_recalibrates_before_each_policy(tmp_path):
    """``schedule --replay``: real runs on this machine's cores, measured again before every
    policy after the first (the log says so), each policy's real and simulated mean JCT in the
    JSON it writes."""
    out = subprocess.run(
        [sys.executable, "-m", "labkit", "schedule", "--replay", "--generate", "3"]
        + ["--cluster", "1x2", "--policy", "fifo,las", "--json", str(tmp_path / "r.json")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("calibrating again") == 1, out.stdout
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    rows = {r["policy"]: r for r in report["table"]}
    assert set(rows) == {"fifo", "las"}
    assert all(r["real_mean_jct_s"] > 0 and r["sim_mean_jct_s"] > 0 for r in rows.values())
