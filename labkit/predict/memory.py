"""The memory calculator: bytes per rank by category, before anything runs.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, arXiv:1910.02054, section 3.1):
with Psi parameters and K bytes of optimizer state per parameter, data parallelism (DDP) holds
params + grads + K*Psi on every rank; ZeRO-1 divides the optimizer state by N, ZeRO-3 (FSDP)
all three. Two recipes of bytes per parameter:

* ``"autocast"`` (what labkit trains with, ``torch.autocast``): fp32 parameters and gradients
  (4 + 4), optimizer fp32 (SGD with momentum 4, Adam 8 + a 4-byte step per tensor), and in
  bf16/fp16 a 16-bit copy of each weight that autograd saves for backward (``rest``);
* ``"paper"`` (the ZeRO paper's mixed-precision Adam): 2 + 2 + 12 (fp32 master weights,
  momentum and variance live in the optimizer state), 16 bytes per parameter before sharding.

Activations come from the model's layers: a meta-device forward (no memory, any size) records
which tensors each layer type saves for backward (Linear/Conv: the input, and under autocast a
16-bit copy of it and of the weight; ReLU: its output; max-pool: its input and int64 indices;
views: nothing; cross-entropy: fp32 log-probabilities), each distinct tensor counted once, the
input batch not at all. With activation checkpointing each block saves only its input. Exact
shards: FSDP pads every tensor's dim 0 to a multiple of N; ZeRO-1 assigns whole tensors to
ranks the way ``ZeroRedundancyOptimizer`` does (largest first, to the least loaded rank).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

CATEGORIES = ("params", "grads", "optimizer", "activations", "rest")
OPTIMIZERS = {"sgd": 0, "sgd_momentum": 4, "adam": 8}  # fp32 state bytes per parameter
STRATEGIES = ("single", "ddp", "zero1", "fsdp")
_ACT_OUT = (nn.ReLU, nn.Tanh, nn.Sigmoid)  # save their output
_ACT_IN = (nn.GELU, nn.SiLU, nn.LeakyReLU)  # save their input
_MATMUL = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_VIEWS = (nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout)
_POOL = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)


def activation_bytes(
    model: nn.Module,
    input_shape: tuple,
    classes: int,
    *,
    precision: str = "fp32",
    checkpoint: bool = False,
) -> dict:
    """Bytes autograd keeps from one forward of a batch of ``input_shape``: ``activations``,
    and ``weight_copies`` (autocast's 16-bit weights saved for backward). Traced on the meta
    device, so the model may be far larger than memory; unknown layer types are counted as
    saving input and output, and named in ``approximate``."""
    half = precision in ("bf16", "fp16")
    low = 2 if half else 4
    meta = copy.deepcopy(model).to("meta")
    x = torch.empty(input_shape, device="meta")
    size: dict[int, int] = {id(x): 4}  # tensor -> bytes per element
    keep, saved, copies, approx = [x], {}, [0], []
    batch = id(x)

    def base(t):
        return id(t._base) if t._base is not None else id(t)

    def save(t, elem=None):
        if base(t) != batch:
            saved[base(t)] = t.numel() * (elem or size.get(base(t), 4))

    def hook(module, args, out):
        inp = args[0]
        keep.extend([inp, out])
        elem = size.get(base(inp), 4)
        if isinstance(module, _MATMUL):
            if half and elem == 4:
                saved[id(out) + 1] = inp.numel() * low  # the 16-bit cast of the input, a new tensor
            else:
                save(inp)
            # addmm saves the weight only to compute the input's gradient; convolution always
            if half and (base(inp) != batch or not isinstance(module, nn.Linear)):
                copies[0] += module.weight.numel() * low
            size[id(out)] = low
        else:
            size[base(out)] = size.get(base(out), elem)
            if isinstance(module, _ACT_OUT):
                save(out)
            elif isinstance(module, _ACT_IN):
                save(inp)
            elif isinstance(module, _POOL):
                save(inp)
                saved[id(out) + 1] = out.numel() * 8  # int64 indices
            elif not isinstance(module, _VIEWS):
                save(inp)
                save(out)
                approx.append(type(module).__name__)

    blocks = list(meta.children()) if checkpoint else []
    if checkpoint:
        if not isinstance(meta, nn.Sequential):
            raise ValueError("checkpoint=True checkpoints each block of an nn.Sequential")
        h = x
        with torch.no_grad():
            for block in blocks:  # each block keeps only its input
                save(h)
                hs = [
                    m.register_forward_hook(_dtype_only(size, low, half))
                    for m in block.modules()
                    if not list(m.children())
                ]
                h = block(h)
                for hk in hs:
                    hk.remove()
                keep.append(h)
        out = h
    else:
        hooks = [m.register_forward_hook(hook) for m in meta.modules() if not list(m.children())]
        with torch.no_grad():
            out = meta(x)
        for hk in hooks:
            hk.remove()
    rows = out.shape[0] if out.dim() > 1 else 1
    loss = rows * classes * 4 + 4  # fp32 log-probabilities and the mean's total weight
    return {
        "activations": sum(saved.values()) + loss,
        "weight_copies": copies[0],
        "approximate": sorted(set(approx)),
    }


def _dtype_only(size: dict, low: int, half: bool):
    """Inside a checkpointed block: only track what dtype each tensor has."""

    def hook(module, args, out):
        inp = args[0]
        b = id(inp._base) if inp._base is not None else id(inp)
        size[id(out) if out._base is None else id(out._base)] = (
            low if isinstance(module, _MATMUL) else size.get(b, 4)
        )

    return hook


def shard_numels(shapes: list[tuple], strategy: str, world_size: int) -> list[int]:
    """Parameters (elements) each rank holds of each category's sharded state: FSDP's padded
    dim-0 shards, ZeRO-1's whole-tensor partition (for the optimizer), or everything."""
    numels = [math.prod(s) for s in shapes]
    if strategy == "fsdp":
        per = sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes)
        return [per] * world_size
    if strategy == "zero1":
        return [sum(part) for part in zero1_partition(numels, world_size)]
    return [sum(numels)] * world_size


