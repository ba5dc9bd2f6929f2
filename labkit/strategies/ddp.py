"""DistributedDataParallel: one process per rank, each on its own shard of every global batch.

DDP broadcasts rank 0's weights at construction, then during backward all-reduces gradients in
buckets (25 MB by default, the first one 1 MiB; ``bucket_cap_mb``) as soon as each bucket is
ready, overlapping communication with the rest of backward. Each rank's loss is a mean over its
shard, and DDP averages gradients over ranks, so the update equals single-device training on the
whole global batch. A communication hook (``comm_hook``) changes what a bucket sends: fp16/bf16
halve the bytes, PowerSGD sends two thin low-rank factors per matrix instead of the matrix.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import backward_time_without_comm, build_model, data_iter, train_loop
from ..rank.probes import grad_bytes

MIB = 2**20


def run(
    cfg: RunConfig,
    ctx: RankContext,
    fns: Factories,
    *,
    strategy: str = "ddp",
    make_optimizer: Callable | None = None,
) -> dict:
    """``make_optimizer``: ZeRO-1 (``zero1.py``) is this strategy with a partitioned optimizer,
    which also broadcasts every parameter after its step."""
    model = build_model(cfg, ctx, fns)
    notes: list[str] = []
    nbytes = grad_bytes(model)
    cap = powersgd_bucket_cap(cfg, ctx.backend, nbytes, notes)
    ddp_model = DDP(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        **({} if cap is None else {"bucket_cap_mb": cap}),
    )
    comm_bytes, comm_total = register_hook(ddp_model, cfg, nbytes, notes)
    if make_optimizer is not None:  # + one broadcast of every parameter per step
        syncs, reduce_bytes = (cfg.accumulate if cfg.sync_every_microstep else 1), comm_bytes
        comm_bytes = lambda: syncs * reduce_bytes + nbytes  # noqa: E731
    data, loader = data_iter(
        cfg, fns, rank=ctx.rank, world_size=ctx.world_size, batch_size=cfg.batch_per_rank
    )

    def calibrate(loss_fn) -> float:  # a side batch: the training order stays untouched
        return backward_time_without_comm(ddp_model, loss_fn, next(iter(loader)), ctx.device)

    return train_loop(
        cfg,
        ctx,
        ddp_model,
        data,
        strategy=strategy,
        fns=fns,
        calibrate=calibrate,
        comm_bytes=comm_bytes,
        comm_total=comm_total,
        unwrapped=model,
        notes=notes,
        make_optimizer=make_optimizer,
    )


def powersgd_bucket_cap(
    cfg: RunConfig, backend: str | None, nbytes: int, notes: list[str]
) -> float | None:
    """The bucket cap to build DDP with: ``cfg.bucket_cap_mb``, except PowerSGD on gloo, which
    deadlocks with more than one bucket (torch 2.14.1: the first compressed step hangs until the
    timeout, checked here with 4 MB buckets on a 3x1024 MLP), so it gets one bucket."""
    cap = cfg.bucket_cap_mb
    if cfg.comm_hook != "powersgd" or backend != "gloo":
        return cap
    if cap is not None and cap * MIB >= nbytes:
        return cap
    one = math.ceil(nbytes / MIB) + 1
    notes.append(
        f"PowerSGD on gloo hangs when DDP has more than one bucket (torch 2.14.1): "
        f"labkit used one bucket of {one} MB instead of "
        f"{'the default 25 MB / 1 MiB first' if cap is None else f'{cap:g} MB'}"
    )
    return float(one)


def register_hook(ddp_model: DDP, cfg: RunConfig, nbytes: int, notes: list[str]):
    """Install ``cfg.comm_hook`` (DDP's own all-reduce for "none"), timed: every bucket's
    all-reduce records when it was launched and when its result was ready.

    Returns (bytes, comm_total): the payload bytes of one synchronisation (or, for PowerSGD, a
    function giving the bytes of the step just taken, from the hook's own counts), and a
    function giving the seconds during which any all-reduce was in flight since its last call
    (hidden + exposed communication)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    sent: int | Callable[[], int] = nbytes
    state, hook = None, default_hooks.allreduce_hook
    if cfg.comm_hook in ("fp16", "bf16"):
        hook = (
            default_hooks.fp16_compress_hook
            if cfg.comm_hook == "fp16"
            else default_hooks.bf16_compress_hook
        )
        sent = nbytes // 2  # float32 gradients sent as 16-bit, cast back after
    elif cfg.comm_hook == "powersgd":
        state, hook, sent = _powersgd(ddp_model, cfg, nbytes, notes)
    spans: list[tuple[float, float]] = []

    def timed(st, bucket):
        t0 = time.perf_counter()

        def done(fut):
            spans.append((t0, time.perf_counter()))
            return fut.value()

        return hook(st, bucket).then(done)

    group, mean = ddp_model.process_group, dist.AllreduceOptions()
    mean.reduceOp = dist.ReduceOp.AVG

    def timed_allreduce(st, bucket):
        # DDP's own all-reduce with one Python callback, not allreduce_hook's plus ours: on gloo
        # each callback runs on gloo's thread and has to take the GIL from backward. The mean is
        # the collective's own (ReduceOp.AVG, which gloo has in the pinned torch), not a div_
        # over the bucket first: without a hook DDP divides while copying gradients into the
        # bucket, a hook gets them undivided, and dividing here was one more pass over every
        # gradient than DDP's built-in path makes (110 us of a 13 ms step at width 512). And the
        # process group's own call, as DDP's C++ path makes it: ``dist.all_reduce``'s Python
        # layer (group lookup, checks, logging wrappers) added 35 us a call here
        t0 = time.perf_counter()

        def done(fut):
            spans.append((t0, time.perf_counter()))
            return fut.value()[0]

        return group.allreduce([bucket.buffer()], mean).get_future().then(done)

    ddp_model.register_comm_hook(
        state, timed_allreduce if hook is default_hooks.allreduce_hook else timed
    )

    def comm_total() -> float:
        busy, end = 0.0, float("-inf")
        for a, b in sorted(spans):  # the union of in-flight intervals
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        spans.clear()
        return busy

    return sent, comm_total


def _powersgd(ddp_model: DDP, cfg: RunConfig, nbytes: int, notes: list[str]):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    # compression starts at the third step (torch needs two plain ones); warm-up hides them
    state = psgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=2
    )
    if cfg.warmup < 2:
        notes.append(
            f"PowerSGD compresses from the third step on: with warmup={cfg.warmup} the "
            f"first measured step(s) sent full gradients"
        )
    elem = nbytes / max(1, sum(p.numel() for p in ddp_model.parameters() if p.requires_grad))
    syncs = cfg.accumulate if cfg.sync_every_microstep else 1
    seen = [0]

    def step_bytes() -> int:
        after = state.total_numel_after_compression  # elements sent, counted by the hook
        if after == seen[0]:  # not compressing yet: plain all-reduce
            return nbytes * syncs
        sent, seen[0] = (after - seen[0]) * elem, after
        return int(sent)

    return state, psgd.powerSGD_hook, step_bytes
