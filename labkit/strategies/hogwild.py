"""Hogwild: several processes update one shared-memory model, without locks.

Recht et al. 2011, "Hogwild!: A Lock-Free Approach to Parallelizing Stochastic Gradient
Descent" (arXiv:1106.5730). Every rank's parameters are views into one flat float32 buffer in a
file under /dev/shm (memory, not disk), mapped by every rank with ``torch.from_file(...,
shared=True)``: an optimizer step on any rank writes straight into the one model, and the others
read whatever is there at their next forward, half-written updates included. Nothing is sent,
so no bytes are communicated; the price is staleness: while a rank computed its gradient, the
others' updates landed. Each rank counts its own updates in a slot of the same buffer (only it
writes there), so a rank can read how many updates of the others landed between its previous
update and this one: the update's staleness.

The file is unlinked as soon as every rank has mapped it: the mapping lives on, and nothing is
left in /dev/shm even if a rank is killed.
"""

from __future__ import annotations

import os
import secrets

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.balancer import straggler
from ..rank.loop import build_model, data_iter, final_state, train_loop
from ..rank.watch import Watch

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def shared_buffer(path: str, numel: int) -> torch.Tensor:
    """A float32 tensor of ``numel`` elements backed by ``path``, shared with every process
    that maps the same file."""
    return torch.from_file(path, shared=True, size=numel, dtype=torch.float32)


def share_parameters(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Point every parameter of ``model`` at its slice of ``flat`` (copy nothing): torch's
    ``vector_to_parameters`` sets each ``param.data`` to a view of the vector."""
    torch.nn.utils.vector_to_parameters(flat, model.parameters())


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    if ctx.device.type != "cpu":
        raise ValueError(
            "hogwild shares one model in host memory between processes: run it on "
            "CPU (device='cpu')"
        )
    n = sum(p.numel() for p in model.parameters())
    # rank 0 names the file and fills it; the others map it after the broadcast
    token = torch.tensor([secrets.randbits(62) if ctx.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(token, src=0)
    path = os.path.join(SHM or "/tmp", f"labkit-hogwild-{int(token)}.bin")
    try:
        if ctx.rank == 0:
            with open(path, "wb") as f:
                f.truncate(4 * (n + ctx.world_size))
        dist.barrier()
        buf = shared_buffer(path, n + ctx.world_size)
        dist.barrier()  # every rank has it mapped: the name can go
    finally:  # whichever rank gets here (rank 0 may have died)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    flat, counts = buf[:n], buf[n:]
    if ctx.rank == 0:
        flat.copy_(parameters_to_vector(model.parameters()).detach())
        counts.zero_()
    dist.barrier()  # initial weights written before anyone trains
    share_parameters(model, flat)
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    seen = [0.0]  # updates of the others at this rank's last update

    def after_step(i: int) -> dict:
        counts[ctx.rank] += 1  # this rank's slot: no other rank writes it
        others = float(counts.sum()) - float(counts[ctx.rank])
        stale, seen[0] = others - seen[0], others
        return {"staleness": int(stale), "updates": int(float(counts.sum()))}

    # the run ends when the shared model has had world_size x steps updates (plus warm-up),
    # whoever made them: a fast rank makes more of them than a straggler
    budget = ctx.world_size * (cfg.warmup + cfg.steps)
    out = train_loop(
        cfg,
        ctx,
        model,
        data,
        fns=fns,
        after_step=after_step,
        until=lambda: float(counts.sum()) >= budget,
        steps=budget - cfg.warmup,
        watch=Watch(cfg, ctx, straggler(cfg, ctx)),  # the lab's straggler, if it has one
    )
    dist.barrier()  # every update has landed: all ranks read one model
    out["shared_updates"] = int(float(counts.sum()))
    out["params"] = final_state(cfg, model)
    return out
