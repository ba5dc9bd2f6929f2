"""The GPU check (``python -m labkit.gpu_check``, ``make gpu-check``) without a GPU: its table,
its verdicts, and the same rows run on CPU ranks over gloo, so the harness itself is tested here;
on a GPU machine the ``cuda`` test runs part of it for real.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_gpu_check.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from labkit import gpu_check
from labkit.gpu_check import Check, Target
from labkit.launch import launch
from tests.conftest import REPO, cuda_skip_reason
from tests.helpers import ranks
from tests.helpers.gpu_check import read_gpu_check


def test_a_rank_that_raises_fails_its_row_with_the_ranks_own_last_line():
    def rank_raises(target, world_size):
        launch(ranks.raise_on, world_size, args=(1, "gradients went missing"), device="cpu")

    (row,) = gpu_check.run_checks([Check("rank fails", 2, rank_raises)], Target("cpu", "gloo", 2))
    assert row.verdict == "fail"
    assert row.detail == "rank 1: ValueError: gradients went missing", row.detail


@pytest.mark.slow
def test_the_cpu_pass_runs_real_rows_end_to_end_and_they_pass(tmp_path):
    only = "run ddp_naive,check ddp_naive,comm hook fp16,precision bf16"
    assert gpu_check.main(["--cpu", "--only", only, "--out", str(tmp_path)]) == 0
    doc, text = read_gpu_check(tmp_path)
    units = gpu_check.cpu_target().units
    verdicts = {(r["name"], r["world_size"]): r["verdict"] for r in doc["rows"]}
    expected = {("run ddp_naive", w): "pass" if w <= units else "skipped" for w in (1, 2, 4)}
    expected |= {(n, units): "pass" for n in only.split(",")[1:]}
    assert verdicts == expected, text
    detail = {r["name"]: r["detail"] for r in doc["rows"]}
    assert "comm_payload_bytes 0.500x no hook's" in detail["comm hook fp16"]
    assert detail["check ddp_naive"].startswith("max diff")
    assert all(r["device"] == "cpu" and r["backend"] == "gloo" for r in doc["rows"])


def test_the_cuda_marker_skips_with_the_reason_in_the_summary():
    assert cuda_skip_reason(1, 1) is None and cuda_skip_reason(2, 8) is None
    assert cuda_skip_reason(2, 1) == "needs 2 GPUs, 1 present"
    assert "none" in cuda_skip_reason(1, 0)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/ranks/test_probes.py",
        ]
        + ["-k", "cuda_phase_times_add_up"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if torch.cuda.is_available():
        assert "1 passed" in r.stdout, r.stdout
    else:
        assert "SKIPPED" in r.stdout and "cuda: needs 1 CUDA GPU(s)" in r.stdout, r.stdout
        assert "1 skipped" in r.stdout, r.stdout


@pytest.mark.cuda
def test_on_this_machines_gpus_the_check_passes(tmp_path):
    only = "run ddp,check ddp,cuda events,peak memory,comm hook fp16,precision bf16"
    assert gpu_check.main(["--only", only, "--out", str(tmp_path)]) == 0
    doc, _ = read_gpu_check(tmp_path)
    ran = [r for r in doc["rows"] if r["verdict"] == "pass"]
    assert ran and all(r["device"] == "cuda" for r in ran)
    assert any(r["name"] == "cuda events" for r in ran)
