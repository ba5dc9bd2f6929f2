"""Expert parallelism: every mixture-of-experts block's E experts spread over the N ranks, E/N
each, and every token sent to its expert's rank and back by all-to-all.

GShard (Lepikhin et al. 2020, arXiv:2006.16668) and Switch (Fedus et al. 2021,
arXiv:2101.03961) train this way: each rank holds its shard of the global batch and a replica
of everything but the experts (data parallelism), and rank q holds experts q E/N .. (q+1) E/N - 1.
In each MoE block (``labkit.moe.MoE``), every rank:

1. routes its own tokens: its tokens are its groups, so the capacity is decided here, and a
   dropped token is never sent;
2. permutes the kept assignments by destination (sorted by expert: one rank's experts are
   contiguous, so this sorts them by owner too);
3. exchanges counts: one all-to-all of E numbers, the rows it will send to each expert, so
   every rank learns how many rows will arrive, from whom, for which of its experts;
4. sends the rows: an all-to-all with those split sizes;
5. runs its experts on what arrived;
6. sends the outputs back: the same all-to-all, split sizes reversed;
7. un-permutes them, weights each by its gate and adds them up (``MoE.forward``).

Backward, the gradients retrace 6 and 4 (an all-to-all's gradient is the all-to-all back).
Then the gradients: every replicated parameter's is averaged over the ranks (one all-reduce);
an expert's arrived from every rank's tokens and stays with its owner. Each rank's loss is a
mean over its B/N samples, single's over all B, so the owner divides by N: no message.

With ``cfg.ep`` = d_e < N, each group of d_e ranks shares out the experts and the N / d_e groups
are copies of one another (a 2-D mesh, dp x ep: GShard's and DeepSpeed-MoE's expert-data
parallelism): the all-to-alls stay inside a group, and an expert's gradient is summed over the
ranks that hold it (one all-reduce over "dp") before the division by N.

Each all-to-all sends the rows actually routed (variable split sizes, no padding to capacity):
``labkit.wire`` counts the rows a rank hands in, and a rank keeps the share routed to its own
experts. ``dist.all_to_all_single`` with split sizes runs on gloo (torch 2.14).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ..config import RunConfig
from ..dist import RankContext, all_reduce_flat
from ..factories import Factories
from ..moe import MoE, moe_layers, run_experts
from ..rank.loop import build_model, data_iter, train_loop


class AllToAll(torch.autograd.Function):
    """Rows to ranks: the first ``send[i]`` rows still unsent go to rank i, ``recv[i]`` arrive
    from rank i, in rank order; backward, the gradients go back the way they came."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class ExpertParallel:
    """A MoE block's ``exchange`` over ``group``: the rows for each expert (sorted by expert,
    ``counts`` per expert) to the expert's owner, through its experts, and back."""

    def __init__(self, experts: int, group):
        self.group, self.n = group, group.size()
        self.per_rank = experts // self.n

    def __call__(self, mine: nn.ModuleDict, rows: torch.Tensor, counts: torch.Tensor):
        n, per = self.n, self.per_rank
        arriving = torch.empty_like(counts)  # 3. counts first: rows per expert, to its owner
        dist.all_to_all_single(arriving, counts, group=self.group)
        arriving = arriving.view(n, per)  # [i, l]: rows from rank i for my expert l
        send, recv = counts.view(n, per).sum(1).tolist(), arriving.sum(1).tolist()
        received = AllToAll.apply(rows, send, recv, self.group)  # 4. the rows
        expert = torch.arange(per, device=rows.device).repeat(n)  # 5. my experts, on them
        by_expert = torch.argsort(expert.repeat_interleave(arriving.flatten()), stable=True)
        out = run_experts(mine, received[by_expert], arriving.sum(0))
        out = out[torch.argsort(by_expert)]  # back in the order they arrived
        return AllToAll.apply(out, recv, send, self.group)  # 6. and back


def owned(rank: int, world_size: int, experts: int) -> range:
    """The experts rank ``rank`` holds: a contiguous E/N of them."""
    per = experts // world_size
    return range(rank * per, (rank + 1) * per)


def spread_experts(moe: MoE, group) -> None:
    """Keep only this rank's experts in ``moe`` (their names unchanged) and send its tokens
    to the others of ``group`` by all-to-all."""
    n, rank, experts = group.size(), group.rank(), moe.spec.experts
    if experts % n:
        raise ValueError(
            f"expert parallelism puts E/N experts on each rank: {experts} experts do not "
            f"split over {n} ranks, use a multiple of {n} experts"
        )
    for e in set(range(experts)) - set(owned(rank, n, experts)):
        del moe.experts[str(e)]
    moe.exchange = ExpertParallel(experts, group)


def expert_groups(cfg: RunConfig, ctx: RankContext):
    """The group that shares out the experts (every rank, or ``cfg.ep`` of them), and the
    group of ranks holding the same experts (None when every rank shares them out)."""
    degree = cfg.ep or ctx.world_size
    if degree == ctx.world_size:
        return dist.group.WORLD, None
    shape = (ctx.world_size // degree, degree)
    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=("dp", "ep"))
    return mesh.get_group("ep"), mesh.get_group("dp")


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)  # every rank builds every expert from the same seed,
    spread_over, copies = expert_groups(cfg, ctx)  # then keeps its own
    for moe in moe_layers(model):
        spread_experts(moe, spread_over)
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    expert = {id(p) for moe in moe_layers(model) for p in moe.experts.parameters()}
    params = list(model.parameters())

    def sync_grads() -> None:
        replicated = [p.grad for p in params if id(p) not in expert and p.grad is not None]
        all_reduce_flat(replicated)  # summed over the ranks, as DDP's
        if copies is not None:  # the experts' copies: each saw its own group's tokens
            all_reduce_flat([p.grad for p in params if id(p) in expert], group=copies)
        for p in params:  # / N: the replicated ones' sums, and the experts' (every rank's
            if p.grad is not None:  # tokens summed in by the all-to-all), become means over B
                p.grad /= ctx.world_size

    out = train_loop(cfg, ctx, model, data, fns=fns, sync_grads=sync_grads)
    if not expert:
        out["notes"].append(
            "ep: the model has no mixture-of-experts block (labkit.moe.MoE), so nothing was "
            "spread: this ran as data parallelism (set model='transformer' and experts)"
        )
    return out
