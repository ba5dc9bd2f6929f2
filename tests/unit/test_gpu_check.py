"""The GPU check (``python -m labkit.gpu_check``, ``make gpu-check``) without a GPU: its table,
its verdicts, and the same rows run on CPU ranks over gloo, so the harness itself is tested here;
on a GPU machine the ``cuda`` test runs part of it for real.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_gpu_check.py."""

from __future__ import annotations

import pytest
import torch

from labkit import gpu_check, registry
from labkit.gpu_check import Check, Failed, Skip, Target
from tests.helpers.gpu_check import read_gpu_check

FIELDS = {"name", "world_size", "device", "backend", "verdict", "seconds", "detail", "error"}


def test_without_a_gpu_every_row_is_skipped_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--out", str(tmp_path)]) == 0  # skips are not failures
    doc, text = read_gpu_check(tmp_path)
    rows = doc["rows"]
    assert rows and all(set(r) == FIELDS for r in rows)
    assert {r["verdict"] for r in rows} == {"skipped"}
    why = "no GPU: " + (
        "this torch is a CPU-only build"
        if torch.version.cuda is None
        else "torch.cuda.is_available() is False"
    )
    assert {r["detail"] for r in rows} == {why}
    assert {(r["device"], r["backend"]) for r in rows} == {("cuda", "nccl")}
    assert doc["counts"] == {"pass": 0, "fail": 0, "skipped": len(rows)}
    assert text[-1] == f"0 passed, 0 failed, {len(rows)} skipped"
    assert text[1].split() == ["name", "ws", "device", "backend", "verdict", "seconds", "detail"]
    assert len(text) == len(rows) + 3  # the machine, the header, one line per row, the counts
    # the table lists every promise, even where it cannot run them
    names = {r["name"] for r in rows}
    assert {f"run {s}" for s in registry.STRATEGIES} <= names
    assert {f"check {s}" for s in ("dataparallel", *registry.DATA_PARALLEL)} <= names
    hooks = {f"comm hook {h}" for h in ("fp16", "bf16", "powersgd")}
    assert hooks | {"precision bf16", "precision fp16", "cuda events", "peak memory"} <= names
    assert {"dataparallel on every GPU", "ddp buckets", "fsdp bf16 + checkpointing"} <= names
    sizes = {r["world_size"] for r in rows if r["name"] == "run ddp"}
    assert sizes == {1, 2, 4}


def test_a_row_needing_more_gpus_than_present_is_skipped_with_the_count():
    one_gpu = Target("cuda", "nccl", 1)
    ran = []
    todo = [Check(n, w, lambda t, w: ran.append(w) or "ok") for n, w in (("one", 1), ("two", 2))]
    rows = gpu_check.run_checks(todo, one_gpu)
    assert [(r.verdict, r.detail) for r in rows] == [
        ("pass", "ok"),
        ("skipped", "needs 2 GPUs, 1 present"),
    ]
    assert ran == [1]  # the skipped row never started
    assert [c.world_size for c in gpu_check.checks(one_gpu) if c.name == "run tp"] == [2, 4]
    assert gpu_check.world_sizes(8) == [1, 2, 4, 8] and gpu_check.world_sizes(6) == [1, 2, 4, 6]


def test_a_failing_row_carries_its_error_and_the_rows_after_it_still_run(tmp_path, monkeypatch):
    def broken(target, world_size):
        raise ValueError("a preamble\nthe real reason")

    def wrong(target, world_size):
        gpu_check.expect(1 + 1 == 3, "1 + 1 is 2")

    def missing(target, world_size):
        raise Skip("not on this machine")

    todo = [
        Check("broken", 1, broken),
        Check("wrong", 1, wrong),
        Check("missing", 1, missing),
        Check("fine", 2, lambda t, w: f"ran at {w}"),
    ]
    monkeypatch.setattr(gpu_check, "checks", lambda target: todo)
    assert gpu_check.main(["--cpu", "--out", str(tmp_path)]) == 1  # a row failed
    doc, text = read_gpu_check(tmp_path)
    got = [(r["name"], r["verdict"], r["detail"]) for r in doc["rows"]]
    assert got == [
        ("broken", "fail", "ValueError: the real reason"),
        ("wrong", "fail", "Failed: 1 + 1 is 2"),
        ("missing", "skipped", "not on this machine"),
        ("fine", "pass", "ran at 2"),
    ]
    assert "Traceback" in doc["rows"][0]["error"] and "a preamble" in doc["rows"][0]["error"]
    assert doc["rows"][3]["error"] == "" and doc["rows"][3]["backend"] == "gloo"
    assert text[-1] == "1 passed, 2 failed, 1 skipped"


def test_the_time_budget_skips_rows_not_started_and_says_so():
    rows = gpu_check.run_checks(
        [Check("late", 1, lambda t, w: "ran")], Target("cpu", "gloo", 2), deadline=0.0
    )
    assert rows[0].verdict == "skipped"
    assert rows[0].detail == "the time budget (--budget-s) was spent"


def test_a_hook_row_fails_when_nothing_was_counted(monkeypatch):
    # a ratio of zero bytes to zero bytes must not read as "compressed"
    class Res:
        cfg, notes = None, []

    monkeypatch.setattr(gpu_check, "run", lambda cfg: Res())
    monkeypatch.setattr(gpu_check, "trained", lambda res, target: "")
    monkeypatch.setattr(gpu_check, "per_step", lambda res, column: 0.0)
    with pytest.raises(Failed, match="nothing counted"):
        gpu_check.hook_row("powersgd")(Target("cpu", "gloo", 2), 2)
