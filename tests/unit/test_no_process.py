"""The folder's promise holds: a test in tests/unit that starts a process fails (conftest)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from labkit import RunConfig, experiment


def test_a_subprocess_is_refused():
    with pytest.raises(AssertionError, match="started a subprocess: move it to tests/ranks"):
        subprocess.run([sys.executable, "-c", "pass"], check=False)


def test_ranks_are_refused():
    with pytest.raises(AssertionError, match="move it to tests/ranks"):
        experiment.run(RunConfig(strategy="ddp", world_size=2, steps=1, warmup=0))
