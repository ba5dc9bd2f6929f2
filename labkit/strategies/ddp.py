"""DistributedDataParallel: one process per rank, each on its own shard of every global batch.

DDP broadcasts rank 0's weights at construction, then during backward all-reduces gradients in
~25 MB buckets as soon as each bucket is ready, overlapping communication with the rest of
backward. Each rank's loss is a mean over its shard, and DDP averages gradients over ranks, so the
update equals single-device training on the whole global batch.
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..probes import grad_bytes
from .common import backward_time_without_comm, build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    ddp_model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    data, loader = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size,
                             batch_size=cfg.global_batch // ctx.world_size)

    def calibrate(loss_fn) -> float:       # a side batch: the training order stays untouched
        return backward_time_without_comm(ddp_model, loss_fn, next(iter(loader)), ctx.device)

    return train_loop(cfg, ctx, ddp_model, data, strategy="ddp", fns=fns, calibrate=calibrate,
                      comm_bytes=grad_bytes(model), unwrapped=model)
