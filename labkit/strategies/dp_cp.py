"""Data x context parallelism: ``dp`` replicas of a ``cp``-rank ring, on a 2-D mesh.

``world_size = dp x cp``. A ``DeviceMesh`` of shape (dp, cp) names the two kinds of groups:
along "cp" the ranks that split one sequence between them and pass keys and values round their
ring (``cp.py``; replica r holds ranks r x cp .. r x cp + cp - 1), along "dp" the ranks that
hold the same positions in each replica. Each replica trains its shard of the global batch,
every rank of it on the same samples; after backward a rank first sums its partial gradients
over its ring (each rank saw only its positions), then averages them with the other replicas
over its "dp" group: the update of the whole global batch, as on one device.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext, all_reduce_flat
from ..factories import Factories
from ..rank.loop import build_model, train_loop
from .cp import allreduce_partial_grads, parallelize, ring


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    cp = cfg.context_parallel
    dp = cfg.world_size // cp
    mesh = init_device_mesh(ctx.device.type, (dp, cp), mesh_dim_names=("dp", "cp"))
    ring_group, replicas = mesh.get_group("cp"), mesh.get_group("dp")
    model = build_model(cfg, ctx, fns)
    model = parallelize(model, ring_group, cfg.cp_layout, ring(ring_group, cfg.cp_layout))
    replica = ctx.rank // cp  # this rank's replica: its shard of every global batch
    data = batches(shard_loader(fns.dataset(cfg), cfg.batch_per_rank, replica, dp, cfg.seed))

    def sync_grads() -> None:
        allreduce_partial_grads(model, ring_group)  # each rank saw its positions: partial sums
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if dp > 1:
            all_reduce_flat(grads, group=replicas)  # then the mean over the replicas
            for g in grads:
                g /= dp

    return train_loop(cfg, ctx, model, data, fns=fns, sync_grads=sync_grads)
