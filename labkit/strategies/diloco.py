"""DiLoCo: an inner AdamW for H local steps, then one outer Nesterov step on the averaged delta.

Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv:2311.08455). Every rank keeps a copy of the global parameters θ. Each round it trains its
own copy for ``cfg.period`` steps with AdamW (``cfg.inner_lr``; the AdamW state stays local),
then the ranks all-reduce the *outer gradient* Δ = θ - mean_r θ_r (how far the average moved
away from θ) and an outer SGD with Nesterov momentum (``cfg.outer_lr`` 0.7, ``cfg.outer_momentum``
0.9, the paper's recipe) steps θ along it; every rank restarts from the new θ. With outer lr 1
and no momentum this is local SGD with AdamW inside; the outer momentum is what lets DiLoCo use
long rounds (the paper: H = 500) with one all-reduce each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from ..config import RunConfig
from ..dist import RankContext, broadcast_parameters
from ..factories import Factories
from ..rank.balancer import straggler
from ..rank.loop import build_model, data_iter, train_loop
from ..rank.watch import Watch


def outer_optimizer(global_params: list[torch.Tensor], lr: float, momentum: float):
    """The outer optimizer over the global copy θ: SGD with Nesterov momentum."""
    return torch.optim.SGD(global_params, lr=lr, momentum=momentum, nesterov=momentum > 0)


@torch.no_grad()
def outer_step(
    global_params: list[torch.Tensor],
    local_params: list[torch.Tensor],
    outer: torch.optim.Optimizer,
    average: Callable[[torch.Tensor], None] = lambda t: None,
) -> None:
    """One DiLoCo round's end: Δ = θ - mean_r θ_r (``average`` all-reduces a flat tensor to its
    mean over ranks in place; the identity on one rank), θ <- outer step on Δ, θ_r <- θ."""
    delta = parameters_to_vector(global_params) - parameters_to_vector(local_params)
    average(delta)  # one all-reduce per round, the size of the model
    for g, d in zip(global_params, delta.split([g.numel() for g in global_params])):
        g.grad = d.view_as(g)
    outer.step()
    outer.zero_grad(set_to_none=True)
    for g, p in zip(global_params, local_params):
        p.copy_(g)


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    broadcast_parameters(model)
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    global_params = [p.detach().clone() for p in params]
    outer = outer_optimizer(global_params, cfg.outer_lr, cfg.outer_momentum)
    inner = torch.optim.AdamW(params, lr=cfg.inner_lr)
    group = dist.new_group(list(range(ctx.world_size)))

    def average(flat: torch.Tensor) -> None:
        dist.all_reduce(flat, group=group)
        flat /= ctx.world_size

    state = {"rounds": 0}

    def after_step(i: int) -> dict:
        due = (i + 1) % cfg.period == 0
        if due:
            outer_step(global_params, params, outer, average)
        state["rounds"] += int(due)
        return {"averaged": int(due), "rounds": state["rounds"], "period": cfg.period}

    notes = (
        []
        if fns.optimizer_fn is None
        else [
            "diloco trains with its own inner AdamW (inner_lr) and outer Nesterov SGD (outer_lr, "
            "outer_momentum): your optimizer_fn was not used"
        ]
    )
    watch = Watch(cfg, ctx, straggler(cfg, ctx))  # the lab's straggler, if it has one
    out = train_loop(
        cfg, ctx, model, data, fns=fns, optimizer=inner, after_step=after_step, watch=watch
    )
    out["notes"] += notes
    return out
