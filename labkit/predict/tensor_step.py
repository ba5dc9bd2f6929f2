"""Predict a tensor-parallel step (``tp``, ``tp_dtensor``, and ``dp_tp``'s data x tensor mesh)
from a compute profile: each rank computes its share of every split block and waits for the
activation collectives each Megatron pair ends with."""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import Strategy
from .collectives import CollectiveModel, coefficients
from .profile import Profile, StepPrediction


@dataclass(frozen=True)
class SplitBlock:
    """How ``labkit.strategies.tp.parallelize`` cuts one block of the profile: its compute
    divided over the tensor-parallel ranks or not, the activation collectives it ends with
    (each of the block's output, b x s x h), and which of its parameters stay whole."""

    split: bool
    forward: int = 0  # g: all-reduces of its output in forward
    backward: int = 0  # f: all-reduces of an input gradient in backward
    whole: tuple[int, ...] = ()  # parameters (forward order) every rank holds entire
    partial: tuple[int, ...] = ()  # of those, the ones sequence parallelism leaves partial


# labkit's transformer Block, parameters in forward order: ln1 (w, b), qkv (w, b), proj (w, b),
# ln2 (w, b), fc1 (w, b), fc2 (w, b); the LayerNorms and the row-parallel biases stay whole
_BLOCK_WHOLE, _BLOCK_LAYERNORMS = (0, 1, 5, 6, 7, 11), (0, 1, 6, 7)


def tensor_parallel_layout(profile: Profile) -> list[SplitBlock]:
    """Per block of the profile, how tensor parallelism cuts it. labkit's transformer: each
    ``Block`` is two Megatron pairs (attention, MLP): two all-reduces in forward, two in
    backward; the embedding and head replicated. labkit's MLP: hidden blocks paired, column
    then row, one all-reduce after each pair in forward and one before it in backward, except
    before the first layer, whose input needs no gradient; the row layer's bias whole; an odd
    last hidden block and the head replicated."""
    names = [layer.name.split(": ")[-1] for layer in profile.layers]
    if "Block" in names:
        return [
            SplitBlock(True, 2, 2, _BLOCK_WHOLE, _BLOCK_LAYERNORMS + (5, 11))
            if n == "Block"
            else SplitBlock(False)
            for n in names
        ]
    pairs = (len(names) - 1) // 2 * 2
    return [
        SplitBlock(True, 1, 1 if i > 1 else 0, (1,), (1,)) if i < pairs and i % 2
        else SplitBlock(i < pairs)
        for i in range(len(names))
    ]  # fmt: skip


def predict_tensor_parallel(
    profile: Profile,
    network: CollectiveModel,
    strategy: Strategy,
    world_size: int,
    global_batch: int,
    tp: int,
    sequence_parallel: bool,
) -> StepPrediction:
    """Every rank of a tensor-parallel group computes 1/tp of each split block on the whole
    batch of its data-parallel replica (``dp = world_size / tp``) and waits for the activation
    collectives each Megatron pair ends with (``tensor_parallel_layout``), b x s x h elements
    each. Under sequence parallelism each all-reduce is a reduce-scatter plus an all-gather (the
    same bytes), the sequence is gathered once before the head and once in the embedding's
    backward, and the parameters that saw a slice of the sequence (LayerNorms; by hand also the
    row-parallel biases, which DTensor adds before its reduce-scatter) are all-reduced over
    the group after backward. With dp > 1 each rank then averages its share of the weights'
    gradients with its twins in the other replicas (dp_tp), after backward."""
    dp = world_size // tp
    micro = profile.at_batch(global_batch / dp)
    layout = tensor_parallel_layout(profile)

    def share(x: float, block: SplitBlock) -> float:
        return x / tp if block.split else x

    fwd = sum(share(x.forward_s, b) for x, b in zip(micro.layers, layout))
    bwd = sum(share(x.backward_s, b) for x, b in zip(micro.layers, layout))
    comm_s = sent = 0.0

    def add(op: str, nbytes: float, n: int, times: int = 1) -> None:
        nonlocal comm_s, sent
        comm_s += times * network.time(op, nbytes, n)
        sent += times * nbytes * coefficients(op, n)[1]

    for layer, block in zip(micro.layers, layout):
        nbytes, times = layer.activation_bytes * micro.batch, block.forward + block.backward
        if sequence_parallel:
            add("reduce_scatter", nbytes, tp, times)
            add("all_gather", nbytes, tp, times)
        else:
            add("all_reduce", nbytes, tp, times)
    if sequence_parallel:  # the seams: into the head (forward), out of the embedding (backward)
        seam = next(x.activation_bytes for x, b in zip(micro.layers, layout) if b.split)
        add("all_gather", seam * micro.batch, tp, 2)
        partial = 0.0
        for layer, block in zip(profile.layers, layout):
            # DTensor adds the row-parallel bias before its reduce-scatter: only the LayerNorms
            kept = block.partial
            if strategy.dtensor:
                kept = _BLOCK_LAYERNORMS if block.split else ()
            partial += sum(layer.grad_bytes[i] for i in kept)
        add("all_reduce", partial, tp)
    if dp > 1:  # the replicas' gradient average: this rank's share of every parameter
        grads = sum(
            g if i in block.whole else share(g, block)
            for layer, block in zip(profile.layers, layout)
            for i, g in enumerate(layer.grad_bytes)
        )
        add("all_reduce", grads, dp)
    return StepPrediction(
        strategy.name,
        world_size,
        global_batch,
        profile.data_s,
        fwd,
        bwd,
        profile.optimizer_s / tp,
        comm_total_s=comm_s,
        exposed_s=comm_s,  # every message here is on the critical path
        comm_bytes=sent,
    )
