"""Data parallelism by hand: what DDP does for you, minus buckets and overlap.

Start from identical weights (broadcast from rank 0), and after every backward average each
gradient over the ranks: one all-reduce per parameter tensor, summing, then divide by the world
size. Correct, but every all-reduce waits for the whole backward to finish and pays one latency
per tensor. Because the sync is one explicit point after backward, this is also where the
load-balancing lab times each rank's wait for the slowest one (``cfg.slowdown``, ``skew``,
``rebalance``): there the balancer (``labkit.rank.balancer``) weights each rank's loss by its
share of the batch and averages the gradients itself, in one message.
"""

from __future__ import annotations

import torch.distributed as dist

from ..config import RunConfig
from ..dist import RankContext, broadcast_parameters
from ..factories import Factories
from ..rank.balancer import balanced
from ..rank.loop import build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    broadcast_parameters(model)  # every rank starts from rank 0's weights
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)

    def average_gradients() -> None:  # after backward: the mean gradient over ranks
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= ctx.world_size

    if cfg.balancing:  # a straggler, skewed data, shares that follow speed: rank/balancer.py
        return balanced(cfg, ctx, model, data, fns=fns)
    return train_loop(cfg, ctx, model, data, fns=fns, sync_grads=average_gradients)
