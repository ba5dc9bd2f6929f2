"""Counts the checks the course did not make when its notebooks run under nbval (``make test-nb``).

A notebook cell whose check cannot be made honestly on this run (the machine was busy, no clean
step to compare) prints a line starting ``NOT CHECKED:`` instead of asserting. This plugin reads
every cell's output as nbval runs it and ends the session with the count and each line, beside
the notebook and cell that printed it, so a skipped check is counted, not only said.
"""

from __future__ import annotations

import pytest

PREFIX = "NOT CHECKED"
_not_checked: list[tuple[str, str]] = []


def not_checked_lines(outputs) -> list[str]:
    """The ``NOT CHECKED`` lines of a cell's outputs (nbformat output dicts)."""
    found = []
    for out in outputs or ():
        text = out.get("text", "")
        if out.get("output_type") != "stream" and "data" in out:
            text = out["data"].get("text/plain", "")
        text = "".join(text) if isinstance(text, list) else text
        found += [line.strip() for line in text.splitlines() if line.strip().startswith(PREFIX)]
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if call.when == "call":
        for line in not_checked_lines(getattr(item, "test_outputs", None)):
            _not_checked.append((item.nodeid, line))


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    if not (tr.config.getoption("nbval", False) or tr.config.getoption("nbval_lax", False)):
        return
    tr.section("checks not made")
    for nodeid, line in _not_checked:
        tr.write_line(f"{nodeid}: {line}")
    tr.write_line(f"{len(_not_checked)} check(s) not made (cells that printed {PREFIX})")