def zero1_partition(numels: list[int], world_size: int) -> list[list[int]]:
    """The tensors (their element counts) each rank's optimizer owns under ZeRO-1:
    ``ZeroRedundancyOptimizer``'s greedy split, largest first, to the least loaded rank."""
    parts: list[list[int]] = [[] for _ in range(world_size)]
    for n in sorted(numels, reverse=True):
        min(parts, key=sum).append(n)
    return parts


def calculate(
    model: nn.Module,
    *,
    input_shape: tuple,
    classes: int,
    global_batch: int,
    strategy: str = "ddp",
    world_size: int = 1,
    precision: str = "fp32",
    optimizer: str = "sgd_momentum",
    checkpoint: bool = False,
    accumulate: int = 1,
    recipe: str = "autocast",
):
    """Bytes per rank by category (one row per rank, a pandas DataFrame) for ``model`` trained
    on ``global_batch`` samples of ``input_shape`` (one sample's shape) per step."""
    import pandas as pd

    _check(strategy, world_size, precision, optimizer, recipe, global_batch, accumulate)
    micro = global_batch // (world_size * accumulate)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    psi = sum(math.prod(s) for s in shapes)
    acts = activation_bytes(
        model, (micro, *input_shape), classes, precision=precision, checkpoint=checkpoint
    )
    p_b, g_b, k_b = _bytes_per_param(precision, optimizer, recipe)
    full = shard_numels(shapes, "single", world_size)
    sharded = shard_numels(shapes, strategy, world_size)
    opt_n = sharded if strategy in ("zero1", "fsdp") else full
    state_n = sharded if strategy == "fsdp" else full
    steps = _adam_steps(shapes, strategy, world_size) if optimizer == "adam" else [0] * world_size
    batch = micro * (math.prod(input_shape) * 4 + 8)  # float inputs, int64 targets
    copies = acts["weight_copies"] if recipe == "autocast" else 0
    copies += sum(b.numel() * b.element_size() for b in model.buffers())  # never sharded
    rows = [
        {
            "rank": r,
            "params": state_n[r] * p_b,
            "grads": state_n[r] * g_b,
            "optimizer": opt_n[r] * k_b + 4 * steps[r],
            "activations": acts["activations"],
            "rest": batch + copies,
        }
        for r in range(world_size)
    ]
    df = pd.DataFrame(rows)
    df.attrs.update(parameters=psi, micro_batch=micro, approximate=acts["approximate"])
    return df


def _bytes_per_param(precision: str, optimizer: str, recipe: str) -> tuple[int, int, int]:
    if recipe == "paper" and precision != "fp32":
        return 2, 2, OPTIMIZERS[optimizer] + 4  # + the fp32 master copy
    return 4, 4, OPTIMIZERS[optimizer]


def _adam_steps(shapes, strategy: str, world_size: int) -> list[int]:
    """Adam keeps one 4-byte step counter per parameter tensor it updates."""
    if strategy != "zero1":
        return [len(shapes)] * world_size
    return [len(part) for part in zero1_partition([math.prod(s) for s in shapes], world_size)]


def _check(strategy, world_size, precision, optimizer, recipe, global_batch, accumulate) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    if recipe not in ("autocast", "paper"):
        raise ValueError(
            f"recipe must be 'autocast' (labkit's) or 'paper' (ZeRO's), got {recipe!r}"
        )
    if strategy == "single" and world_size != 1:
        raise ValueError("single runs on one device: set world_size=1")
    if global_batch % (world_size * accumulate):
        raise ValueError(
            f"global batch {global_batch} does not split into {accumulate} "
            f"micro-batch(es) on each of {world_size} rank(s)"
        )


def transformer(
    n_params: float = 7e9,
    *,
    layers: int = 32,
    hidden: int = 4096,
    heads: int = 32,
    seq: int = 4096,
    micro_batch: int = 1,
    strategy: str = "fsdp",
    world_size: int = 64,
    optimizer: str = "adam",
    checkpoint: bool = True,
) -> dict:
    """One computed (not measured) row for a large transformer in the paper's mixed precision
    (2 + 2 + K bytes per parameter). Activations per layer (Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", 16-bit, no tensor parallelism):
    s*b*h*(34 + 5*a*s/h) bytes; with full checkpointing each layer keeps its 2*s*b*h-byte input."""
    k = OPTIMIZERS[optimizer] + 4
    n = world_size if strategy == "fsdp" else 1
    s, b, h = seq, micro_batch, hidden
    per_layer = 2 * s * b * h if checkpoint else s * b * h * (34 + 5 * heads * s / h)
    return {
        "model": f"transformer {n_params / 1e9:g}B (computed, not measured)",
        "strategy": strategy,
        "world_size": world_size,
        "params": 2 * n_params / n,
        "grads": 2 * n_params / n,
        "optimizer": k * n_params / (world_size if strategy in ("zero1", "fsdp") else 1),
        "activations": layers * per_layer,
        "rest": 0.0,
    }
