"""Shared fixtures: the repository root, and a check that no rank process outlives a test."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.procs import assert_no_ranks

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def no_leftover_ranks():
    """Fail the test if any rank process forked for it is still running when it ends."""
    yield
    assert_no_ranks()
