"""tests/unit starts no process: no rank, no subprocess, no fork, so the whole folder runs in
seconds after every edit (``make test-unit``). A test here that tries fails, saying what it
started; it belongs in tests/ranks. Nothing here depends on another test or on time, so the
folder runs on every core (pytest-xdist's ``-n auto``: the Makefile's targets)."""

from __future__ import annotations

import importlib
import multiprocessing.process
import multiprocessing.util
import os
import subprocess

import pytest

# only in a worker: xdist's controller runs no test and does not import torch (4 s before any
# worker starts)
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    # one worker per core: a torch thread each, or each worker's second thread waits on
    # another worker's core
    torch.set_num_threads(1)


def _refuse(what: str):
    def start(*args, **kwargs):
        raise AssertionError(f"a test in tests/unit started {what}: move it to tests/ranks")

    return start


@pytest.fixture(autouse=True)
def no_process(monkeypatch):
    """Every way a test could start a process, refused for the length of the test."""
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("a subprocess"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("a process"))
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", _refuse("a forkserver"))
    monkeypatch.setattr(os, "fork", _refuse("a fork"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("a process (posix_spawn)"))
    launch = importlib.import_module("labkit.launch")  # the module (labkit.launch: the function)
    monkeypatch.setattr(launch, "launch", _refuse("ranks (labkit.launch)"))
