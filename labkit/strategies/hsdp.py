"""HSDP (hybrid sharded data parallelism): FSDP2 inside groups of ranks, DDP across them.

``world_size = replicas x shard_size``. A 2-D ``DeviceMesh`` of shape (replicas, shard_size):
along "shard" a group of ranks holds one copy of the model between them, exactly as FSDP holds
it over all ranks (each parameter's dim 0 split, gathered block by block for forward and
backward, gradients reduce-scattered); along "replicate" the ranks holding the same shard in
each copy all-reduce their gradient shards, as DDP would. Every rank trains its own slice of
the global batch, so the update is the whole batch's, the same as single-device training.

Why: FSDP's all-gathers run on every step's critical path and grow with the group, so a real
cluster keeps them inside a node (fast links) and crosses nodes only with the gradient
all-reduce of one shard. Per step each rank sends 3(s-1)/s of the model's bytes in its group
and 2(r-1)/r of its 1/s shard across copies; it holds (params + grads + optimizer) / s.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import build_model, data_iter, train_loop


def shard(model, ctx: RankContext, shard_size: int):
    """``fully_shard`` each block, then the root, on a (replicate, shard) mesh: FSDP2 shards
    over the mesh's last dimension and replicates over the first."""
    replicas = ctx.world_size // shard_size
    mesh = init_device_mesh(
        ctx.device.type, (replicas, shard_size), mesh_dim_names=("replicate", "shard")
    )
    for block in model.children():
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = shard(build_model(cfg, ctx, fns), ctx, cfg.shard_group)
    data = data_iter(cfg, fns, rank=ctx.rank, world_size=ctx.world_size)
    out = train_loop(cfg, ctx, model, data, fns=fns)
    if out["params"] is not None:  # check mode: whole tensors, as single has them
        out["params"] = {
            name: t.full_tensor() if hasattr(t, "full_tensor") else t
            for name, t in out["params"].items()
        }
    return out
