"""The training loop every strategy but the pipelines runs, and what it needs to start.

The loop is written once, and it does the measuring, so that a strategy's file holds only how it
prepares the model, the data and the gradient synchronisation: the algorithm. That difference is
the lesson: diff single.py and ddp.py.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from .. import registry
from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext
from ..factories import Factories
from ..models import checkpoint_blocks
from ..registry import DATA_PARALLEL
from ..wire import traffic, watch_all
from .balancer import Balancer, straggle
from .join import JoinableSync, join_context
from .memory_meter import MemoryMeter
from .precision import Amp
from .probes import StepProbe, cpu_seconds, sync
from .profiler import RankProfiler
from .resume import Resume


def set_check_mode(cfg: RunConfig) -> None:
    """Deterministic kernels and no TF32, so strategies can be compared to 1e-5 on GPUs too."""
    if not cfg.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS initialises
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False


def build_model(cfg: RunConfig, ctx: RankContext, fns: Factories) -> nn.Module:
    """The same initial weights on every rank and every strategy: seed, build, move."""
    set_check_mode(cfg)
    model = fns.model(cfg)
    if cfg.sync_batchnorm and cfg.strategy in DATA_PARALLEL and ctx.world_size > 1:
        from .syncbn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, ctx.device.type)
    if cfg.activation_checkpointing:  # activation checkpointing, per block
        model = checkpoint_blocks(model)
    return model.to(ctx.device)


def seed_rank_streams(cfg: RunConfig, ctx: RankContext) -> None:
    """After everything is built from the shared seed, give each rank its own random stream:
    dropout masks and augmentations must differ between ranks (identical masks would repeat one
    sample of noise on every rank instead of drawing world_size of them)."""
    torch.manual_seed(cfg.seed + ctx.rank)


def final_state(cfg: RunConfig, module: nn.Module) -> dict | None:
    """Parameters and buffers (running statistics too) to compare in check mode, else None."""
    if not cfg.deterministic:
        return None
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def data_iter(cfg: RunConfig, fns: Factories, rank: int, world_size: int) -> batches:
    """This rank's endless batches of ``cfg.batch_per_rank`` samples: shard ``rank`` of
    ``world_size`` (``.loader.dataset`` is the dataset, built once per run)."""
    loader = shard_loader(fns.dataset(cfg), cfg.batch_per_rank, rank, world_size, seed=cfg.seed)
    return batches(loader)


def train_loop(
    cfg: RunConfig,
    ctx: RankContext,
    model: nn.Module,
    data: batches,
    *,
    fns: Factories,
    sync_grads: Callable[[], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    after_step: Callable[[int], dict] | None = None,
    until: Callable[[], bool] | None = None,
    steps: int | None = None,
) -> dict:
    """Warm up, then train ``cfg.steps`` measured steps; return this rank's records.

    What a strategy hands over is its algorithm: the model (wrapped or not), this rank's data,
    and optionally ``sync_grads`` (called after each backward that ends a step: hand-written
    gradient averaging), an ``optimizer`` (ZeRO-1 and DiLoCo bring their own), ``after_step(i)``
    (after each optimizer step, before ``zero_grad``: local SGD's and DiLoCo's averaging rounds;
    it returns extra record columns), ``until()`` (checked before each measured step; True ends
    the run early: the asynchronous modes stop when the shared model has had its updates) and
    ``steps`` (this rank's most measured steps, if not ``cfg.steps``).

    The loop does the rest, the same for every strategy:

    * each optimizer step runs ``cfg.accumulate`` micro-batches, their losses scaled by 1/k, and
      gradients are synchronised after the last one only (DDP's ``no_sync()`` on the others) or
      after every one (``cfg.sync_every_microstep``); forward runs under ``cfg.precision``'s
      autocast (``labkit.rank.precision``);
    * load balancing (``cfg.balancing``, ``labkit.rank.balancer``): this rank's slice of every
      global batch and its loss weight, the injected slowdown, the timed arrival before the
      gradient sync (the ``wait`` phase) and the sync itself, one flat message (or Join's);
    * ``cfg.checkpoint_dir`` (``labkit.rank.resume``): continue from its checkpoint, write one
      every ``cfg.checkpoint_every`` steps;
    * measurement, attached from outside the strategy: a ``StepProbe`` times each phase;
      ``labkit.wire`` counts every byte the rank's process groups were handed and times each
      collective in flight; for a model with ``no_sync`` (DDP), backward is timed once without
      communication, and what a step's backward takes beyond it is exposed communication; the
      memory meter counts each category once.
    """
    loss_fn = fns.loss(cfg)  # a mean over the local batch; ranks then average grads
    optimizer = optimizer or fns.optimizer(cfg, model.parameters())
    plain = getattr(model, "module", model)  # inside DDP / DataParallel: single's names
    amp = Amp(cfg.precision, ctx.device)
    meter = MemoryMeter(model, optimizer, at_step=max(cfg.warmup - 1, 0))  # counts one step
    seed_rank_streams(cfg, ctx)
    probe = StepProbe(
        ctx.device,
        strategy=cfg.strategy,
        world_size=cfg.world_size,
        rank=ctx.rank,
        device=str(ctx.device),
        global_batch=cfg.global_batch,
        accumulate=cfg.accumulate,
        precision=cfg.precision,
        checkpoint=cfg.activation_checkpointing,
    )
    overlapped = hasattr(model, "no_sync")  # DDP: gradients leave during backward
    bal = None
    if cfg.balancing and "rebalance" in registry.get(cfg.strategy).knobs:  # ddp_naive, ddp
        bal = Balancer(
            cfg, ctx.rank, ctx.world_size, ctx.device, data.loader.dataset, model,
            overlapped=overlapped,
        )  # fmt: skip
        if cfg.rebalance == "join":
            bal.joinable = JoinableSync(model, ctx.device)
        if not overlapped:  # ddp_naive: at the arrival point, weighted by shares
            sync_grads = bal.sync
    k = cfg.accumulate
    total = cfg.warmup + (steps or cfg.steps)
    total = total if bal is None else bal.steps(total)
    backward_per_sample, records = None, []
    progress = Progress(ctx, total - cfg.warmup)  # measured steps only
    notes: list[str] = []
    resume = None
    if cfg.checkpoint_dir is not None:
        resume = Resume(cfg, ctx, plain, optimizer, data, notes)
    start = resume.start() if resume is not None else 0
    # a straggler without a balancer (the sync/async modes) is timed on CPU seconds
    cpu = (lambda: cpu_seconds(probe.threads)) if bal is None and cfg.slowdown else None
    wire = traffic()
    wire.timing = True  # every collective's interval in flight: hidden vs exposed comm
    prof = RankProfiler(cfg, ctx.rank, ctx.device, total - max(cfg.warmup, start))
    probe.ranges = prof.on
    watch_all()  # the groups the strategy made (DDP's, a mesh's, an averager's)
    with join_context(None if bal is None else bal.joinable):
        for i in range(start, total):
            if until is not None and i >= cfg.warmup and until():
                break
            # (balancing: before warm-up, whose last step sets the first shares)
            if i == (start if bal is not None else max(cfg.warmup, start)) and overlapped:
                side = next(iter(data.loader))  # DDP: backward alone, on a side batch (the
                with amp.autocast():  # training order untouched), per sample: shares vary
                    backward_per_sample = backward_time_without_comm(
                        model, loss_fn, side, ctx.device
                    ) / len(side[0])
            wire.take()  # what came before this step (warm-up, calibration) is not its own
            if i == max(cfg.warmup, start):
                prof.start()
            probe.start()
            meter.begin(i)
            extra, losses, samples = {}, [], 0
            if bal is not None:
                bal.begin()
                extra = {"slowdown": 1.0}
            for j in range(k):
                sync_now = j == k - 1 or cfg.sync_every_microstep
                probe.begin("data")
                x, y = bal.batch() if bal is not None and bal.slices else next(data)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
                probe.mark("data")
                t_compute = time.perf_counter()
                c_compute = cpu() if cpu is not None else 0.0
                no_sync = sync_now or not overlapped
                with nullcontext() if no_sync else model.no_sync():
                    probe.begin("forward")
                    with meter.forward(x, y), amp.autocast():
                        loss = loss_fn(model(x), y)
                    if bal is not None and overlapped:  # a slower device, before DDP's
                        backward = (backward_per_sample or 0.0) * len(x)  # buckets leave
                        extra["slowdown"] = bal.slow_down(i - cfg.warmup, t_compute, backward)
                    probe.mark("forward")
                    probe.begin("backward")
                    scaled = loss / k if k > 1 else loss
                    if bal is not None and bal.slices:  # weighted by this rank's share
                        scaled = scaled * bal.loss_scale
                    amp.backward(scaled)
                    if bal is not None and not overlapped:  # a slower device: sleep, leave
                        extra["slowdown"] = bal.slow_down(i - cfg.warmup, t_compute)  # the core
                    elif cpu is not None:  # CPU time: DDP's backward also waits in all-reduces
                        extra["slowdown"] = straggle(
                            cfg.slowdown, ctx.rank, i - cfg.warmup, c_compute, clock=cpu
                        )
                    probe.mark("backward")
                if bal is not None and sync_now and not overlapped:
                    probe.begin("wait")
                    bal.arrive(samples + len(x))
                    probe.mark("wait")
                probe.begin("comm")
                if sync_grads is not None and sync_now:
                    sync_grads()
                probe.mark("comm")
                losses.append((loss.detach(), len(x)))
                samples += len(x)
            meter.grads()
            probe.begin("optimizer")
            extra.update(amp.step(optimizer))
            if after_step is not None:  # before zero_grad: torch's averager skips grad-less
                probe.mark("optimizer")  # parameters
                probe.begin("comm")
                extra.update(after_step(i))
                probe.mark("comm")
                probe.begin("optimizer")
            optimizer.zero_grad(set_to_none=True)
            probe.mark("optimizer")
            meter.step()  # counted outside the timed phases
            sent = wire.take()
            # Python floats, not stack/sum/div on tensors: three ops less between steps
            shard_loss = sum(v.item() * n for v, n in losses) / samples
            if bal is not None:
                extra["share"] = samples / cfg.global_batch
            rec = probe.finish(
                i - cfg.warmup,
                shard_loss,
                samples,
                comm_baseline_s=None
                if backward_per_sample is None
                else backward_per_sample * samples,
                traffic=sent,
                **extra,
            )
            rec.update(meter.columns())
            rec["comm_spans"] = [list(span) for span in sent["spans"]]  # for traces
            if bal is not None:
                if overlapped:
                    bal.record(rec["forward_s"] + rec["backward_s"], samples)
                bal.end_step(i - cfg.warmup)
            if cfg.pace_s:  # a slower model's pace, outside the measured step
                time.sleep(max(0.0, cfg.pace_s - (time.perf_counter() - rec["start_s"])))
            if resume is not None:
                rec["attempt"] = resume.attempt
                t_save = time.perf_counter()
                resume.after_step(i + 1, total, rec["shard_loss"], samples, rec["step_s"])
                every = cfg.checkpoint_every
                if (every and (i + 1) % every == 0) or i + 1 == total:  # a checkpoint was due
                    rec["checkpoint_start_s"] = t_save
                    rec["checkpoint_s"] = time.perf_counter() - t_save
            if i >= cfg.warmup:
                records.append(rec)
                progress(i + 1 - cfg.warmup, rec["shard_loss"], samples)
                prof.step()
    prof.stop()
    wire.timing = False
    return {"records": records, "notes": notes, "params": final_state(cfg, plain)}


class Progress:
    """``ctx.report(...)`` about 10 times a second and on the last step.

    Each message wakes the caller's process, which on a small machine shares a core with a
    rank (measured: up to 1.5 ms a message), so a training loop must not report every step.
    A message carries this rank's (step, shard loss, samples) for every step since the last
    one, so the caller can combine ranks into the global-batch loss of any step
    (``labkit.records.LiveLoss``) without a collective in the training loop.
    """

    def __init__(self, ctx: RankContext, total: int, every_s: float = 0.1):
        self.ctx, self.total, self.every_s, self.last = ctx, total, every_s, 0.0
        self.pending: list[tuple[int, float, int]] = []

    def __call__(self, step: int, shard_loss: float | None, samples: int = 0) -> None:
        loss = float("nan") if shard_loss is None else float(shard_loss)
        self.pending.append((step, loss, samples))
        if time.perf_counter() - self.last > self.every_s or step == self.total:
            self.ctx.report(
                step=step, total=self.total, loss=loss, samples=samples, losses=self.pending
            )
            self.pending = []
            self.last = time.perf_counter()


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
