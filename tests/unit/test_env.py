"""labkit.env: the machine probe, device resolution and the oversubscription warning.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_env.py."""

from __future__ import annotations

import json
import os
import platform

import pytest
import torch

from labkit import env


def _pretend_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_probe_describes_this_machine():
    report = env.probe()
    assert report.python == platform.python_version()
    assert report.torch == torch.__version__
    assert report.cpu_cores == env.cpu_cores() == len(os.sched_getaffinity(0))
    assert report.backends["gloo"] is True
    assert report.backend == env.default_backend(report.device)
    if report.devices:
        assert report.device == "cuda" and report.max_world_size == len(report.devices)
    else:
        assert report.device == "cpu" and report.backend == "gloo"
        assert report.max_world_size == report.cpu_cores
        assert report.backends["nccl"] is False  # no GPU: nccl is not usable here


def test_probe_report_is_json_text_and_html():
    report = env.probe()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["torch"] == torch.__version__ and data["cpu_cores"] == report.cpu_cores
    text = str(report)
    assert f"torch {torch.__version__}" in text and f"CPU cores: {report.cpu_cores}" in text
    assert "largest honest world size" in text
    if not report.devices:
        assert "GPUs: none" in text
    html = report._repr_html_()
    assert html.startswith("<table>") and "largest honest world size" in html


def test_resolve_device_on_cpu_only(monkeypatch):
    _pretend_gpus(monkeypatch, 0)
    assert env.resolve_device("auto", 4) == "cpu"
    assert env.resolve_device("cpu", 4) == "cpu"
    with pytest.raises(ValueError, match="no usable GPU: use device='cpu'"):
        env.resolve_device("cuda", 1)
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda'"):
        env.resolve_device("gpu", 1)


def test_more_gpu_ranks_than_gpus_names_the_fix(monkeypatch):
    _pretend_gpus(monkeypatch, 1)
    assert env.resolve_device("auto", 1) == "cuda"
    assert env.resolve_device("auto", 2) == "cpu"  # auto falls back rather than share
    assert env.resolve_device("cuda", 1) == "cuda"
    with pytest.raises(
        ValueError,
        match="world size 2 needs 2 GPUs .* has 1: lower world_size to 1 or use device='cpu'",
    ):
        env.resolve_device("cuda", 2)


def test_oversubscription_is_flagged_past_the_core_count(monkeypatch):
    monkeypatch.setattr(env, "cpu_cores", lambda: 2)
    assert env.oversubscription(2) is None
    assert env.warn_if_oversubscribed(1, 2) is None
    msg = env.oversubscription(3)
    assert "3 CPU ranks x 1 thread(s) on 2 cores" in msg and "not real parallelism" in msg
    with pytest.warns(env.OversubscribedWarning, match="on 2 cores"):
        assert env.warn_if_oversubscribed(2, 2) is not None


def test_default_backend():
    assert env.default_backend("cpu") == "gloo"
    expected = "nccl" if torch.distributed.is_nccl_available() else "gloo"
    assert env.default_backend("cuda") == expected
