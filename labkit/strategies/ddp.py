"""DistributedDataParallel: one process per rank, each on its own shard of every global batch.

DDP broadcasts rank 0's weights at construction, then during backward all-reduces gradients in
buckets (25 MB by default, the first one 1 MiB; ``bucket_cap_mb``) as soon as each bucket is
ready, overlapping communication with the rest of backward. Each rank's loss is a mean over its
shard, and DDP averages gradients over ranks, so the update equals single-device training on the
whole global batch. A communication hook (``comm_hook``) changes what a bucket sends: fp16/bf16
cast it to 16 bits (half the bytes), PowerSGD sends two thin low-rank factors per matrix.
"""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.balancer import balanced
from ..rank.ddp_knobs import bucket_cap_mb, comm_hook
from ..rank.loop import build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    cap, notes = bucket_cap_mb(cfg, ctx, model)
    ddp_model = DDP(model, device_ids=ctx.device_ids, bucket_cap_mb=cap)
    if cfg.comm_hook != "none":
        state, hook, hook_notes = comm_hook(cfg)
        ddp_model.register_comm_hook(state, hook)
        notes += hook_notes
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    if cfg.balancing:  # a straggler, skewed data, shares that follow speed: rank/balancer.py
        out = balanced(cfg, ctx, ddp_model, data, fns=fns)
    else:
        out = train_loop(cfg, ctx, ddp_model, data, fns=fns)
    out["notes"] += notes
    return out
