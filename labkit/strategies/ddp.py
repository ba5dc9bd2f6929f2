"""DistributedDataParallel: one process per rank, each on its own shard of every global batch.

DDP broadcasts rank 0's weights at construction, then during backward all-reduces gradients in
buckets (25 MB by default, the first one 1 MiB; ``bucket_cap_mb``) as soon as each bucket is
ready, overlapping communication with the rest of backward. Each rank's loss is a mean over its
shard, and DDP averages gradients over ranks, so the update equals single-device training on the
whole global batch. A communication hook (``comm_hook``) changes what a bucket sends: fp16/bf16
cast it to 16 bits (half the bytes), PowerSGD sends two thin low-rank factors per matrix.
"""

from __future__ import annotations

import math

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    notes: list[str] = []
    ddp_model = DDP(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb(cfg, ctx, model, notes),
    )
    if cfg.comm_hook != "none":
        ddp_model.register_comm_hook(*comm_hook(cfg, notes))
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    out = train_loop(cfg, ctx, ddp_model, data, fns=fns)
    out["notes"] += notes
    return out


def comm_hook(cfg: RunConfig, notes: list[str]) -> tuple:
    """(state, hook) for ``cfg.comm_hook``: torch's own compression hooks."""
    if cfg.comm_hook == "fp16":
        return None, default_hooks.fp16_compress_hook
    if cfg.comm_hook == "bf16":
        return None, default_hooks.bf16_compress_hook
    # PowerSGD compresses from its third step on (torch needs two plain ones): warm-up hides them
    if cfg.warmup < 2:
        notes.append(
            f"PowerSGD compresses from the third step on: with warmup={cfg.warmup} the first "
            f"measured step(s) sent full gradients"
        )
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=2
    )
    return state, powersgd.powerSGD_hook


def bucket_cap_mb(cfg: RunConfig, ctx: RankContext, model, notes: list[str]) -> float | None:
    """``cfg.bucket_cap_mb``, except PowerSGD on gloo, which deadlocks with more than one bucket
    (torch 2.14.1: the first compressed step hangs until the timeout, checked here with 4 MB
    buckets on a 3x1024 MLP), so it gets one bucket, and a note saying so."""
    cap = cfg.bucket_cap_mb
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if cfg.comm_hook != "powersgd" or ctx.backend != "gloo" or (cap and cap * 2**20 >= nbytes):
        return cap
    one = math.ceil(nbytes / 2**20) + 1
    was = "the default 25 MB / 1 MiB first" if cap is None else f"{cap:g} MB"
    notes.append(
        f"PowerSGD on gloo hangs when DDP has more than one bucket (torch 2.14.1): labkit used "
        f"one bucket of {one} MB instead of {was}"
    )
    return float(one)
