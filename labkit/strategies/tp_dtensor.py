"""Tensor parallelism through ``torch.distributed.tensor.parallel``: ``tp.py``'s split, with the
library placing the collectives.

A ``DTensor`` is a tensor plus where its pieces live on a ``DeviceMesh``: ``Shard(d)`` (split
along dimension d), ``Replicate()`` (whole on every rank) or ``Partial()`` (every rank holds a
term of a sum). ``parallelize_module`` turns a module's parameters into DTensors and hooks its
inputs and outputs, by a plan of styles:

* ``ColwiseParallel``: the weight ``Shard(0)`` (output features split), the input made
  ``Replicate`` (its backward: the all-reduce that is ``f``), the output ``Shard(-1)``;
* ``RowwiseParallel``: the weight ``Shard(1)``, the input ``Shard(-1)``, the output ``Partial``
  made ``Replicate`` (the all-reduce that is ``g``) or, with ``output_layouts=Shard(1)``,
  reduce-scattered along the sequence. Its bias, ``Replicate``, becomes a ``Partial`` term
  (``bias / t`` on every rank) added *before* the reduction, where ``tp.py`` adds it once after;
  so under sequence parallelism its gradient is whole and needs no all-reduce;
* ``SequenceParallel``: a LayerNorm's parameters ``Replicate``, its input and output
  ``Shard(1)``; the gradients of its parameters come out ``Partial`` and are summed over the
  mesh when the optimizer reads them: the all-reduce ``tp.allreduce_sequence_parallel_grads``
  writes by hand, one message per tensor instead of one for all;
* ``PrepareModuleInputOutput``: layouts at a module's edges (``replicated`` below).

What the library leaves to you: every parameter must be a DTensor. A foreach optimizer step
(the default on GPUs) refuses a mix ("aten._foreach_add_.List got mixed torch.Tensor and
DTensor"; benchmarks/README.md, "Behind the code"). So the modules no style splits (the
embedding, the head, LayerNorms without sequence parallelism, an MLP's unpaired layers) get
their parameters replicated (``distribute_module``) and ``PrepareModuleInputOutput`` at their
edges, which makes the plain tensors that flow between modules DTensors and back.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..models import Block
from ..rank.loop import build_model, train_loop
from .tp import degree, refuse_dropout, same_batches

WHOLE = Replicate()


def replicated(arrives=WHOLE, leaves=WHOLE) -> PrepareModuleInputOutput:
    """A module every rank computes whole: its input arrives as ``arrives`` (a plain tensor:
    the part this rank holds) and is made whole; its output leaves as ``leaves``, plain."""
    return PrepareModuleInputOutput(
        input_layouts=arrives,
        desired_input_layouts=Replicate(),
        output_layouts=Replicate(),
        desired_output_layouts=leaves,
        use_local_output=True,
    )


def plan(model: nn.Module, sequence_parallel: bool = False) -> dict:
    """The parallelize_module plan for labkit's transformer (``tp.parallelize``'s split) or MLP
    (hidden Linears paired column then row; an odd last one and the head replicated)."""
    if not any(isinstance(m, Block) for m in model.modules()):
        if sequence_parallel:
            raise ValueError(
                "sequence parallelism splits the sequence dimension, which only the "
                "transformer has: set sequence_parallel=False for an MLP"
            )
        paired = (len(model) - 1) // 2 * 2  # hidden blocks 0+1, 2+3, ...
        steps = {f"{i}.0": ColwiseParallel() for i in range(0, paired, 2)}
        steps |= {f"{i}.0": RowwiseParallel() for i in range(1, paired, 2)}
        steps |= {f"{i}.0": replicated() for i in range(paired, len(model) - 1)}
        return steps | {str(len(model) - 1): replicated()}
    # between the embedding and the head, the residual stream: each rank's slice of the
    # sequence (Shard(1)) with sequence parallelism, else the whole of it on every rank
    stream = Shard(1) if sequence_parallel else Replicate()
    norm = SequenceParallel(use_local_output=True) if sequence_parallel else replicated()
    steps = {"0": replicated(leaves=stream), str(len(model) - 1): replicated(arrives=stream)}
    for i, block in enumerate(model):
        if isinstance(block, Block):
            steps |= {
                f"{i}.ln1": norm,
                f"{i}.attn.qkv": ColwiseParallel(input_layouts=stream),  # whole heads per rank
                f"{i}.attn.proj": RowwiseParallel(output_layouts=stream),
                f"{i}.ln2": norm,
                f"{i}.mlp.fc1": ColwiseParallel(input_layouts=stream),
                f"{i}.mlp.fc2": RowwiseParallel(output_layouts=stream),
            }
    return steps


def parallelize(model: nn.Module, mesh, sequence_parallel: bool = False) -> nn.Module:
    """``parallelize_module`` by ``plan``, then every parameter it left alone replicated."""
    refuse_dropout(model)  # DTensor's own random streams are not used here either
    parallelize_module(model, mesh, plan(model, sequence_parallel))
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own and not all(isinstance(p, DTensor) for p in own):
            distribute_module(module, mesh)  # no partition_fn: every parameter Replicate
    return model


def full_state(model: nn.Module) -> dict:
    """Every parameter whole (``DTensor.full_tensor()``: an all-gather of the shards), under
    the dense model's names, which ``parallelize_module`` keeps."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()
        for name, t in state.items()
    }


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    mesh = init_device_mesh(ctx.device.type, (degree(cfg, ctx),), mesh_dim_names=("tp",))
    model = parallelize(build_model(cfg, ctx, fns), mesh, cfg.sequence_parallel)
    data = same_batches(cfg, fns)  # every rank the whole global batch
    out = train_loop(cfg, ctx, model, data, fns=fns)
    if out["params"] is not None:  # check mode: the dense model's state, every tensor whole
        out["params"] = full_state(model)
    return out
