"""ZeRO stage 1: DDP for the gradients, the optimizer state partitioned across ranks.

``torch.distributed.optim.ZeroRedundancyOptimizer`` gives each rank the optimizer state of
about 1/N of the parameters (whole tensors, greedily balanced by size). Every rank still holds
all parameters and, after DDP's all-reduce, all gradients; each updates only its partition and
then broadcasts it, so every rank ends the step with the same full parameters. Memory per rank
(ZeRO paper, Rajbhandari et al. 2020): params + grads + optimizer/N instead of params + grads +
optimizer. Communication per step: DDP's all-reduce of the gradients, plus one broadcast of
every partition from the rank that owns it. (The paper's stage 1 reduce-scatters the gradients
and all-gathers the updated parameters instead: the same volume as DDP's all-reduce.)
"""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import build_model, data_iter, train_loop


def shard_optimizer(model, plain: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """``plain``'s class and settings, its state partitioned: this rank keeps the state of
    the parameters it owns, whole tensors balanced by size across the ranks."""
    return ZeroRedundancyOptimizer(
        model.parameters(), optimizer_class=type(plain), **plain.defaults
    )


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    ddp_model = DDP(model, device_ids=ctx.device_ids, bucket_cap_mb=cfg.bucket_cap_mb)
    plain = fns.optimizer(cfg, model.parameters())  # yours or labkit's: its class and settings
    optimizer = shard_optimizer(model, plain)
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    return train_loop(cfg, ctx, ddp_model, data, fns=fns, optimizer=optimizer)
