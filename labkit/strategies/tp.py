"""Tensor parallelism by hand (Megatron-LM): every layer split across ranks, which all see the
same batch.

Shoeybi et al. 2019 (arXiv:1909.08053) split a pair of Linears ``Y = act(X A) B`` without
communicating in between: ``A`` by columns (rank r computes ``X A_r``, its own output features),
``B`` by rows (rank r computes ``act(X A_r) B_r``, a partial sum of the whole output). One
all-reduce sums the partial outputs. Two operators mark the region, and they are conjugate:

* ``f`` before the column-parallel layer: identity forward, all-reduce backward (each rank holds
  only its columns' share of ``dL/dX``);
* ``g`` after the row-parallel layer: all-reduce forward, identity backward.

A transformer block is two such pairs: attention (q, k, v split by heads, the output projection
by rows) and the MLP (h -> 4h by columns, 4h -> h by rows). Per block: two all-reduces of the
activations forward, two backward. LayerNorms, the embedding and the head are replicated: every
rank computes them in full, on the same numbers, so their gradients agree without a message.

Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198): between the regions (the
LayerNorms, residual adds) every rank holds the same activations, ``t`` copies of them. Instead,
keep only this rank's slice of the sequence there. ``f`` becomes an all-gather of the sequence
(backward: reduce-scatter) and ``g`` a reduce-scatter (backward: all-gather): an all-reduce *is*
a reduce-scatter then an all-gather, so the bytes are the same and the activations between the
regions take 1/t the memory. The price: a LayerNorm (and a row-parallel bias, added after the
reduce-scatter) now sees only its slice of the sequence, so its gradient is a partial sum that
must be all-reduced over the group after backward (``allreduce_sequence_parallel_grads``).

Every collective here is a ``torch.distributed`` call on the group passed in (gloo on CPU, NCCL
on GPUs), so whatever counts a group's bytes sees all of it. ``tp_dtensor.py`` is the same model
through ``torch.distributed.tensor.parallel``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext, all_gather_single, all_reduce_flat, reduce_scatter_single
from ..factories import Factories
from ..models import Block, Embed, Head
from ..rank.loop import build_model, train_loop

SEQ = 1  # activations are (batch, sequence, hidden)


# ---- collectives along one dimension -----------------------------------------------------------


def all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (the collective concatenates along dim 0)."""
    t = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((t * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The sum of every rank's ``x``, of which this rank keeps its slice along ``dim``."""
    t = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((x.shape[0] // t, *x.shape[1:]))
    reduce_scatter_single(out, x, group=group)
    return out.movedim(0, dim)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's ``x``, in a new tensor (the collective works in place)."""
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (no communication)."""
    return x.chunk(dist.get_world_size(group), dim)[dist.get_rank(group)].contiguous()


# ---- the conjugate operators: where a tensor-parallel region begins and ends -------------------


class CopyToRegion(torch.autograd.Function):
    """``f``: identity forward; backward, all-reduce: each rank's columns gave part of dL/dX."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """``g``: all-reduce forward (sum the partial outputs); backward, identity."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherSequenceToRegion(torch.autograd.Function):
    """``f`` under sequence parallelism: all-gather the sequence forward; backward,
    reduce-scatter (sum each rank's part of dL/dX, keep this rank's slice of the sequence)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter(grad, SEQ, ctx.group), None


class ScatterSequenceFromRegion(torch.autograd.Function):
    """``g`` under sequence parallelism: reduce-scatter forward (sum the partial outputs, keep
    this rank's slice of the sequence); backward, all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, SEQ, ctx.group), None


class SplitSequence(torch.autograd.Function):
    """Into the sequence-parallel part of the model (after the replicated embedding): keep this
    rank's slice of the sequence; backward, all-gather (the embedding needs every position's
    gradient, and each rank has only its slice's)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, SEQ, ctx.group), None


class GatherSequence(torch.autograd.Function):
    """Out of the sequence-parallel part (before the replicated head): all-gather the sequence;
    backward, keep this rank's slice: every rank computed the head on the same numbers, so each
    already holds the whole gradient (a reduce-scatter would count it t times)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather(x, SEQ, group)

    @staticmethod
    def backward(ctx, grad):
        return split(grad, SEQ, ctx.group), None


class Apply(nn.Module):
    """An autograd Function on the group, as a module: what fills the model's seams."""

    def __init__(self, fn: type[torch.autograd.Function], group):
        super().__init__()
        self.fn, self.group = fn, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn.apply(x, self.group)

    def extra_repr(self) -> str:
        return self.fn.__name__


# ---- parallel Linear layers, cut out of the dense ones -----------------------------------------


def shard(t: torch.Tensor, dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Slice ``rank`` of ``world_size`` equal slices of ``t`` along ``dim``."""
    if t.shape[dim] % world_size:
        raise ValueError(
            f"cannot split {t.shape[dim]} features over {world_size} tensor-parallel ranks: "
            f"pick a tensor-parallel degree that divides it"
        )
    return t.detach().chunk(world_size, dim)[rank].clone()


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A``'s output features split: rank r holds rows r of
    ``nn.Linear.weight`` (and of the bias) and computes its own output features ``Y_r``. The
    input must be whole on every rank: ``f`` makes it so (under sequence parallelism, the
    all-gather of the sequence)."""

    split_dims = {"weight": 0, "bias": 0}  # how full_state puts the whole tensor back

    def __init__(self, dense: nn.Linear, group, sequence_parallel: bool = False):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(shard(dense.weight, 0, rank, t))
        self.bias = None if dense.bias is None else nn.Parameter(shard(dense.bias, 0, rank, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        enter = GatherSequenceToRegion if self.sequence_parallel else CopyToRegion
        return F.linear(enter.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A``'s input features split: rank r holds columns r of
    ``nn.Linear.weight``, takes its slice ``X_r`` of the input (the column-parallel layer's
    output) and computes the partial sum ``X_r A_r^T``; ``g`` adds them up. The bias is whole
    on every rank and added once, after the sum."""

    split_dims = {"weight": 1}  # the bias is replicated

    def __init__(self, dense: nn.Linear, group, sequence_parallel: bool = False):
        super().__init__()
        rank, t = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = nn.Parameter(shard(dense.weight, 1, rank, t))
        self.bias = None if dense.bias is None else nn.Parameter(dense.bias.detach().clone())
        if sequence_parallel and self.bias is not None:
            self.bias.sequence_parallel = True  # added to a slice of the sequence: partial grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leave = ScatterSequenceFromRegion if self.sequence_parallel else ReduceFromRegion
        y = leave.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


# ---- whole models ------------------------------------------------------------------------------


def parallelize(model: nn.Module, group, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` (labkit's transformer or MLP) over ``group`` in place; parameter names
    stay the dense model's, so ``full_state`` can put the dense model back together.

    Transformer: in each block, attention's ``qkv`` column-parallel (whole heads per rank: its
    rows are grouped by head) and ``proj`` row-parallel; the MLP's ``fc1`` column-parallel and
    ``fc2`` row-parallel; LayerNorms, the embedding and the head replicated.

    MLP (``nn.Sequential`` of ``(Linear, activation)`` blocks and a Linear head): consecutive
    hidden Linears paired, column then row (blocks 0+1, 2+3, ...). The first Linear opens a
    pair like any other (its input, the batch, is replicated anyway); an odd last hidden Linear
    and the head stay replicated: the head's output is the loss's input, needed whole on every
    rank, and splitting ``classes`` outputs would only buy an all-gather.
    """
    refuse_dropout(model)
    if any(isinstance(m, Block) for m in model.modules()):
        return _parallelize_transformer(model, group, sequence_parallel)
    if sequence_parallel:
        raise ValueError(
            "sequence parallelism splits the sequence dimension, which only the transformer "
            "has: set sequence_parallel=False for an MLP"
        )
    return _parallelize_mlp(model, group)


def refuse_dropout(model: nn.Module) -> None:
    """Dropout must draw the same mask on every rank where activations are replicated and
    different ones where they are split (Megatron-LM keeps two random streams for that); the
    training loop seeds each rank differently, so replicas would silently drift apart."""
    drops = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if drops:
        raise ValueError(
            f"tensor parallelism here has no per-region random streams, so dropout "
            f"({', '.join(drops)}) would differ between ranks that must agree: set p=0"
        )


def _parallelize_transformer(model: nn.Module, group, sequence_parallel: bool) -> nn.Module:
    for block in (m for m in model.modules() if isinstance(m, Block)):
        block.attn.qkv = ColumnParallelLinear(block.attn.qkv, group, sequence_parallel)
        block.attn.proj = RowParallelLinear(block.attn.proj, group, sequence_parallel)
        block.mlp.fc1 = ColumnParallelLinear(block.mlp.fc1, group, sequence_parallel)
        block.mlp.fc2 = RowParallelLinear(block.mlp.fc2, group, sequence_parallel)
        if sequence_parallel:  # a LayerNorm on a slice of the sequence: partial gradients
            for p in (*block.ln1.parameters(), *block.ln2.parameters()):
                p.sequence_parallel = True
    if sequence_parallel:  # the seams: slice the sequence after the embedding, gather it back
        for m in model.modules():  # before the head
            if isinstance(m, Embed):
                m.to_shard = Apply(SplitSequence, group)
            elif isinstance(m, Head):
                m.from_shard = Apply(GatherSequence, group)
    return model


def _parallelize_mlp(model: nn.Module, group) -> nn.Module:
    hidden = list(model)[:-1]
    if not (
        isinstance(model, nn.Sequential)
        and isinstance(model[-1], nn.Linear)
        and all(isinstance(b, nn.Sequential) and isinstance(b[0], nn.Linear) for b in hidden)
    ):
        raise ValueError(
            "tensor parallelism splits labkit's transformer, or an MLP built like labkit's: "
            "nn.Sequential(nn.Sequential(nn.Linear, activation), ..., nn.Linear)"
        )
    for first, second in zip(hidden[0::2], hidden[1::2]):
        first[0] = ColumnParallelLinear(first[0], group)
        second[0] = RowParallelLinear(second[0], group)
    return model


def allreduce_sequence_parallel_grads(model: nn.Module, group) -> None:
    """After backward, under sequence parallelism: sum the partial gradients of the parameters
    that saw only this rank's slice of the sequence (LayerNorms, row-parallel biases) over the
    group, in one message (Megatron-LM does the same before its optimizer step)."""
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if grads:
        all_reduce_flat(grads, group)


def full_state(model: nn.Module, group, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) whole, under the dense model's names: the split ones
    all-gathered along the dimension they were split on. Buffers too (the models here have
    none, but a user's might). Every rank of the group must call it."""
    state = {}
    for prefix, module in model.named_modules():
        dims = getattr(module, "split_dims", {})
        for name, p in module.named_parameters(prefix=prefix, recurse=False):
            t = p.grad if grads else p.detach()
            local = name.rpartition(".")[2]
            state[name] = None if t is None else _whole(t, dims.get(local), group)
        if not grads:
            for name, b in module.named_buffers(prefix=prefix, recurse=False):
                state[name] = b.detach().cpu().clone()
    return state


def _whole(t: torch.Tensor, dim: int | None, group) -> torch.Tensor:
    return (t.clone() if dim is None else all_gather(t, dim, group)).cpu()


# ---- the strategy ------------------------------------------------------------------------------


def degree(cfg: RunConfig, ctx: RankContext) -> int:
    """The tensor-parallel degree: every rank (``cfg.tp`` None or ``world_size``; data x tensor
    parallelism, ``tp < world_size``, is the composed strategy ``dp_tp``)."""
    tp = cfg.tp or ctx.world_size
    if tp != ctx.world_size:
        raise ValueError(
            f"tensor parallelism puts one slice of every layer on each rank: set tp=None or "
            f"tp == world_size (got tp={tp}, world_size={ctx.world_size})"
        )
    return tp


def tp_group(cfg: RunConfig, ctx: RankContext):
    """The group that splits every layer: here, all ranks."""
    return dist.new_group(list(range(degree(cfg, ctx))))


def same_batches(cfg: RunConfig, fns: Factories) -> batches:
    """The whole global batch on every rank, in single's order: the model is split, not the
    data (one shard of one, whatever the rank)."""
    loader = shard_loader(fns.dataset(cfg), cfg.global_batch // cfg.accumulate, 0, 1, cfg.seed)
    return batches(loader)


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    sequence_parallel = cfg.sequence_parallel
    group = tp_group(cfg, ctx)
    model = parallelize(build_model(cfg, ctx, fns), group, sequence_parallel)
    data = same_batches(cfg, fns)

    def sync_grads() -> None:  # only sequence parallelism leaves partial gradients
        allreduce_sequence_parallel_grads(model, group)

    out = train_loop(
        cfg, ctx, model, data, fns=fns, sync_grads=sync_grads if sequence_parallel else None
    )
    if out["params"] is not None:  # check mode: the dense model's state, every tensor whole
        out["params"] = full_state(model, group)
    return out
