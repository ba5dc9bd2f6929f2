"""DDP's knobs, as ``labkit.strategies.ddp`` applies them: which communication hook a bucket goes
through, and the bucket size (with the one case where labkit must override it)."""

from __future__ import annotations

import math

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from ..config import RunConfig
from ..dist import RankContext


def comm_hook(cfg: RunConfig) -> tuple[object, object, list[str]]:
    """(state, hook, notes) for ``cfg.comm_hook``: torch's own compression hooks."""
    if cfg.comm_hook == "fp16":
        return None, default_hooks.fp16_compress_hook, []
    if cfg.comm_hook == "bf16":
        return None, default_hooks.bf16_compress_hook, []
    # PowerSGD compresses from its third step on (torch needs two plain ones): warm-up hides them
    notes = []
    if cfg.warmup < 2:
        notes.append(
            f"PowerSGD compresses from the third step on: with warmup={cfg.warmup} the first "
            f"measured step(s) sent full gradients"
        )
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=cfg.powersgd_rank, start_powerSGD_iter=2
    )
    return state, powersgd.powerSGD_hook, notes


def bucket_cap_mb(cfg: RunConfig, ctx: RankContext, model) -> tuple[float | None, list[str]]:
    """``cfg.bucket_cap_mb`` and the notes about it: PowerSGD on gloo deadlocks with more than
    one bucket (the first compressed step hangs until the timeout; benchmarks/README.md, "Behind
    the code"), so it gets one bucket, and a note saying so."""
    cap = cfg.bucket_cap_mb
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    if cfg.comm_hook != "powersgd" or ctx.backend != "gloo" or (cap and cap * 2**20 >= nbytes):
        return cap, []
    one = math.ceil(nbytes / 2**20) + 1
    instead = "the default 25 MB / 1 MiB first" if cap is None else f"{cap:g} MB"
    note = (
        f"PowerSGD on gloo hangs when DDP has more than one bucket: labkit used one bucket of "
        f"{one} MB instead of {instead}"
    )
    return float(one), [note]
