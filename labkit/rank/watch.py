"""What watches a rank's training, attached from outside the loop through one small interface.

A loop says what it is doing and nothing more::

    for i in watch.steps(total):
        with watch.phase("data"): ...
        with watch.phase("forward", x, y): ...     # the batch: data, not activations
        with watch.phase("backward"): ...
        with watch.phase("comm"): ...
        with watch.phase("optimizer"): ...
        watch.step_end(losses, **columns)
    return watch.result(params)

Everything that watches attaches here, composed per run, in the manner of torchtitan's
``MetricsProcessor``: the step probe (every phase on one clock, ``labkit.rank.probes``), the
byte counter (``labkit.wire``: what each process group was handed, each collective's time in
flight), DDP's calibration (backward timed without communication on a side batch: what a
step's backward takes beyond it is exposed communication), the memory meter (one rule for
every loop, ``labkit.rank.memory_meter``), torch's profiler, progress messages, the record
builder (``labkit.rank.recorder``, the only one), checkpoints (``labkit.rank.resume``) and
pacing. The shared loop (``labkit.rank.loop``), the pipeline loop (``labkit.rank.stages``) and
the parameter server (``labkit.strategies.async_ps``) all use it.

A strategy may add participants of its own, which see the same points: a straggler or load
balancing (``labkit.rank.balancer``), a pipeline schedule's event log (``labkit.rank.stages``).
Each may define any of ``attach(watch)``, ``step_start(i)``, ``enter(phase)``, ``exit(phase)``
(inside the phase, before its time is read) and ``step_end(i, record)`` (adding columns).

Phases nest: a phase opened inside another (the balancer's wait inside the gradient sync, a
pipeline's forward inside its schedule) ends the outer one's time so far, and the outer one
goes on when it closes, so a step's phases still add up to its ``step_s``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch.distributed as dist

from ..config import RunConfig
from ..dist import RankContext
from ..wire import traffic, watch_all
from .memory_meter import MemoryMeter
from .probes import StepProbe, backward_time_without_comm, peak_memory
from .recorder import Recorder
from .resume import Resume
from .router_load import RouterLoad
from .torch_profiler import RankProfiler


class Phase:
    """One phase of a step, as a context manager: ``name`` (a ``labkit.rank.probes.PHASES``
    entry), the data it works on (``batch``), the micro-batch it belongs to and a ``label``
    for its trace event (a pipeline's gradient sync)."""

    __slots__ = ("watch", "name", "batch", "microbatch", "label")

    def __init__(self, watch: Watch, name: str, batch: tuple, microbatch, label):
        self.watch, self.name, self.batch = watch, name, batch
        self.microbatch, self.label = microbatch, label

    def __enter__(self) -> Phase:
        w = self.watch
        if w._open:  # the phase this one interrupts: its time so far
            w.probe.mark(w._open[-1])
        w._open.append(self.name)
        for hook in w._on_enter:
            hook(self)
        return self

    def __exit__(self, *exc) -> bool:
        w = self.watch
        for hook in w._on_exit:
            hook(self)
        w.probe.mark(self.name)
        w._open.pop()
        return False


class Watch:
    """One rank's watchers, composed from the run's config, and the participants a strategy
    adds (``participants``). ``spans``: time each collective in flight (the shared loop);
    ``whole_step``: read the CPU share over the whole step (a pipeline stage); ``warmup``:
    steps before the measured ones, if not ``cfg.warmup``; ``loss_as`` and ``identity``: see
    ``labkit.rank.recorder.Recorder``."""

    def __init__(
        self,
        cfg: RunConfig,
        ctx: RankContext,
        *participants,
        spans: bool = True,
        whole_step: bool = False,
        warmup: int | None = None,
        loss_as: str = "shard_loss",
        **identity,
    ):
        self.cfg, self.ctx = cfg, ctx
        self.warmup = cfg.warmup if warmup is None else warmup
        self.parts = [p for p in participants if p is not None]
        self.spans = spans
        self.probe = StepProbe(ctx.device, whole_step=whole_step)
        self.recorder = Recorder(cfg, ctx, loss_as=loss_as, **identity)
        self.wire = traffic()
        self.device = ctx.device
        self.notes: list[str] = []
        self.meter: MemoryMeter | None = None
        self.calibration: Calibration | None = None
        self.resume: Resume | None = None
        self.every_step = False
        self.i = self.start = self.total = 0
        self.loss: float | None = None  # the step's shard loss, for participants' step_end
        self.stopped: tuple = ()  # the probe's readings of that step (``StepProbe.stop``)
        self._kept: list[tuple] = []  # measured steps whose records the run's end assembles
        self._open: list[str] = []  # the phases open now, innermost last
        self._on_start: list = []
        self._on_enter: list = []
        self._on_exit: list = []
        self._on_end: list = []

    # ---- what a loop calls -------------------------------------------------------------------

    def attach(
        self, model, optimizer, data=None, loss_fn=None, amp=None, every_step: bool = False
    ) -> Watch:
        """What the loop trains: the model (as the strategy wrapped it), its optimizer, its data
        stream, loss and precision. The memory meter counts one step (``every_step``: follows
        the micro-batches held at every step too); DDP's calibration needs the data's loader;
        ``cfg.checkpoint_dir`` continues from a checkpoint and writes them."""
        plain = getattr(model, "module", model)  # inside DDP / DataParallel: single's names
        self.meter = MemoryMeter(plain, optimizer, max(self.warmup - 1, 0), every_step)
        self.every_step = every_step
        load = RouterLoad.of(plain)  # a mixture of experts: its router's load, every step
        if load is not None:
            self.parts.append(load)
        if hasattr(model, "no_sync") and hasattr(data, "loader"):  # DDP: buckets in backward
            self.calibration = Calibration(model, loss_fn, amp, data.loader, self.ctx.device)
        if self.cfg.checkpoint_dir is not None:
            self.resume = Resume(self.cfg, self.ctx, plain, optimizer, data, self.notes)
        return self

    def steps(self, total: int) -> Iterator[int]:
        """Step indices from where the run starts (a checkpoint's, else 0) to ``total`` (warm-up
        included); each step's watching begins before it is handed out."""
        self.begin(total)
        for i in range(self.start, total):
            self.step_start(i)
            yield i

    def phase(self, name: str, *batch, microbatch=None, label: str | None = None) -> Phase:
        return Phase(self, name, batch, microbatch, label)

    def step_end(self, losses, **columns) -> None:
        """The step is over: ``losses``, each micro-batch's (mean loss, samples), the loss None
        where this rank has none; ``columns``: the step's own record columns.

        What was measured is kept as it was read (the probe's marks, the bytes, the memory
        high-water mark); the record is assembled from it now where a participant reads it at
        the step's end (a balancer, checkpoints, a pipeline's events), else when the run ends:
        between two steps the interpreter runs cold, and every operation there costs several
        times what it costs anywhere else."""
        i, measured = self.i, self.i >= self.warmup
        if self.meter is not None:
            self.meter.step()  # counted outside the timed phases
        step = (i, losses, self.probe.stop(), self.wire.take(), peak_memory(self.device), columns)
        if self._on_end:
            self._assemble(step)
        elif measured:
            self._kept.append(step)
        if measured:
            self.progress(i + 1 - self.warmup, losses)
            self.profiler.step()

    def result(self, params: dict | None) -> dict:
        """This rank's result: its records, the run's notes, and ``params`` (check mode)."""
        self.profiler.stop()
        self.wire.timing = False
        for step in self._kept:
            self._assemble(step)
        self._kept = []
        return {"records": self.recorder.records, "notes": self.notes, "params": params}

    def _assemble(self, step: tuple) -> None:
        """One step's record, from what was measured at its end (the only place a record is
        made on the rank side: ``labkit.rank.recorder``)."""
        i, losses, stopped, sent, peak, columns = step
        self.stopped = stopped
        self.loss, samples = mean_loss(losses)
        baseline = None if self.calibration is None else self.calibration.baseline(samples)
        timing = self.probe.finish(
            comm_baseline_s=baseline, traffic=sent if self.spans else None, step=stopped
        )
        build = self.recorder.build
        rec = build(i - self.warmup, self.loss, samples, timing, sent, peak, **columns)
        if self.meter is not None:  # counted at one step: the same columns on every record
            rec.update(self.meter.columns())
            if self.every_step:
                rec.update(self.meter.peaks())
        rec["comm_spans"] = [list(span) for span in sent["spans"]]  # for traces
        for hook in self._on_end:
            hook(i, rec)
        if i >= self.warmup:
            self.recorder.records.append(rec)

    def backward_estimate(self, samples: int) -> float:
        """Seconds a backward of ``samples`` takes without communication (DDP's calibration;
        0 before it ran)."""
        per = None if self.calibration is None else self.calibration.per_sample
        return 0.0 if per is None else per * samples

    # ---- how it is put together ---------------------------------------------------------------

    def begin(self, total: int) -> None:
        """Before the first step: continue from a checkpoint, count bytes on every process group
        the strategy made, and wire every watcher's hooks."""
        self.total = total
        for p in self.parts:
            if hasattr(p, "attach"):
                p.attach(self)
        self.start = self.resume.start() if self.resume is not None else 0
        first = max(self.warmup, self.start)
        if self.calibration is not None:  # early when a participant slows DDP down by it
            early = any(getattr(p, "calibrate_early", False) for p in self.parts)
            self.calibration.at = self.start if early else first
        self.progress = Progress(self.ctx, total - self.warmup)  # measured steps only
        self.profiler = RankProfiler(self.cfg, self.ctx.rank, self.ctx.device, total - first)
        self.wire.timing = self.spans  # every collective's interval in flight: hidden vs exposed
        watch_all()  # the groups the strategy made (DDP's, a mesh's, an averager's)
        pace = Pace(self) if self.cfg.pace_s else None
        resume = None if self.resume is None else ResumeHooks(self)
        profiler = self.profiler if self.profiler.on else None
        self._hooks = {}  # the phases' hooks with the memory meter (a step it counts) and without
        for meter in (None, None if self.meter is None else MeterHooks(self.meter)):
            parts = [profiler, meter, *self.parts]  # opened in this order, closed in reverse
            self._hooks[meter is not None] = (
                [p.enter for p in parts if hasattr(p, "enter")],
                [p.exit for p in reversed(parts) if hasattr(p, "exit")],
            )
        self._on_enter, self._on_exit = self._hooks[False]
        self._on_start = [p.step_start for p in self.parts if hasattr(p, "step_start")]
        self._on_end = [p.step_end for p in (*self.parts, pace, resume) if hasattr(p, "step_end")]

    def step_start(self, i: int) -> None:
        """Before step ``i``'s first phase (what a loop that does not iterate ``steps`` calls)."""
        self.i = i
        calibrated = self.calibration is not None and self.calibration.step_start(i)
        if i == self.start or calibrated or self._on_end:  # what came before this step (the
            self.wire.take()  # strategy's set-up, a calibration, a participant's) is not its own
        if i == max(self.warmup, self.start):
            self.profiler.start()
        if self.meter is not None:
            self.meter.begin(i)
            self._on_enter, self._on_exit = self._hooks[self.meter.watching]
        self.probe.start()
        for hook in self._on_start:
            hook(i)


class MeterHooks:
    """The memory meter at the loop's phases: a forward's saved tensors, held until its
    backward; the gradients before the optimizer step."""

    def __init__(self, meter: MemoryMeter):
        self.meter, self._forward = meter, None

    def enter(self, phase: Phase) -> None:
        if phase.name == "forward":
            self._forward = self.meter.forward(*phase.batch, key=phase.microbatch)
            self._forward.__enter__()
        elif phase.name == "optimizer":
            self.meter.grads()

    def exit(self, phase: Phase) -> None:
        if phase.name == "forward" and self._forward is not None:
            self._forward.__exit__(None, None, None)
            self._forward = None
        elif phase.name == "backward":
            self.meter.backward_done(phase.microbatch)


class Calibration:
    """DDP overlaps its all-reduce with backward, so a step's backward time holds both: once,
    backward is timed under ``no_sync()`` (no communication) on a side batch from the loader
    (the training order untouched), per sample (a rank's share of the batch may change), and
    what a step's backward takes beyond it is exposed communication. At step ``at``: the first
    measured one, or the first of all when a straggler's sleep needs it from the start. The
    ranks then meet at a barrier, so the step's first all-reduce holds no wait for a peer that
    finished calibrating later (its exposed communication would read the wait)."""

    def __init__(self, model, loss_fn, amp, loader, device):
        self.model, self.loss_fn, self.amp, self.loader, self.device = (
            model,
            loss_fn,
            amp,
            loader,
            device,
        )
        self.at, self.per_sample = 0, None

    def step_start(self, i: int) -> bool:
        """At step ``at``: calibrate (True), else nothing (False)."""
        if i != self.at:
            return False
        side = next(iter(self.loader))
        with self.amp.autocast():
            seconds = backward_time_without_comm(self.model, self.loss_fn, side, self.device)
        self.per_sample = seconds / len(side[0])
        group = getattr(self.model, "process_group", None)
        if group is not None and dist.is_initialized():  # each rank calibrated alone and they
            dist.barrier(group=group)  # finished apart: the step's all-reduce must not wait
        return True

    def baseline(self, samples: int) -> float | None:
        return None if self.per_sample is None else self.per_sample * samples


class Pace:
    """``cfg.pace_s``: each step lasts at least that long (a slower model's pace, for demos),
    the rest slept outside the measured step."""

    def __init__(self, watch: Watch):
        self.watch = watch

    def step_end(self, i: int, rec: dict) -> None:
        w = self.watch
        time.sleep(max(0.0, w.cfg.pace_s - (time.perf_counter() - w.probe.started)))


class ResumeHooks:
    """``cfg.checkpoint_dir`` (``labkit.rank.resume``): each step appended to the timeline, a
    checkpoint every ``cfg.checkpoint_every`` steps and after the last; its record says which
    attempt trained it and, where one was written, when and for how long."""

    def __init__(self, watch: Watch):
        self.watch = watch

    def step_end(self, i: int, rec: dict) -> None:
        w, resume = self.watch, self.watch.resume
        rec["attempt"] = resume.attempt
        t_save = time.perf_counter()
        resume.after_step(i + 1, w.total, w.loss, rec["samples"], rec["step_s"])
        every = w.cfg.checkpoint_every
        if (every and (i + 1) % every == 0) or i + 1 == w.total:  # a checkpoint was due
            rec["checkpoint_start_s"] = t_save
            rec["checkpoint_s"] = time.perf_counter() - t_save


def mean_loss(losses) -> tuple[float | None, int]:
    """A step's (mean loss over this rank's samples, samples) from each micro-batch's (mean
    loss, samples): Python floats, not ops on tensors; None where this rank has no loss."""
    samples = sum(n for _, n in losses)
    if not samples or any(v is None for v, _ in losses):
        return None, samples
    return sum(float(v) * n for v, n in losses) / samples, samples


class Progress:
    """``ctx.report(...)`` about 10 times a second and on the last step.

    Each message wakes the caller's process, which on a small machine shares a core with a
    rank, so a training loop must not report every step. A message carries this rank's (step,
    shard loss, samples) for every step since the last one (samples 0 where it has no loss),
    so the caller can combine ranks into the global-batch loss of any step
    (``labkit.records.LiveLoss``) without a collective in the training loop.
    """

    def __init__(self, ctx: RankContext, total: int, every_s: float = 0.1):
        self.ctx, self.total, self.every_s, self.last = ctx, total, every_s, 0.0
        self.pending: list[tuple[int, object]] = []

    def __call__(self, step: int, losses) -> None:
        """Step ``step`` ended with ``losses`` (``mean_loss``'s argument)."""
        self.pending.append((step, losses))
        if time.perf_counter() - self.last > self.every_s or step == self.total:
            sent = []
            for at, each in self.pending:
                loss, samples = mean_loss(each)
                if loss is None:  # a pipeline stage before the last: no loss, no samples
                    loss, samples = float("nan"), 0
                sent.append((at, loss, samples))
            self.ctx.report(
                step=step, total=self.total, loss=sent[-1][1], samples=sent[-1][2], losses=sent
            )
            self.pending = []
            self.last = time.perf_counter()
