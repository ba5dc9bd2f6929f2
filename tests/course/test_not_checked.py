"""The course counts the checks it did not make: ``notebooks/conftest.py`` reads every cell's
output under nbval and ends the session with each ``NOT CHECKED`` line and their number."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from notebooks.conftest import not_checked_lines  # the plugin under test


def test_lines_are_found_in_streams_and_results_only_at_line_starts():
    outputs = [
        {"output_type": "stream", "name": "stdout", "text": "ok\nNOT CHECKED: busy\n"},
        {"output_type": "execute_result", "data": {"text/plain": ["'NOT CHECKED: x'"]}},
        {"output_type": "stream", "name": "stdout", "text": "this was NOT CHECKED: mid-line"},
    ]
    assert not_checked_lines(outputs) == ["NOT CHECKED: busy"]
    assert not_checked_lines(None) == []


def _notebook(*sources: str) -> dict:
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": []}
    return {
        "cells": [{**cell, "id": f"c{i}", "source": s} for i, s in enumerate(sources)],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def test_nbval_session_ends_with_the_count(tmp_path, repo_root):
    shutil.copy(repo_root / "notebooks" / "conftest.py", tmp_path / "conftest.py")
    nb = _notebook("print('NOT CHECKED: the machine was busy')", "x = 1", "print('NOT CHECKED: b')")
    (tmp_path / "lesson.ipynb").write_text(json.dumps(nb))
    (tmp_path / "clean.ipynb").write_text(json.dumps(_notebook("assert 1 + 1 == 2")))
    cmd = [sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-p",
           "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120).stdout
    assert "4 passed" in out, out
    assert "lesson.ipynb::Cell 0: NOT CHECKED: the machine was busy" in out, out
    assert "lesson.ipynb::Cell 2: NOT CHECKED: b" in out, out
    assert "2 check(s) not made" in out, out
