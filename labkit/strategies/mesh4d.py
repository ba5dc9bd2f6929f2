"""Four dimensions at once: data x pipeline x context x tensor parallelism on one device mesh.

``world_size = pp x dp x cp x tp``. One ``DeviceMesh`` of that shape names four kinds of groups,
and each rank belongs to one group of each kind:

* "tp": the ranks that split every layer of one stage between them (Megatron's pairs,
  ``tp.py``): four all-reduces of the activations per layer and micro-batch, the most traffic,
  so the innermost dimension (neighbouring ranks: in a cluster, one node's fastest links);
* "cp": the ranks that split one sequence between them and pass keys and values round a ring
  (``cp.py``): one ring per layer and micro-batch;
* "dp": the ranks that hold the same slice of the same stage in each data-parallel replica:
  one all-reduce of the gradients per step;
* "pp": the ranks that hold the stages of one pipeline, in order: an activation forward and a
  gradient back per micro-batch and stage boundary, point to point; the outermost dimension,
  where the slowest links can carry it. Megatron-LM orders its groups the same way
  (tp-cp-dp-pp, innermost first; Narayanan et al. 2021, arXiv:2104.04473, section 3), as does
  torchtitan's mesh ("pp", "dp", "cp", "tp"; Liang et al. 2024, arXiv:2410.06511).

A step, as this module runs it: every rank builds the whole model from the seed and keeps its
stage (``make_stage``, its "pp" coordinate); splits that stage's layers over its "tp" group
(``tp.parallelize``) and then its sequence over its "cp" group (``cp``'s pieces: the embedding
on this rank's positions, attention as a ring, the head fed the last position from its owner);
takes its data-parallel replica's slice of the global batch (its "dp" coordinate); runs 1F1B
with the stage ranks that share its (dp, cp, tp) coordinates (``pipeline.scratch_schedule`` on
its "pp" group: dp x cp x tp pipelines, each carrying one slice of the sequence and of the
heads); then sums the partial gradients over "cp" (each rank saw its positions) and averages
over "dp". Nothing here averages over "tp" or "pp": each rank's slice of each parameter is its
own. The result is single-device training on the global batch, which ``check`` compares.

A fifth dimension where the blocks are a mixture of experts (``experts``, ``labkit.moe``):
expert parallelism. As in Megatron-LM, the expert-parallel groups are carved out of the
data-parallel ones: "dp" splits into ("edp", "ep") (a second mesh of shape pp x dp/ep x ep x cp
x tp over the same ranks), the ``ep`` ranks of an "ep" group share out every block's experts
and send each kept token to its expert's owner and back by all-to-all (``ep.spread_experts``),
and the dp / ep "edp" groups hold copies of the same experts. Gradients: the dense parameters'
averaged over all of "dp", an expert's (every "ep" rank's tokens already summed into it by the
all-to-all) summed over its "edp" copies, then divided by dp as well. Tensor parallelism of the
experts is not done here (``tp=1`` with experts). Each forward adds the auxiliary loss's gradient
(``labkit.moe.AddAuxLoss``), and a step runs M of them on each of the cp ranks, whose gradients
are summed: the coefficient is divided by M x cp, as Megatron-LM scales it by 1/M, so it weighs
what ``aux_loss`` says over the step. Equal to single where the token groups are: a group's
capacity and its auxiliary loss are counted over its tokens, and a pipeline's micro-batch (a
contiguous slice of the replica's samples) holds other samples than single's groups (sample j
in group j mod G), and a cp rank only its positions, so ``check`` matches single with nothing
dropped (``capacity_factor >= experts / top_k``) and ``aux_loss=0``.

Each dimension's groups are distinct process groups, tagged with the dimension's name
(``labkit.wire.tag``), so a record says the bytes each dimension carried: ``comm_bytes_tp``,
``comm_bytes_cp``, ``comm_bytes_pp``, ``comm_bytes_dp`` (and ``comm_bytes_ep``,
``comm_bytes_edp``; ``comm_tagged``: by operation).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .. import wire
from ..config import RunConfig
from ..dist import RankContext, all_reduce_flat
from ..factories import Factories
from ..models import Block, Embed, Head
from ..moe import moe_layers
from ..rank.stages import Stage, make_stage, stage_watch, train_stages
from .cp import (
    FromLastPosition,
    SliceEmbed,
    SplitAttention,
    allreduce_partial_grads,
    last_position_owner,
    positions,
    ring,
)
from .ep import spread_experts
from .pipeline import scratch_schedule
from .tp import full_state, parallelize

DIMS = ("pp", "dp", "cp", "tp")  # the mesh's dimensions, outermost first (registry's ``mesh``)
EXPERT_DIMS = ("pp", "edp", "ep", "cp", "tp")  # the same ranks, dp split in two for the experts
SEQ = 1  # activations are (batch, sequence, hidden)


# ---- the layout: which ranks form each group ----------------------------------------------------


def degrees(cfg: RunConfig) -> dict[str, int]:
    """Each dimension's size: tp, cp and pp (``stages``) as set (unset: 1), dp the rest; ep
    (unset: 1) of the dp ranks share out the experts, edp = dp / ep copies of them."""
    t, c, p, e = cfg.tensor_parallel, cfg.context_parallel, cfg.stages, cfg.ep or 1
    dp = cfg.world_size // (p * c * t)
    return {"pp": p, "dp": dp, "cp": c, "tp": t, "edp": dp // e, "ep": e}


def layout(sizes: dict[str, int], dims: tuple = DIMS) -> dict[str, list[list[int]]]:
    """The global ranks of every group of every dimension, as ``init_device_mesh`` lays them:
    ranks numbered row-major over the ``dims`` grid (tp varying fastest), a dimension's groups
    the lines along it. No process needed (the tests hold it against the mesh's own groups).
    ``EXPERT_DIMS``: the expert-parallel mesh, each "dp" group an edp x ep block of it."""
    grid = torch.arange(math.prod(sizes[d] for d in dims)).reshape([sizes[d] for d in dims])
    return {d: grid.movedim(i, -1).reshape(-1, sizes[d]).tolist() for i, d in enumerate(dims)}


def coordinates(rank: int, sizes: dict[str, int], dims: tuple = DIMS) -> dict[str, int]:
    """``rank``'s place on the mesh: its index in each dimension."""
    out = {}
    for d in reversed(dims):
        rank, out[d] = divmod(rank, sizes[d])
    return {d: out[d] for d in dims}


# ---- each stage split over its groups ------------------------------------------------------------


def split_sequence(stage: nn.Module, group, layout: str, seq_len: int) -> nn.Module:
    """``cp.parallelize``'s cut on one pipeline stage, in place: whatever of the embedding, the
    blocks and the head it holds (a stage may hold no embedding, or no head). Parameter names
    stay the dense model's."""
    n, r = group.size(), group.rank()
    attend = ring(group, layout)
    for parent in stage.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, Embed):
                setattr(parent, name, SliceEmbed(child, positions(r, n, seq_len, layout)))
            elif isinstance(child, Block):
                child.attn = SplitAttention(child.attn, attend)
            elif isinstance(child, Head):
                child.from_shard = FromLastPosition(group, last_position_owner(n, seq_len, layout))
    return stage


