"""FSDP x TP: tensor parallelism inside groups of ``tp`` ranks, FSDP2 across the groups, on a
2-D mesh (the layout torchtitan trains large models with).

``world_size = dp x tp``. A ``DeviceMesh`` of shape (dp, tp): along "tp" the ranks that split
every layer between them (``tp_dtensor``'s plan: Megatron's column- then row-parallel pairs,
placed by ``parallelize_module``), along "dp" the ranks that hold the same slice of every layer
in each group. ``fully_shard`` over the "dp" dimension then shards each slice once more, as FSDP
shards a whole model (ZeRO-3): a parameter becomes a DTensor on both dimensions, dim 0 split over
dp on top of its tensor-parallel placement. Before a block runs, its slices are all-gathered
over dp; after backward its gradients are reduce-scattered over dp, so each rank keeps
1 / (dp x tp) of the parameters, gradients and optimizer state (plus what the plan replicates:
LayerNorms, the embedding and the head are whole on every tp rank, sharded over dp). Each group
trains its own shard of the global batch, every rank of a group on the same samples, so the
update is the whole batch's, the same as single-device training.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import build_model, train_loop
from .tp_dtensor import full_state, parallelize


def shard(model, mesh):
    """``fully_shard`` each child block over the mesh's "dp" dimension, then the root."""
    for block in model.children():
        if any(p.requires_grad for p in block.parameters()):
            fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    tp = cfg.tensor_parallel
    dp = cfg.world_size // tp
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(build_model(cfg, ctx, fns), mesh["tp"], cfg.sequence_parallel)
    model = shard(model, mesh)
    group = ctx.rank // tp  # this rank's tensor-parallel group: its shard of every global batch
    data = batches(shard_loader(fns.dataset(cfg), cfg.batch_per_rank, group, dp, cfg.seed))
    out = train_loop(cfg, ctx, model, data, fns=fns)
    if out["params"] is not None:  # check mode: the dense model's state, every tensor whole
        out["params"] = full_state(model)
    return out
