"""Per-step, per-rank probes: each phase of a step on one clock, and the CPU the rank got.

Phases: data (wait for the batch and move it), forward, backward, wait (time blocked waiting for
the other ranks: at the load-balancing arrival point before the gradient sync,
``labkit.rank.balancer``, or a pipeline's barrier at the step's start), comm (communication that
is *exposed*, i.e. not hidden behind backward compute), sync_overhead (gradient-sync machinery
that ran with no peer to talk to: DDP's reducer or a one-rank all-reduce at world size 1; filled
in by ``labkit.records.finalize``), optimizer (step + zero_grad), other (what falls between the
timed phases: a pipeline schedule's bookkeeping). They add up to ``step_s``.

Each record also says how much CPU the rank got when it wanted one (``compute_cpu_share``): of
the time its threads were ready to run while computing (forward and backward, every micro-batch;
not the communication phase, where waking up after a peer's message shares the cores with gloo's
threads and would read as "busy" on an idle machine), the share they actually ran (Linux
schedstat: time on a CPU against time waiting in the run queue; waiting for a peer in a
collective is sleeping, not waiting for a CPU, so it does not count). Below 1 something
else had the rank's core part of the time; below ``labkit.records.BUSY_SHARE`` (0.6) the run is
flagged busy and its timings are not comparable. Where schedstat is missing
(macOS), the thread's CPU time over the wall time of forward + backward stands in. On CPU each
boundary is a ``perf_counter`` read. On a GPU kernels run
asynchronously, so a CPU clock would time the launch, not the work: each boundary records a
CUDA event instead, and the step ends with one synchronisation that resolves them all.

Forwards run for measurement only (DDP's backward timed without communication,
``backward_time_without_comm``) leave no trace on the model (``buffers_kept``).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from contextlib import contextmanager

import torch
from torch import nn

PHASES = ("data", "forward", "backward", "wait", "comm", "sync_overhead", "optimizer", "other")
TIME_COLUMNS = tuple(f"{p}_s" for p in PHASES) + ("step_s",)


class StepProbe:
    """``start()``, then ``mark(phase)`` after each phase, then ``finish(...)``: the step's
    timing columns (every phase of ``TIME_COLUMNS``, ``start_s``, ``compute_cpu_share``,
    ``comm_total_s``). Records are built from them by ``labkit.rank.recorder``. ``stop()`` keeps
    a step's raw readings for ``finish(step=...)`` later: the arithmetic need not run between
    two steps, where the interpreter runs cold and every operation costs several times more.

    The CPU share is read over the compute a rank owns: from the end of each ``data`` phase to
    the end of the next ``backward`` (every micro-batch's forward and backward), or over the
    whole step (``whole_step``: a pipeline stage, whose forwards and backwards interleave with
    its receives). A step that had neither (a parameter server's update) has none: NaN."""

    def __init__(self, where: torch.device, whole_step: bool = False):
        self.device = torch.device(where)
        self.cuda = self.device.type == "cuda"
        self.threads = torch.get_num_threads()
        self.whole_step = whole_step
        self._marks: list[tuple[str, object]] = []
        self._cpu: dict[str, float] = {}
        self.started = 0.0
        self.sched = RunQueueClock(all_threads=self.threads > 1)
        self._sched0: tuple[float, float] | None = None  # at the start of a compute window
        self._ran = self._waited = 0.0
        self._windows = 0

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self.started = time.perf_counter()  # the shared clock: one CLOCK_MONOTONIC per machine
        self._ran = self._waited = 0.0
        self._windows = 0
        self._marks = [("start", self._now())]
        if self.whole_step:
            self._open()

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))
        if not self.whole_step:
            if phase == "data":
                self._open()
            elif phase == "backward":
                self._close()

    def _open(self) -> None:
        if not self.sched.available:  # the fallback's clock: a syscall, read only without it
            self._cpu["data"] = cpu_seconds(self.threads)
        self._sched0 = self.sched.read()

    def _close(self) -> None:
        if not self.sched.available:
            self._cpu["backward"] = cpu_seconds(self.threads)
        now = self.sched.read()
        self._windows += 1
        if self._sched0 is not None and now is not None:  # close the compute window
            self._ran += now[0] - self._sched0[0]
            self._waited += now[1] - self._sched0[1]
            self._sched0 = None

    def stop(self) -> tuple:
        """Close the step's clock: its raw readings, for ``finish`` and ``segments``."""
        if self.whole_step:
            self._close()
        if self.cuda:  # the step's events resolve; the next step starts from an idle device
            torch.cuda.synchronize(self.device)
        return (self._marks, self.started, self._ran, self._waited, self._windows, dict(self._cpu))

    def finish(
        self,
        *,
        comm_baseline_s: float | None = None,
        traffic: dict | None = None,
        step: tuple | None = None,
    ) -> dict:
        """A step's timing columns: the one just marked, or a ``stop()``-ed ``step``.

        ``comm_baseline_s``: the backward time measured with communication off (DDP under
        ``no_sync()``); whatever backward takes beyond it is sync time. ``traffic``: what the
        step's process groups were handed, with each collective's time in flight
        (``labkit.wire.Traffic.take`` with ``timing`` on; None where collectives are not timed).
        Exposed communication is sync time while a collective was in flight: where every
        collective was timed, what exceeds their time in flight is the sync machinery's own
        (``sync_overhead_s``: DDP's bucket copies and callbacks, a hand-written average's
        divisions), not communication. ``comm_total_s``: seconds any collective was in flight
        (hidden or exposed); where none is timed, the communication phase itself.
        """
        marks, started, ran, waited, windows, cpu = step or self.stop()
        if self.cuda:
            elapsed = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731  ms -> s
        else:
            elapsed = lambda a, b: b - a  # noqa: E731
        times = dict.fromkeys(TIME_COLUMNS, 0.0)
        for (_, t0), (phase, t1) in zip(marks, marks[1:]):
            times[f"{phase}_s"] += elapsed(t0, t1)
        times["step_s"] = elapsed(marks[0][1], marks[-1][1])
        if comm_baseline_s is not None:
            exposed = max(0.0, times["backward_s"] - comm_baseline_s)
            times["comm_s"] += exposed
            times["backward_s"] -= exposed
        in_flight = None if traffic is None else traffic.get("comm_in_flight_s")
        if in_flight is not None and traffic["comm_calls"] and not traffic["comm_untimed"]:
            excess = max(0.0, times["comm_s"] - in_flight)
            times["comm_s"] -= excess
            times["sync_overhead_s"] += excess
        times["start_s"] = started
        compute = times["forward_s"] + times["backward_s"]
        times["compute_cpu_share"] = self._share(ran, waited, windows, cpu, compute)
        times["comm_total_s"] = times["comm_s"] if in_flight is None else in_flight
        return times

    def segments(self, step: tuple) -> list[tuple[str, float, float]]:
        """A ``stop()``-ed step's phases in the order they ran, each (phase, start, end) on the
        shared clock (on a GPU, each mark's time from the step's start)."""
        marks, started = step[0], step[1]
        if self.cuda:
            at = [started] + [started + marks[0][1].elapsed_time(t) / 1e3 for _, t in marks[1:]]
        else:
            at = [t for _, t in marks]
        return [(phase, a, b) for (phase, _), a, b in zip(marks[1:], at, at[1:])]

    def _share(self, ran, waited, windows, cpu, compute: float) -> float:
        if not windows:
            return float("nan")
        if self.sched.available:
            return ran / (ran + waited) if ran + waited > 0 else 1.0
        if not self.cuda and compute > 0 and {"data", "backward"} <= set(cpu):
            return (cpu["backward"] - cpu["data"]) / compute
        return float("nan")


