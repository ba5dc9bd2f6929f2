"""Smoke tests: each benchmark runs in its --quick mode and prints/writes what it promises.

No timing assertions: the machine is shared and noisy, so only the output's shape is checked.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
NUMBER = r"\d+\.\d+"


def run_bench(name: str, json_path: Path) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / name), "--quick", "--json", str(json_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout.strip().splitlines()


@pytest.mark.slow
def test_launch_overhead_quick(tmp_path):
    lines = run_bench("launch_overhead.py", tmp_path / "launch.json")
    text = "\n".join(lines)
    for row in ("labkit first launch", "labkit later launch", "mp.spawn"):
        assert re.search(
            rf"^{re.escape(row)}\s+\d+\s+{NUMBER}\s+{NUMBER}\s+{NUMBER}$", text, re.M
        ), f"no table row for {row!r} in:\n{text}"
    assert re.search(rf"^labkit later launch / mp\.spawn: {NUMBER}x$", text, re.M), text
    assert re.search(rf"^labkit first launch / mp\.spawn: {NUMBER}x$", text, re.M), text
    assert ("not installed, skipped" in text) or ("accelerate notebook_launcher" in text), text
    # the baseline is measured beside labkit in the same run, or said to be missing
    assert re.fullmatch(
        rf"labkit/notebook_launcher warm launch ratio: ({NUMBER}|not measured \(Accelerate is "
        r"not installed: `make bench` installs it for this side-by-side\))",
        lines[-1],
    ), lines[-1]
    assert "nan" not in text and "0.154" not in text  # no figure from another run

    out = json.loads((tmp_path / "launch.json").read_text())
    assert out["repeats"] == 2
    assert len(out["samples"]["labkit first launch"]) == 1
    assert len(out["samples"]["labkit later launch"]) == 2
    assert len(out["samples"]["mp.spawn"]) == 2
    assert all(v > 0 for v in out["medians_s"].values())
    assert set(out["ratios"]) >= {
        "labkit first launch / mp.spawn",
        "labkit later launch / mp.spawn",
    }


@pytest.mark.slow
def test_ddp_overhead_quick(tmp_path):
    lines = run_bench("ddp_overhead.py", tmp_path / "ddp.json")
    assert re.fullmatch(r"labkit/raw step-time ratio: \d+\.\d\d", lines[-1]), lines[-1]
    text = "\n".join(lines)
    assert re.search(rf"^probe overhead: {NUMBER} us per step \({NUMBER}% ", text, re.M), text

    out = json.loads((tmp_path / "ddp.json").read_text())
    steps = out["cfg"]["steps"]
    assert out["rounds"] == 1 and steps == 8
    # Every measured step of each side was kept, one max-over-ranks time per step.
    assert len(out["samples_s"]["labkit"]) == len(out["samples_s"]["raw"]) == steps
    assert all(t > 0 for t in out["samples_s"]["labkit"] + out["samples_s"]["raw"])
    # One round: the median of per-round ratios is that round's end-to-end ratio.
    assert out["ratio"] == pytest.approx(
        out["wall_per_step_s"]["labkit"] / out["wall_per_step_s"]["raw"]
    )
    # end to end includes what the probed step cannot see, so it is never below it per step
    assert out["wall_per_step_s"]["labkit"] >= min(out["samples_s"]["labkit"])
    assert out["round_ratios"] == [pytest.approx(out["ratio"])]
    assert f"{out['ratio']:.2f}" == lines[-1].rsplit(" ", 1)[1]
    assert out["probe_overhead_s"] > 0 and out["probe_overhead_fraction"] > 0


@pytest.mark.slow
def test_comm_overhead_quick(tmp_path):
    lines = run_bench("comm_overhead.py", tmp_path / "comm.json")
    assert len(lines) == 3, lines  # two sizes, then the headline
    assert re.fullmatch(
        rf"labkit/bare all_reduce time ratio \(median over sizes\): {NUMBER} "
        rf"\(goal 0\.90-1\.10\)",
        lines[-1],
    ), lines[-1]
    out = json.loads((tmp_path / "comm.json").read_text())
    assert [r["bytes"] for r in out["rows"]] == [16384, 2**20]
    assert all(r["labkit_ms"] > 0 and r["bare_ms"] > 0 for r in out["rows"])


@pytest.mark.slow
def test_load_balance_quick(tmp_path):
    lines = run_bench("load_balance.py", tmp_path / "lb.json")
    runs = ["ddp_naive static", "ddp_naive join", "ddp_naive dynamic", "ddp static", "ddp dynamic"]
    for strategy, policy in (r.split() for r in runs):
        row = rf"^\s*{strategy}\s+{policy}\s+{NUMBER} of ideal \(rounds: {NUMBER}\)"
        assert any(re.match(row, line) for line in lines), lines
    assert re.fullmatch(
        rf"dynamic throughput fraction under a 2x straggler: ddp_naive {NUMBER}, ddp {NUMBER} "
        rf"\(goal >= 0\.90\)",
        lines[-1],
    ), lines[-1]
    out = json.loads((tmp_path / "lb.json").read_text())
    assert [r["policy"] for r in out["rows"]] == ["static", "join", "dynamic", "static", "dynamic"]
    assert all(0 < r["fraction"] <= 1.2 for r in out["rows"])


@pytest.mark.slow
def test_memory_precision_quick(tmp_path):
    lines = run_bench("memory_precision.py", tmp_path / "mem.json")
    for what in (
        "bf16/fp32 activation bytes ratio",
        "checkpointed/plain cnn activation bytes ratio",
        "checkpointed/plain cnn backward time ratio",
    ):
        assert any(re.match(rf"{re.escape(what)}: {NUMBER}", line) for line in lines), lines
    assert re.fullmatch(rf"bf16/fp32 step-time ratio: {NUMBER}", lines[-1]), lines[-1]
    out = json.loads((tmp_path / "mem.json").read_text())
    assert out["precision"]["activation_ratio"] < 0.75  # counted bytes, not timings
    assert out["checkpoint"]["activation_ratio"] < 0.5


def test_sync_async_quick(tmp_path):
    lines = run_bench("sync_async.py", tmp_path / "sa.json")
    for mode in ("ddp", "local_sgd", "diloco", "async_ps", "hogwild"):
        assert sum(bool(re.match(rf"^\s*{mode}\s+\d", line)) for line in lines) == 2, lines
    assert re.fullmatch(
        rf"async_ps / ddp seconds to target under a 3x straggler ratio: "
        rf"({NUMBER}|not measured: .* did not reach the target loss {NUMBER} in any round .*)",
        lines[-1],
    ), lines[-1]
    assert not any(re.search(r"\bnan\b", line) for line in lines[-1:]), lines[-1]
    out = json.loads((tmp_path / "sa.json").read_text())
    assert [r["straggler"] for r in out["rows"]] == [1.0] * 5 + [3.0] * 5


@pytest.mark.slow
def test_comm_drift_quick(tmp_path):
    lines = run_bench("comm_drift.py", tmp_path / "drift.json")
    assert re.fullmatch(rf"launch 0: block medians \(ms\) {NUMBER}, {NUMBER}", lines[0]), lines
    assert re.fullmatch(
        rf"all_reduce 833000 B, median of 5 calls per block: min {NUMBER} ms, "
        rf"max {NUMBER} ms \({NUMBER} x\)",
        lines[-1],
    ), lines[-1]
    out = json.loads((tmp_path / "drift.json").read_text())
    assert len(out["block_medians_s"]) == 1 and len(out["block_medians_s"][0]) == 2
    assert all(m > 0 for m in out["block_medians_s"][0])


@pytest.mark.slow
def test_sched_speed_quick(tmp_path):
    from labkit.labs.sched.policies import POLICIES

    lines = run_bench("sched_speed.py", tmp_path / "sched.json")
    for policy in POLICIES:  # seconds, events, mean JCT (h), utilisation
        row = rf"^{policy}\s+{NUMBER}\s+\d+\s+{NUMBER}\s+{NUMBER}$"
        assert any(re.match(row, x) for x in lines), (policy, lines)
    assert sum("offered load" in x for x in lines) == 2  # 80 % and 120 %: jobs queue
    assert re.fullmatch(
        rf"slowest policy / goal ratio: {NUMBER} \(\w+ at \d+% load, .*\)", lines[-1]
    )
    out = json.loads((tmp_path / "sched.json").read_text())
    assert out["jobs"] == 1000
    assert set(out["times_s"]) == {f"{load}/{p}" for load in (0.8, 1.2) for p in POLICIES}
    assert all(t and all(s > 0 for s in t) for t in out["times_s"].values())


@pytest.mark.slow
def test_predictions_quick(tmp_path):
    lines = run_bench("predictions.py", tmp_path / "pred.json")
    assert re.match(r"predictor \|error\| at world size 2: ", lines[-2]), lines[-2]
    assert re.fullmatch(
        rf"bubble \|predicted - measured\|: max {NUMBER} over rows not busy .*", lines[-1]
    ), lines[-1]
    out = json.loads((tmp_path / "pred.json").read_text())
    assert len(out["steps"]) == 4 and len(out["bubbles"]) == 6
    # every predicted bubble comes from the calibration runs at other M, never from itself
    predicted = [b for b in out["bubbles"] if b["role"] == "predicted"]
    assert predicted and all(b["M"] not in (1, 8) for b in predicted), predicted
    assert "nan" not in lines[-1]


@pytest.mark.slow
def test_torchrun_exit_quick():
    proc = subprocess.run(
        [sys.executable, str(BENCH / "torchrun_exit.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.fullmatch(r"torchrun exit aborts: \d of 3 runs", proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_elastic_quick(tmp_path):
    """A node joins, a worker is killed, a node leaves: each change re-forms the group (a later
    first step), the kill loses at most the steps since its last checkpoint (every 3), and the
    loss curve is the uninterrupted run's (the same global batch every step)."""
    lines = run_bench("elastic.py", tmp_path / "elastic.json")
    assert re.match(rf"cold start \(first agent started -> first step\): {NUMBER} s", lines[0])
    out = json.loads((tmp_path / "elastic.json").read_text())
    events = [c["event"] for c in out["changes"]]
    assert events == ["join", "kill", "leave"], out["changes"]
    sizes = {c["event"]: (c["world_before"], c["world_after"]) for c in out["changes"]}
    assert sizes == {"join": (1, 2), "kill": (2, 2), "leave": (2, 1)}
    for c in out["changes"]:
        assert c["reform_s"] > 0 and c["first_step_after"] > 0, c
    kill = out["changes"][1]
    assert 0 <= kill["steps_lost"] <= 3, kill
    assert out["max_loss_gap"] < 1e-5
