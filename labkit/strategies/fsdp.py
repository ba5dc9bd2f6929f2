"""FSDP2 (``fully_shard``), ZeRO stage 3: parameters, gradients and optimizer state sharded.

Each block of the model and then the whole model is wrapped with ``fully_shard`` over a 1-D
device mesh of all ranks (CPU ranks: gloo). Every parameter becomes a DTensor holding this
rank's rows (dim 0 split into N pieces, padded to equal size). Before a block's forward its
parameters are all-gathered, used, and freed again after it (``reshard_after_forward``);
backward gathers them once more, and the gradients are reduce-scattered, so each rank keeps
only its shard of them, and its optimizer updates only its shard. Memory per rank (ZeRO paper):
(params + grads + optimizer) / N, plus one or two blocks' gathered parameters at a time.
Communication per micro-batch: two all-gathers of the parameters and one reduce-scatter of the
gradients: each rank sends 3(N-1)/N of the model's bytes, 1.5x DDP's all-reduce (2(N-1)/N).
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import build_model, data_iter, train_loop


def shard(model, ctx: RankContext):
    """``fully_shard`` each child block (so one block is gathered at a time), then the root."""
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for block in model.children():
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = shard(build_model(cfg, ctx, fns), ctx)
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    out = train_loop(cfg, ctx, model, data, fns=fns)
    if out["params"] is not None:  # check mode: whole tensors, as single has them
        out["params"] = {
            name: t.full_tensor() if hasattr(t, "full_tensor") else t
            for name, t in out["params"].items()
        }
    return out
