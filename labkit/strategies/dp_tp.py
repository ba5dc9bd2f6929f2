"""Data x tensor parallelism: ``dp`` replicas of a ``tp``-rank tensor-parallel group, on a 2-D
mesh.

``world_size = dp x tp``. A ``DeviceMesh`` of shape (dp, tp) names the two kinds of groups:
along "tp" the ranks that split every layer between them (Megatron's pairs, ``tp.py``; replica r
holds ranks r x tp .. r x tp + tp - 1, which in a real cluster sit in one node, on its fastest
link), along "dp" the ranks that hold the same slice of every layer in each replica. Each
replica trains its shard of the global batch, every rank of a replica on the same samples;
after backward each rank averages its slice's gradients with the same slice in the other
replicas (one all-reduce over its "dp" group), so every replica takes the update of the whole
global batch: the same as single-device training.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext, all_reduce_flat
from ..factories import Factories
from ..rank.loop import build_model, train_loop
from .tp import allreduce_sequence_parallel_grads, full_state, parallelize


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    tp = cfg.tensor_parallel
    dp = cfg.world_size // tp
    mesh = init_device_mesh(ctx.device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    split_over, replicas = mesh.get_group("tp"), mesh.get_group("dp")
    model = parallelize(build_model(cfg, ctx, fns), split_over, cfg.sequence_parallel)
    replica = ctx.rank // tp  # this rank's replica: its shard of every global batch
    data = batches(shard_loader(fns.dataset(cfg), cfg.batch_per_rank, replica, dp, cfg.seed))

    def sync_grads() -> None:
        if cfg.sequence_parallel:  # LayerNorms saw a slice of the sequence: partial sums
            allreduce_sequence_parallel_grads(model, split_over)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        all_reduce_flat(grads, group=replicas)  # then the mean over the replicas
        for g in grads:
            g /= dp

    out = train_loop(cfg, ctx, model, data, fns=fns, sync_grads=sync_grads)
    if out["params"] is not None:  # check mode: the dense model's state, every tensor whole
        out["params"] = full_state(model, split_over)
    return out