def local_shapes(stage: Stage, cp: int) -> None:
    """What each send/recv between stages carries once the sequence is split: every boundary
    inside the model holds this rank's s / cp positions (the model's input, whole samples the
    embedding picks its positions from, and its output, the head's, are unchanged)."""
    last = stage.total - 1

    def sliced(t: torch.Tensor) -> torch.Tensor:
        return t.new_empty((t.shape[0], t.shape[SEQ] // cp, *t.shape[SEQ + 1 :]))

    stage.shapes = {
        c: (inp if c == 0 else sliced(inp), out if c == last else sliced(out))
        for c, (inp, out) in stage.shapes.items()
    }
    stage.inp, stage.out = stage.shapes[min(stage.shapes)][0], stage.shapes[max(stage.shapes)][1]


# ---- the strategy --------------------------------------------------------------------------------


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    sizes = degrees(cfg)
    mesh = init_device_mesh(ctx.device.type, [sizes[d] for d in DIMS], mesh_dim_names=DIMS)
    groups = {d: mesh.get_group(d) for d in DIMS}
    for d, group in groups.items():
        wire.tag(group, d)  # each dimension's bytes counted apart
    me = {d: mesh.get_local_rank(d) for d in DIMS}
    dp, cp, tp = sizes["dp"], sizes["cp"], sizes["tp"]

    stage = make_stage(cfg, ctx, fns, "1f1b", index=me["pp"])  # 1. the stages: this rank's
    if tp > 1 and any(isinstance(m, Block) for m in stage.module.modules()):
        parallelize(stage.module, groups["tp"])  # 2. its layers split over the tp group
    if cp > 1:  # 3. its sequence split over the cp group, attention a ring
        split_sequence(stage.module, groups["cp"], cfg.cp_layout, cfg.seq_len)
        local_shapes(stage, cp)
    for moe in moe_layers(stage.module):  # the auxiliary loss's gradient comes once per
        aux = moe.spec.aux_loss / (cfg.microbatches * cp)  # forward: M micro-batches, cp ranks
        moe.spec = dataclasses.replace(moe.spec, aux_loss=aux)  # summed: 1 / (M cp) each
    expert: set[int] = set()  # the parameters of the experts this rank alone holds
    if cfg.experts and sizes["ep"] > 1:  # 3b. the experts shared out over the ep group
        shape = [sizes[d] for d in EXPERT_DIMS]
        experts_mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=EXPERT_DIMS)
        for d in ("edp", "ep"):
            groups[d] = experts_mesh.get_group(d)
            wire.tag(groups[d], d)
        for moe in moe_layers(stage.module):
            spread_experts(moe, groups["ep"])
            expert |= {id(p) for p in moe.experts.parameters()}
    optimizer = fns.optimizer(cfg, stage.module.parameters())
    # one pipeline per (dp, cp, tp): the records' replica, each pipeline's bubble on its own
    pipeline = (me["dp"] * cp + me["cp"]) * tp + me["tp"]
    watch = stage_watch(
        cfg, ctx, stage, "1f1b", "scratch", pipeline, dp_rank=me["dp"], cp_rank=me["cp"],
        tp_rank=me["tp"],
    )  # fmt: skip
    # 4. 1F1B with the stage ranks of this (dp, cp, tp): the "pp" group carries every message
    step_fn = scratch_schedule(cfg, ctx, stage, watch, "1f1b", fns.loss(cfg), group=groups["pp"])

    def sync_grads() -> None:  # 5. partial sums over cp, then the mean over dp
        if cp > 1:  # each rank saw its positions: every gradient but the head's is partial
            allreduce_partial_grads(stage.module, groups["cp"])
        params = [p for p in stage.module.parameters() if p.grad is not None]
        dense = [p.grad for p in params if id(p) not in expert]
        spread = [p.grad for p in params if id(p) in expert]
        if dp > 1 and dense:
            all_reduce_flat(dense, group=groups["dp"])
        if sizes["edp"] > 1 and spread:  # an expert's copies, each saw its own group's tokens
            all_reduce_flat(spread, group=groups["edp"])
        for g in dense + spread:  # the means over dp: the experts' sums too, ep's tokens
            g /= dp  # summed in by the all-to-all

    out = train_stages(
        cfg,
        ctx,
        stage,
        step_fn,
        optimizer=optimizer,
        watch=watch,
        replica=me["dp"],  # the data: replica dp of dp takes its slice of every global batch
        replicas=dp,
        sync_grads=sync_grads if dp > 1 or cp > 1 else None,
    )
    shape = " x ".join(f"{d} {sizes[d]}" for d in DIMS)
    if expert:
        shape += f" (dp as edp {sizes['edp']} x ep {sizes['ep']})"
    out["notes"].insert(
        0,
        f"mesh {shape} on {cfg.world_size} ranks (tp innermost): "
        + "; ".join(f"{d} groups {layout(sizes)[d]}" for d in reversed(DIMS) if sizes[d] > 1),
    )
    if out["params"] is not None and tp > 1:  # check mode: every tensor whole, dense names
        out["params"] = {
            stage.names[k]: v for k, v in full_state(stage.module, groups["tp"]).items()
        }
    return out
