"""Shared fixtures: the repository root, a check that no rank process outlives a test, and the
one marker for tests that need GPUs (``@pytest.mark.cuda``, or ``cuda(gpus=2)``): where there
are fewer, the test is skipped with the reason, which ``-ra`` (pyproject's addopts) lists."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import assert_no_ranks

REPO = Path(__file__).resolve().parent.parent


def gpus_present() -> int:
    """GPUs this torch can use (0 on a CPU-only build or a machine without one). torch is
    imported here, where tests are collected: pytest-xdist's controller collects none, and
    importing torch there (4 s) would delay every worker's start."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_skip_reason(needed: int, present: int) -> str | None:
    """Why a test that needs ``needed`` GPUs cannot run with ``present``, or None if it can."""
    if present >= needed:
        return None
    if present == 0:
        return f"needs {needed} CUDA GPU(s); this machine has none (torch.cuda.is_available())"
    return f"needs {needed} GPUs, {present} present"


def pytest_collection_modifyitems(config, items):
    present = gpus_present()
    for item in items:
        marker = item.get_closest_marker("cuda")
        if marker is None:
            continue
        reason = cuda_skip_reason(int(marker.kwargs.get("gpus", 1)), present)
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"cuda: {reason}"))


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def no_leftover_ranks():
    """Fail the test if any rank process forked for it is still running when it ends."""
    yield
    assert_no_ranks()
