"""Data parallelism by hand: what DDP does for you, minus buckets and overlap.

Start from identical weights (broadcast from rank 0), and after every backward all-reduce each
gradient on its own and divide by the world size. Correct, but every all-reduce waits for the
whole backward to finish and pays one latency per parameter tensor.
"""
from __future__ import annotations

import torch.distributed as dist

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..probes import grad_bytes
from .common import build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    data, _ = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size,
                        batch_size=cfg.batch_per_rank)

    def sync_grads() -> None:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= ctx.world_size

    return train_loop(cfg, ctx, model, data, strategy="ddp_naive", fns=fns, sync_grads=sync_grads,
                      comm_bytes=grad_bytes(model))
