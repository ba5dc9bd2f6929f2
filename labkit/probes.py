"""Per-step, per-rank timing and memory probes: one flat record per (rank, step).

Phases: data (wait for the batch and move it), forward, backward, comm (communication that
is *exposed*, i.e. not hidden behind backward compute), optimizer (step + zero_grad). They add
up to ``step_s``. On CPU each boundary is a ``perf_counter`` read (~55 ns). On a GPU kernels run
asynchronously, so a CPU clock would time the launch, not the work: each boundary records a
CUDA event instead, and the step ends with one synchronisation that resolves them all.
"""
from __future__ import annotations

import resource
import sys
import time

import torch

PHASES = ("data", "forward", "backward", "comm", "optimizer")
TIME_COLUMNS = tuple(f"{p}_s" for p in PHASES) + ("step_s",)


class StepProbe:
    """``start()``, then ``mark(phase)`` after each phase, then ``finish(...)`` -> a record."""

    def __init__(self, where: torch.device, **base):
        self.device = torch.device(where)
        self.cuda = self.device.type == "cuda"
        self.base = base                  # strategy, world_size, rank, ... copied into each record
        self._marks: list[tuple[str, object]] = []

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))

    def finish(self, step: int, loss: float, samples: int, *, comm_baseline_s: float | None = None,
               comm_bytes: int = 0, **extra) -> dict:
        """Close the step and return its record.

        ``comm_baseline_s``: the backward time measured with communication off (DDP under
        ``no_sync()``); whatever backward takes beyond it is exposed communication.
        """
        if self.cuda:
            torch.cuda.synchronize(self.device)
            elapsed = lambda a, b: a.elapsed_time(b) / 1e3       # noqa: E731  ms -> s
        else:
            elapsed = lambda a, b: b - a                          # noqa: E731
        times = dict.fromkeys(TIME_COLUMNS, 0.0)
        for (_, t0), (phase, t1) in zip(self._marks, self._marks[1:]):
            times[f"{phase}_s"] += elapsed(t0, t1)
        times["step_s"] = elapsed(self._marks[0][1], self._marks[-1][1])
        if comm_baseline_s is not None:
            exposed = max(0.0, times["backward_s"] - comm_baseline_s)
            times["comm_s"] += exposed
            times["backward_s"] -= exposed
        return {**self.base, "step": step, "loss": float(loss), "samples": samples, **times,
                "peak_mem_bytes": peak_memory(self.device), "comm_bytes": int(comm_bytes), **extra}


def peak_memory(device: torch.device) -> int:
    """High-water mark: CUDA allocator on a GPU, the process's max resident set on CPU."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)   # macOS bytes, Linux KiB


def sync(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU): call before reading a clock."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def probe_overhead_s(device: torch.device | str = "cpu", steps: int = 2000) -> float:
    """Seconds a StepProbe adds to one step (start, 5 marks, finish) with no work in between."""
    probe = StepProbe(torch.device(device), strategy="overhead")
    for _ in range(50):                    # warm up
        _one_empty_step(probe)
    t0 = time.perf_counter()
    for _ in range(steps):
        _one_empty_step(probe)
    return (time.perf_counter() - t0) / steps


def _one_empty_step(probe: StepProbe) -> dict:
    probe.start()
    for phase in PHASES:
        probe.mark(phase)
    return probe.finish(0, 0.0, 0)


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradient each rank all-reduces per step (one copy of every trainable parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
