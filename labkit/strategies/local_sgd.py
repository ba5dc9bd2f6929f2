"""Local SGD: every rank takes H optimizer steps on its own shard, then parameters are averaged.

Each rank trains alone between averaging rounds, so the ranks' models drift apart and are pulled
back together every ``cfg.period`` steps by one all-reduce of the parameters: about 1/H of DDP's
all-reduces (each the size of the model), and a straggler is waited for only once a round. With
H = 1 and plain or momentum SGD it is exactly DDP: averaging the parameters after a step equals
stepping with the averaged gradient, because the update is linear in the gradient.

The averaging is torch's own ``PeriodicModelAverager`` (``torch.distributed.algorithms.
model_averaging``, the post-local-SGD recipe of Lin et al. 2018, arXiv:1808.07217), given an
explicit process group: on gloo, the post-local-SGD hook's default subgroups assume one rank per
CUDA device, which a CPU run does not have.
"""

from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from ..config import RunConfig
from ..dist import RankContext, broadcast_parameters
from ..factories import Factories
from ..rank.balancer import straggler
from ..rank.loop import build_model, data_iter, train_loop
from ..rank.watch import Watch


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    broadcast_parameters(model)
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    group = dist.new_group(list(range(ctx.world_size)))
    with warnings.catch_warnings():  # H = 1 warns "use DDP": here it is the equivalence test
        warnings.simplefilter("ignore", UserWarning)
        # it averages on calls warmup_steps, warmup_steps + period, ...: with warmup_steps =
        # H - 1, after H, 2H, ... local steps
        averager = PeriodicModelAverager(
            period=cfg.period, warmup_steps=cfg.period - 1, process_group=group
        )
    state = {"rounds": 0}

    def after_step(i: int) -> dict:
        due = (
            averager.step - averager.warmup_steps
        ) % averager.period == 0 and averager.step >= averager.warmup_steps
        averager.average_parameters(model.parameters())
        state["rounds"] += int(due)
        return {"averaged": int(due), "rounds": state["rounds"], "period": cfg.period}

    watch = Watch(cfg, ctx, straggler(cfg, ctx))  # the lab's straggler, if it has one
    return train_loop(cfg, ctx, model, data, fns=fns, after_step=after_step, watch=watch)
