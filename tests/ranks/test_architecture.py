"""The package's shape: imports flow one way, the CLI is generated from RunConfig, and one
registry names every strategy. (The layers themselves are import-linter's contract in
pyproject.toml, run by ``make lint``.)

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_architecture.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from labkit.config import RunConfig


def test_the_help_says_each_fields_default_and_help_text():
    out = subprocess.run(
        [sys.executable, "-m", "labkit", "compare", "--help"], capture_output=True, text=True
    ).stdout
    for f in dataclasses.fields(RunConfig):
        first_word = f.metadata["help"].split()[0]
        assert first_word in out, f.name
    assert "--balance-stages" in out and "--rebalance" in out  # two knobs, two names
