"""StepProbe: phase times add up to the step, communication is split where it belongs, probing is
cheap. (Records built from them: tests/unit/test_watch.py.)

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_probes.py."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from labkit.rank.probes import (
    PHASES,
    StepProbe,
)
from tests.helpers.probes import timed_step


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _spinning_step() -> dict:
    probe = StepProbe("cpu")
    probe.start()
    for phase in PHASES:
        _spin(0.02)
        probe.mark(phase)
    return probe.finish()


@pytest.mark.skipif(
    not os.path.exists("/proc/thread-self/schedstat"),
    reason="run-queue times come from Linux schedstat",
)
def test_cpu_share_counts_waiting_for_a_core_not_waiting_for_peers():
    import subprocess
    import sys

    torch.set_num_threads(1)
    probe = StepProbe("cpu")
    timed_step(probe, {"forward": 0.03, "backward": 0.03})
    # 60 ms blocked (like a collective) is not contention: what the probe counts as waiting for
    # a core is the wake-ups' run-queue delay only (a few ms even on a loaded machine), not the
    # time blocked, which a clock of CPU time against wall time would count
    assert probe._waited < 0.03, (probe._ran, probe._waited)
    core = {min(os.sched_getaffinity(0))}
    mine = os.sched_getaffinity(0)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        os.sched_setaffinity(0, core)  # three spinning threads on one core
        for p in spinners:
            os.sched_setaffinity(p.pid, core)
        time.sleep(0.2)
        shared = _spinning_step()
    finally:
        os.sched_setaffinity(0, mine)
        for p in spinners:
            p.kill()
            p.wait()
    assert shared["compute_cpu_share"] < 0.7, shared["compute_cpu_share"]


def test_peak_memory_on_cpu_is_the_resident_high_water_mark():
    # in a fresh process (pytest's own high-water mark is far above any small block): touch a
    # block bigger than everything the process has held so far, and the peak must rise by it
    code = (
        "import torch\n"
        "from labkit.rank.probes import peak_memory\n"
        "before = peak_memory('cpu')\n"
        "block = torch.ones(before + 256 * 2**20, dtype=torch.uint8)\n"
        "print(before, peak_memory('cpu'), block.numel())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    before, after, size = (int(x) for x in out.stdout.split())
    assert after - before >= 0.9 * (size - before), (before, after, size)  # the block's new pages
    assert after >= size


@pytest.mark.cuda  # CUDA-event timing; the CPU path is tested above
def test_cuda_phase_times_add_up():
    probe = StepProbe(torch.device("cuda", 0))
    x = torch.randn(1024, 1024, device="cuda")
    probe.start()
    for phase in PHASES:
        x = x @ x / 1024
        probe.mark(phase)
    rec = probe.finish()
    total = sum(rec[f"{p}_s"] for p in PHASES)
    assert math.isclose(total, rec["step_s"], rel_tol=1e-3, abs_tol=1e-5)