class RunQueueClock:
    """Seconds this rank's threads ran on a CPU and waited for one (Linux schedstat), read
    through descriptors kept open (a few microseconds a read)."""

    def __init__(self, all_threads: bool = False):
        self.all_threads = all_threads
        self._fds: dict[str, int] = {}
        self.available = os.path.exists("/proc/thread-self/schedstat")

    def read(self) -> tuple[float, float] | None:
        if not self.available:
            return None
        names = (
            ["thread-self"]
            if not self.all_threads
            else [f"self/task/{t}" for t in os.listdir("/proc/self/task")]
        )
        ran = waited = 0
        for name in names:
            try:
                fd = self._fds.get(name)
                if fd is None:
                    fd = self._fds[name] = os.open(f"/proc/{name}/schedstat", os.O_RDONLY)
                on_cpu, run_delay, _ = os.pread(fd, 128, 0).split()
            except (OSError, ValueError):  # a thread that exited meanwhile
                self._fds.pop(name, None)
                continue
            ran, waited = ran + int(on_cpu), waited + int(run_delay)
        return ran / 1e9, waited / 1e9

    @staticmethod
    def share(
        before: tuple[float, float] | None, after: tuple[float, float] | None
    ) -> float | None:
        """Of the time spent ready to run between two reads, the share spent running."""
        if before is None or after is None:
            return None
        ran, waited = after[0] - before[0], after[1] - before[1]
        return ran / (ran + waited) if ran + waited > 0 else 1.0


