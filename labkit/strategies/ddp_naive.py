"""Data parallelism by hand: what DDP does for you, minus buckets and overlap.

Start from identical weights (broadcast from rank 0), and after every backward all-reduce each
gradient on its own and divide by the world size. Correct, but every all-reduce waits for the
whole backward to finish and pays one latency per parameter tensor. Because the sync is one
explicit point after backward, this is also where the load-balancing lab (``labkit.rank.balancer``)
times each rank's wait for the slowest one and re-weights unequal shares of the batch; there
the gradients go as one flat message (``all_reduce_flat``, one DDP bucket's worth), so that
the lab's throughput measures the balance, not ten all-reduce latencies.
"""

from __future__ import annotations

import torch.distributed as dist

from ..config import RunConfig
from ..dist import RankContext, all_reduce_flat, broadcast_parameters
from ..factories import Factories
from ..rank.balancer import Balancer
from ..rank.join import JoinableSync
from ..rank.loop import build_model, data_iter, train_loop
from ..rank.probes import grad_bytes


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    broadcast_parameters(model)
    dataset = fns.dataset(cfg)
    data, _ = data_iter(
        cfg,
        fns,
        rank=ctx.rank,
        world_size=ctx.world_size,
        batch_size=cfg.batch_per_rank,
        dataset=dataset,
    )

    def per_tensor() -> None:  # one all-reduce per gradient, after backward
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= ctx.world_size

    def one_message() -> None:  # balancing: what is measured is the balance,
        grads = [p.grad for p in model.parameters() if p.grad is not None]  # not latency
        all_reduce_flat(grads)
        for g in grads:
            g /= ctx.world_size

    balancer, sync_grads = None, per_tensor
    if cfg.balancing:
        balancer = Balancer(cfg, ctx.rank, ctx.world_size, ctx.device, dataset)
        sync_grads = one_message
        if cfg.rebalance == "join":  # uneven inputs: the joinable twin of one_message
            balancer.joinable = JoinableSync(model, ctx.device)
            sync_grads = lambda: balancer.joinable.reduce(balancer.samples)  # noqa: E731
    return train_loop(
        cfg,
        ctx,
        model,
        data,
        strategy="ddp_naive",
        fns=fns,
        sync_grads=sync_grads,
        comm_bytes=grad_bytes(model),
        balancer=balancer,
    )
