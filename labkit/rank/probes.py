"""Per-step, per-rank timing and memory probes: one flat record per (rank, step).

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
collective is sleeping, not waiting for a CPU, so it does not count). Below ~0.8 something
else had the rank's core, and its timings are not comparable. Where schedstat is missing
(macOS), the thread's CPU time over the wall time of forward + backward stands in. On CPU each
boundary is a ``perf_counter`` read (~55 ns). On a GPU kernels run
asynchronously, so a CPU clock would time the launch, not the work: each boundary records a
CUDA event instead, and the step ends with one synchronisation that resolves them all.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch
from torch.autograd.profiler import record_function

PHASES = ("data", "forward", "backward", "wait", "comm", "sync_overhead", "optimizer", "other")
TIME_COLUMNS = tuple(f"{p}_s" for p in PHASES) + ("step_s",)


class StepProbe:
    """``start()``, then ``mark(phase)`` after each phase, then ``finish(...)`` -> a record."""

    def __init__(self, where: torch.device, **base):
        self.device = torch.device(where)
        self.cuda = self.device.type == "cuda"
        self.threads = torch.get_num_threads()
        # strategy, world_size, rank, ... copied into each record
        self.base = {**base, "threads": self.threads}
        self._marks: list[tuple[str, object]] = []
        self._cpu: dict[str, float] = {}
        self._t0 = 0.0
        self.sched = RunQueueClock(all_threads=self.threads > 1)
        self._sched0: tuple[float, float] | None = None  # at the start of a compute window
        self._ran = self._waited = 0.0
        self.ranges = False  # name each phase in torch.profiler's trace (labkit.rank.profiler)
        self._range = None

    def begin(self, phase: str) -> None:
        """Under torch.profiler (``ranges``), open ``phase``'s range; ``mark`` closes it."""
        if self.ranges:
            self._range = record_function(phase)
            self._range.__enter__()

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()  # the shared clock: one CLOCK_MONOTONIC per machine
        self._ran = self._waited = 0.0
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if phase in ("data", "backward"):  # forward + backward: the compute a rank owns
            if not self.sched.available:  # the fallback's clock (a syscall, ~30 us in a VM)
                self._cpu[phase] = cpu_seconds(self.threads)
            now = self.sched.read()
            if phase == "data":
                self._sched0 = now
            elif self._sched0 is not None and now is not None:  # close the compute window
                self._ran += now[0] - self._sched0[0]
                self._waited += now[1] - self._sched0[1]
                self._sched0 = None

    def finish(
        self,
        step: int,
        loss: float,
        samples: int,
        *,
        comm_baseline_s: float | None = None,
        traffic: dict | None = None,
        **extra,
    ) -> dict:
        """Close the step and return its record. ``loss`` is this rank's loss on its own samples
        (``shard_loss``); ``labkit.records.finalize`` combines ranks into the global-batch ``loss``.

        ``comm_baseline_s``: the backward time measured with communication off (DDP under
        ``no_sync()``); whatever backward takes beyond it is sync time. ``traffic``: what the
        step's process groups were handed (``labkit.wire.Traffic.take``). Exposed communication
        is sync time while a collective was in flight: where every collective was timed, what
        exceeds their time in flight is the sync machinery's own (``sync_overhead_s``: DDP's
        bucket copies and callbacks, a hand-written average's divisions), not communication.
        """
        traffic = traffic or {}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            elapsed = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731  ms -> s
        else:
            elapsed = lambda a, b: b - a  # noqa: E731
        times = dict.fromkeys(TIME_COLUMNS, 0.0)
        for (_, t0), (phase, t1) in zip(self._marks, self._marks[1:]):
            times[f"{phase}_s"] += elapsed(t0, t1)
        times["step_s"] = elapsed(self._marks[0][1], self._marks[-1][1])
        if comm_baseline_s is not None:
            exposed = max(0.0, times["backward_s"] - comm_baseline_s)
            times["comm_s"] += exposed
            times["backward_s"] -= exposed
        in_flight = traffic.get("comm_in_flight_s")
        if in_flight is not None and traffic["comm_calls"] and not traffic["comm_untimed"]:
            excess = max(0.0, times["comm_s"] - in_flight)
            times["comm_s"] -= excess
            times["sync_overhead_s"] += excess
        share = (
            (self._ran / (self._ran + self._waited) if self._ran + self._waited > 0 else 1.0)
            if self.sched.available
            else None
        )
        compute = times["forward_s"] + times["backward_s"]
        if (
            share is None
            and not self.cuda
            and compute > 0
            and {"data", "backward"} <= set(self._cpu)
        ):
            share = (self._cpu["backward"] - self._cpu["data"]) / compute
        share = float("nan") if share is None else share
        return record(
            self.base,
            step,
            loss,
            samples,
            times,
            start_s=self._t0,
            cpu_share=share,
            device=self.device,
            comm_bytes=traffic.get("comm_bytes", 0),
            comm_calls=traffic.get("comm_calls", 0),
            comm_payload_bytes=traffic.get("comm_payload_bytes", 0),
            comm_total_s=traffic.get("comm_in_flight_s", times["comm_s"]),
            **extra,
        )


def record(
    base: dict,
    step: int,
    shard_loss: float | None,
    samples: int,
    times: dict,
    *,
    start_s: float,
    cpu_share: float,
    device: torch.device,
    comm_bytes: int,
    comm_calls: int = 0,
    comm_payload_bytes: int = 0,
    **extra,
) -> dict:
    """The one place a record is made (``StepProbe.finish``, the pipeline loop, the parameter
    server): the run's identity (``base``: strategy, world_size, rank, ...), the step, this rank's
    loss on its own samples (None: it has none, e.g. a pipeline stage before the last), every
    phase of ``TIME_COLUMNS`` (0 for a phase this step did not have), the clock reading the
    step started at, the CPU share, the memory high-water mark and the bytes communicated; a
    strategy's own columns last."""
    return {
        **base,
        "step": step,
        "shard_loss": float("nan") if shard_loss is None else float(shard_loss),
        "samples": int(samples),
        **{c: float(times.get(c, 0.0)) for c in TIME_COLUMNS},
        "start_s": start_s,
        "compute_cpu_share": cpu_share,
        "peak_mem_bytes": peak_memory(device),
        "comm_bytes": _count(comm_bytes),
        "comm_calls": _count(comm_calls),
        "comm_payload_bytes": _count(comm_payload_bytes),
        # seconds any collective was in flight (hidden or exposed); where none is timed, the
        # communication phase itself
        "comm_total_s": float(extra.pop("comm_total_s", times.get("comm_s", 0.0))),
        **extra,
    }


def _count(n: float) -> int | float:
    """A whole count, or NaN where nothing could count it (``labkit.wire.COUNTING``)."""
    return int(n) if n == n else float("nan")


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
    """Seconds a StepProbe adds to one step (start, 5 marks, finish) with no work in between."""
    probe = StepProbe(torch.device(device), strategy="overhead")
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
    return probe.finish(0, 0.0, 0)


def grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradient each rank all-reduces per step (one copy of every trainable parameter)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