def cpu_seconds(threads: int) -> float:
    """CPU seconds this rank's compute has had, per torch thread. One thread: the calling
    thread's own clock (gloo's communication threads excluded); several: the process's, shared
    out (OpenMP workers do the compute; gloo threads are idle outside communication)."""
    if threads <= 1:
        return time.thread_time()
    return time.process_time() / threads


def peak_memory(device: torch.device) -> int:
    """High-water mark: CUDA allocator on a GPU, the process's max resident set on CPU."""
    if torch.device(device).type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # RUSAGE_THREAD: the same process-wide peak (the kernel reads the mm's high-water mark),
    # without RUSAGE_SELF's walk over every thread's CPU time, which took ~0.2 ms per call in
    # a rank whose gloo threads were running on the other core
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    rss = resource.getrusage(who).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS bytes, Linux KiB


def sync(device: torch.device) -> None:
    """Wait for queued device work (a no-op on CPU): call before reading a clock."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def probe_overhead_s(device: torch.device | str = "cpu", steps: int = 2000) -> float:
    """Seconds a StepProbe adds to one step (start, a mark per phase, finish) with no work."""
    probe = StepProbe(torch.device(device))
    for _ in range(50):  # warm up
        _one_empty_step(probe)
    t0 = time.perf_counter()
    for _ in range(steps):
        _one_empty_step(probe)
    return (time.perf_counter() - t0) / steps


def _one_empty_step(probe: StepProbe) -> dict:
    probe.start()
    for phase in PHASES:
        probe.mark(phase)
    return probe.finish()


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradient each rank all-reduces per step (one copy of every trainable parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@contextmanager
def buffers_kept(model: nn.Module):
    """Run measurement-only forwards without a trace: BatchNorm's running statistics and
    counters are restored afterwards, so the trained model is what training alone made."""
    saved = {name: b.detach().clone() for name, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(saved[name])


def backward_time_without_comm(model, loss_fn, batch, device, repeats: int = 5) -> float:
    """Median backward time under DDP's ``no_sync()`` (no all-reduce); grads are cleared after
    and buffers restored."""
    x, y = (t.to(device) for t in batch)
    times = []
    with buffers_kept(model):
        for _ in range(repeats):
            with model.no_sync():
                loss = loss_fn(model(x), y)
                sync(device)
                t0 = time.perf_counter()
                loss.backward()
                sync(device)
                times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)
