"""Data x pipeline parallelism: ``dp`` copies of a ``stages``-deep pipeline, on a 2-D mesh.

``world_size = dp x stages``. A ``DeviceMesh`` of shape (dp, stages) names the two kinds of
groups: along "pp" the ranks of one pipeline (replica r holds ranks r x stages .. r x stages +
stages - 1, and its stages pass activations forward and gradients back, 1F1B), along "dp" the
ranks that hold the same stage in every replica. Each replica trains its slice of the global
batch (B / dp, in M micro-batches); after the schedule, each stage averages its gradients with
the same stage of the other replicas (one all-reduce over its "dp" group), so every replica
takes the update of the whole global batch: the same as single-device training.
"""

from __future__ import annotations

from torch.distributed.device_mesh import init_device_mesh

from ..config import RunConfig
from ..dist import RankContext, all_reduce_flat
from ..factories import Factories
from ..rank.stages import make_stage, stage_watch, train_stages
from .pipeline import scratch_schedule


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    dp = cfg.world_size // cfg.stages
    mesh = init_device_mesh(ctx.device.type, (dp, cfg.stages), mesh_dim_names=("dp", "pp"))
    replicas = mesh.get_group("dp")  # the ranks holding this rank's stage in every replica
    stage = make_stage(cfg, ctx, fns)
    optimizer = fns.optimizer(cfg, stage.module.parameters())
    replica = ctx.rank // cfg.stages
    watch = stage_watch(cfg, ctx, stage, "1f1b", "scratch", replica)
    step_fn = scratch_schedule(cfg, ctx, stage, watch, "1f1b", fns.loss(cfg))

    def average_over_replicas() -> None:  # one message: every gradient of this stage
        grads = [p.grad for p in stage.module.parameters() if p.grad is not None]
        all_reduce_flat(grads, group=replicas)
        for g in grads:
            g /= dp

    out = train_stages(
        cfg,
        ctx,
        stage,
        step_fn,
        optimizer=optimizer,
        watch=watch,
        replica=replica,
        replicas=dp,
        sync_grads=average_over_replicas if dp > 1 else None,
    )
    out["notes"].insert(0, f"replica {replica} of {dp}: stage {stage.index} of {cfg.stages}")
    return out
