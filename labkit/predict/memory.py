"""The memory calculator: bytes per rank by category, before anything runs.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, arXiv:1910.02054, section 3.1):
with Psi parameters and K bytes of optimizer state per parameter, data parallelism (DDP) holds
params + grads + K*Psi on every rank; ZeRO-1 divides the optimizer state by N, ZeRO-2 the
gradients too, ZeRO-3 (FSDP) all three; HSDP is ZeRO-3 within groups of ``shard_size`` ranks,
replicated across groups, so its states divide by ``shard_size``, not N. Bytes per parameter
(``recipe``):

* ``"autocast"`` (what labkit trains with, ``torch.autocast``; ``calculate`` only): fp32
  parameters and gradients (4 + 4), optimizer fp32 (SGD with momentum 4, Adam 8 + a 4-byte step
  per tensor), and in bf16/fp16 a 16-bit copy of each weight that autograd saves (``rest``);
* ``"paper"`` (the ZeRO paper's mixed-precision Adam, the default of the large-model formulas):
  2 + 2 + 12 (16-bit parameters and gradients; fp32 master weights, momentum and variance in the
  optimizer state), 16 bytes per parameter before sharding;
* ``"deepspeed"`` (``transformer``, ``model_states``, ``transformer_layout``): DeepSpeed's
  published estimators, which budget 18 bytes per parameter of sharded state by keeping an fp32
  gradient partition (ZeRO-2 and ZeRO-3 only; see ``model_states``), so a figure can be matched
  with the estimator a practitioner knows.

Activations come from the model's layers: a meta-device forward (no memory, any size) records
which tensors each layer type saves for backward (Linear/Conv: the input, and under autocast a
16-bit copy of it and of the weight; ReLU: its output; max-pool: its input and int64 indices;
views: nothing; cross-entropy: fp32 log-probabilities), each distinct tensor counted once, the
input batch not at all. With activation checkpointing each block saves only its input. Exact
shards: FSDP pads every tensor's dim 0 to a multiple of N; ZeRO-1 assigns whole tensors to
ranks the way ``ZeroRedundancyOptimizer`` does (largest first, to the least loaded rank).
Large transformers are described by their shape instead (``transformer``,
``transformer_layout``): Korthikanti et al.'s activations, one definition of recomputation for
both (``stack_activations``).
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from .. import registry
from ..moe import moe_layers

CATEGORIES = ("params", "grads", "optimizer", "activations", "rest")
OPTIMIZERS = {"sgd": 0, "sgd_momentum": 4, "adam": 8}  # fp32 state bytes per parameter
PRECISIONS = ("fp32", "bf16", "fp16")
# what calculate() traces exactly: every strategy the registry gives a ZeRO stage (DDP, by hand
# or not, and DataParallel hold stage 0's bytes; FSDP is ZeRO-3; HSDP ZeRO-3 within a group)
STRATEGIES = tuple(
    n
    for n, s in registry.STRATEGIES.items()
    if s.zero_stage is not None and "tp" not in s.knobs  # FSDP x TP also splits the layers
)
# transformer(): the ZeRO stage of each, and the paper's stages 2 and 3 by name
STAGES = {**{n: registry.get(n).zero_stage for n in STRATEGIES}, "zero2": 2, "zero3": 3}
RECIPES = ("paper", "deepspeed")  # bytes per parameter of the large-model formulas
_ACT_OUT = (nn.ReLU, nn.Tanh, nn.Sigmoid)  # save their output
_ACT_IN = (nn.GELU, nn.SiLU, nn.LeakyReLU)  # save their input
_MATMUL = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_VIEWS = (nn.Flatten, nn.Unflatten, nn.Identity, nn.Dropout)
_POOL = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)


def view_root(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was taken of, or ``t`` itself. torch has no public accessor for it:
    this reads ``Tensor._base``, as in torch 2.14 (the one place labkit reads it)."""
    return t if t._base is None else t._base


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
    _check_precision(precision)
    half = precision in ("bf16", "fp16")
    low = 2 if half else 4
    meta = copy.deepcopy(model).to("meta")
    x = torch.empty(input_shape, device="meta")
    size: dict[int, int] = {id(x): 4}  # tensor -> bytes per element
    keep, saved, copies, approx = [x], {}, [0], []
    batch = id(x)

    def base(t):
        return id(view_root(t))

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
        b = id(view_root(inp))
        size[id(view_root(out))] = low if isinstance(module, _MATMUL) else size.get(b, 4)

    return hook


def shard_numels(
    shapes: list[tuple], strategy: str, world_size: int, shard_size: int | None = None
) -> list[int]:
    """Parameters (elements) each rank holds of each category's sharded state: FSDP's padded
    dim-0 shards (HSDP's over its ``shard_size`` ranks), ZeRO-1's whole-tensor partition (for
    the optimizer), or everything."""
    _check_strategy(strategy, world_size, shard_size)
    numels = [math.prod(s) for s in shapes]
    if STAGES[strategy] == 3:
        n = shard_size if _grouped(strategy) else world_size
        per = sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)
        return [per] * world_size
    if STAGES[strategy] == 1:
        return [sum(part) for part in zero1_partition(numels, world_size)]
    return [sum(numels)] * world_size


def _unpadded_shards(shapes, world_size: int, shard_size: int | None, strategy: str) -> list[int]:
    """Elements of each rank's FSDP shards without the padding: rank r of a group of n holds
    rows r*c .. (r+1)*c - 1 of a tensor's dim 0 (c = ceil(rows / n)), fewer on the last ranks
    when n does not divide it. FSDP2 keeps parameters and gradients in padded storage, but the
    optimizer creates its state from the unpadded shard (``torch.zeros_like``)."""
    n = shard_size if _grouped(strategy) else world_size
    out = []
    for r in range(world_size):
        g = r % n  # the rank's place in its shard group
        held = 0
        for s in shapes:
            c = math.ceil(s[0] / n)
            held += max(0, min(c, s[0] - g * c)) * math.prod(s[1:])
        out.append(held)
    return out


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
    shard_size: int | None = None,
):
    """Bytes per rank by category (one row per rank, a pandas DataFrame) for ``model`` trained
    on ``global_batch`` samples of ``input_shape`` (one sample's shape) per step under one of
    labkit's strategies (``STRATEGIES``; ``hsdp`` shards each copy over ``shard_size`` ranks).
    ``recipe``: "autocast" or "paper" (see the module docstring)."""
    import pandas as pd

    _check_strategy(strategy, world_size, shard_size)
    _check(world_size, precision, optimizer, recipe, global_batch, accumulate)
    micro = global_batch // (world_size * accumulate)
    shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    psi = sum(math.prod(s) for s in shapes)
    acts = activation_bytes(
        model, (micro, *input_shape), classes, precision=precision, checkpoint=checkpoint
    )
    p_b, g_b, k_b = _bytes_per_param(precision, optimizer, recipe)
    full = [psi] * world_size
    sharded = shard_numels(shapes, strategy, world_size, shard_size)
    opt_n = sharded if STAGES[strategy] >= 1 else full
    state_n = sharded if STAGES[strategy] >= 3 else full
    if STAGES[strategy] == 3:  # the optimizer's state: each rank's shard unpadded (the last of
        opt_n = _unpadded_shards(shapes, world_size, shard_size, strategy)  # an uneven split)
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
    if STAGES[strategy] != 1:
        return [len(shapes)] * world_size
    return [len(part) for part in zero1_partition([math.prod(s) for s in shapes], world_size)]


def _check_strategy(strategy, world_size, shard_size) -> None:
    if strategy not in STRATEGIES:
        also = " (ZeRO-2/3 of a large transformer: transformer() or model_states())"
        raise ValueError(
            f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
            + (also if strategy in STAGES else "")
        )
    _check_group(strategy, world_size, shard_size)


def _check_group(strategy, world_size, shard_size) -> None:
    """The world size, and HSDP's shard groups: ``shard_size`` for hsdp, and only for it."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if strategy == registry.REFERENCE and world_size != 1:
        raise ValueError(f"{strategy} runs on one device: set world_size=1")
    if not _grouped(strategy):
        if shard_size is not None:
            raise ValueError("shard_size sets HSDP's shard groups: drop it or use strategy='hsdp'")
        return
    if not isinstance(shard_size, int) or shard_size < 1 or world_size % shard_size:
        raise ValueError(
            f"hsdp shards each copy of the model over shard_size ranks and replicates it across "
            f"world_size / shard_size groups: set shard_size to a divisor of {world_size}, "
            f"got {shard_size!r}"
        )


def _check_precision(precision) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")


def _check(world_size, precision, optimizer, recipe, global_batch, accumulate) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    _check_precision(precision)
    if recipe not in ("autocast", "paper"):
        ds = " (DeepSpeed's estimators: transformer() or model_states())"
        raise ValueError(
            f"recipe must be 'autocast' (labkit's) or 'paper' (ZeRO's), got {recipe!r}"
            + (ds if recipe == "deepspeed" else "")
        )
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
    shard_size: int | None = None,
    optimizer: str = "adam",
    checkpoint: bool = True,
    recipe: str = "paper",
) -> dict:
    """One computed (not measured) row, bytes per rank in the five categories, for a transformer
    of ``n_params`` parameters and ``layers`` layers trained under ``strategy`` (a key of
    ``STAGES``: its ZeRO stage; ``hsdp`` shards over ``shard_size`` ranks) on ``world_size``
    ranks, one micro-batch per rank.

    * params, grads, optimizer: ``model_states`` at the strategy's stage and ``recipe`` (the
      ZeRO paper's 2 + 2 + K bytes per parameter by default);
    * activations: ``stack_activations`` (Korthikanti et al. 2022) over the layers, the peak of
      backward: with ``checkpoint`` (full recomputation) each layer keeps its 2*s*b*h-byte input
      and the layer whose backward runs rebuilds its activations once on top;
    * rest: ZeRO-3's working copy of the layer being computed, its 16-bit weights and gradients
      (4 bytes per parameter of one layer): rest is where the memory meter counts FSDP's
      gathered parameters too; ``transformer_layout``, which has no rest, adds the same bytes
      to params."""
    stage, shards = _stage(strategy, world_size, shard_size)
    _check_layout_knobs(dp=shards, zero=stage, tp=1, pp=1, optimizer=optimizer, recipe=recipe)
    _check_shape(layers=layers, hidden=hidden, heads=heads, tp=1, pp=1)
    if not n_params > 0:
        raise ValueError(f"n_params must be a positive number of parameters, got {n_params!r}")
    row = _states(n_params, shards, stage, _k(optimizer), recipe)
    recompute = "full" if checkpoint else "none"
    shape = dict(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads)
    return {
        "model": f"transformer {n_params / 1e9:g}B (computed, not measured)",
        "strategy": strategy,
        "world_size": world_size,
        **row,
        "activations": stack_activations(layers=layers, **shape, recompute=recompute),
        "rest": _gathered_layer(hidden, 1, stage, shards, recipe),
    }


def _stage(strategy: str, world_size: int, shard_size: int | None) -> tuple[int, int]:
    """A strategy's ZeRO stage and the ranks its states are sharded over."""
    if strategy not in STAGES:
        raise ValueError(f"strategy must be one of {', '.join(STAGES)}, got {strategy!r}")
    _check_group(strategy, world_size, shard_size)
    return STAGES[strategy], shard_size if _grouped(strategy) else world_size


def _grouped(strategy: str) -> bool:
    """Sharded within groups of ``shard_size`` ranks, replicated across them (HSDP)."""
    return strategy in registry.STRATEGIES and "shard_size" in registry.get(strategy).knobs


# ---- large transformers under any layout (tensor, pipeline and data parallel, ZeRO) -----------
#
# The calculator above traces a real nn.Module. The functions below need no model at all: a
# GPT-style transformer is described by a handful of numbers (layers L, hidden size h, heads a,
# sequence length s, vocabulary V, micro-batch b), and its memory per GPU follows from formulas
# published with Megatron-LM and ZeRO. Bytes are plain numbers (floats): 1 GB = 1e9 bytes.

RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
STATE_CATEGORIES = ("params", "grads", "optimizer")


def parameters(*, layers: int, hidden: int, vocab: int, seq: int) -> int:
    """Parameters of a GPT-style transformer, as Megatron-LM counts them (Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21):

    * each layer 12*h^2 + 13*h: the attention's QKV (3h^2 + 3h) and output projection (h^2 + h),
      the MLP's two matrices (4h^2 + 4h and 4h^2 + h), two LayerNorms (2h each);
    * embeddings V*h (words, tied to the output layer) + s*h (learned positions).

    For h = 4096, L = 36, V = 51200, s = 2048 this is 7.47e9, the paper's "7.5B" model."""
    h = hidden
    return layers * (12 * h * h + 13 * h) + vocab * h + seq * h


def model_states(
    psi: float,
    *,
    dp: int = 1,
    zero: int = 0,
    tp: int = 1,
    pp: int = 1,
    optimizer: str = "adam",
    recipe: str = "paper",
) -> dict:
    """Bytes per GPU of the model states of ``psi`` parameters, split evenly over ``tp * pp``
    model-parallel GPUs, in the ZeRO paper's mixed precision (Rajbhandari et al. 2020,
    arXiv:1910.02054, Section 3.1 and Figure 1): 2 bytes of 16-bit parameters, 2 of 16-bit
    gradients and K of optimizer state per parameter (Adam: K = 12, the fp32 master copy,
    momentum and variance). ZeRO then shards them over the ``dp`` data-parallel ranks:

    ======  ======================  ==========================
    stage   sharded over dp         bytes per GPU (Figure 1)
    ======  ======================  ==========================
    0       nothing (plain DP)      (2 + 2 + K) * psi
    1       optimizer state (P_os)  (2 + 2) * psi + K * psi / dp
    2       + gradients (P_os+g)    2 * psi + (2 + K) * psi / dp
    3       + parameters (+p)       (2 + 2 + K) * psi / dp
    ======  ======================  ==========================

    Figure 1's example, psi = 7.5e9, dp = 64, K = 12: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.

    ``recipe="deepspeed"`` follows DeepSpeed's estimators instead (GPU, nothing offloaded;
    ``estimate_zero2_model_states_mem_needs`` in deepspeed/runtime/zero/stage_1_and_2.py and
    ``estimate_zero3_model_states_mem_needs`` in stage3.py), 18 bytes per parameter of sharded
    state, for the two stages they are published for:

    ======  =============================================================================
    2       2 * psi + 18 * psi / dp: 16-bit and fp32 gradients (2 + 4) and K sharded
    3       18 * psi / dp: 16-bit weights, the fp32 gradient partition (4) and K sharded,
            plus 4 bytes per parameter of the layer being computed (``transformer_layout``)
    ======  =============================================================================

    DeepSpeed's ZeRO-3 estimator counts a layer's 16-bit gradients only in that working copy."""
    _check_layout_knobs(dp=dp, zero=zero, tp=tp, pp=pp, optimizer=optimizer, recipe=recipe)
    if not psi > 0:
        raise ValueError(f"psi must be a positive number of parameters, got {psi!r}")
    return _states(psi / (tp * pp), dp, zero, _k(optimizer), recipe)


def _k(optimizer: str) -> int:
    """K, bytes of optimizer state per parameter: the optimizer's fp32 state + the fp32 master."""
    return OPTIMIZERS[optimizer] + 4


def _states(psi_gpu: float, dp: int, zero: int, k: int, recipe: str = "paper") -> dict:
    """ZeRO's sharding of ``psi_gpu`` parameters' states over ``dp`` ranks (see model_states)."""
    if recipe == "deepspeed":  # the fp32 gradient partition; ZeRO-2 also shards 16-bit ones
        grads = (2 + 4 if zero == 2 else 4) * psi_gpu / dp
    else:
        grads = 2 * psi_gpu / (dp if zero >= 2 else 1)
    return {
        "params": 2 * psi_gpu / (dp if zero >= 3 else 1),
        "grads": grads,
        "optimizer": k * psi_gpu / (dp if zero >= 1 else 1),
    }


def _gathered_layer(hidden: int, tp: int, zero: int, dp: int, recipe: str) -> float:
    """ZeRO-3's working copy of the layer being computed: its 16-bit weights, gathered, and its
    16-bit gradients until they are reduce-scattered (DeepSpeed's ``largest_layer_memory``, 4
    bytes per parameter of one layer). Nothing is gathered on one rank, but DeepSpeed's
    estimator counts it there too, where it is the only place its 16-bit gradients live."""
    if zero == 3 and (dp > 1 or recipe == "deepspeed"):
        return 4 * (12 * hidden * hidden + 13 * hidden) / tp
    return 0.0


def stage_parameters(
    *, layers: int, hidden: int, vocab: int, seq: int, tp: int = 1, pp: int = 1
) -> float:
    """Parameters one GPU holds on the first pipeline stage (the fullest one) of a ``tp`` x
    ``pp`` layout. Tensor parallelism (Megatron-LM) splits each layer's weights over ``tp``
    GPUs, and the word embedding too (vocabulary-parallel: each GPU holds V/tp rows); the
    position embedding (s*h) is replicated. Pipeline parallelism gives each stage L/pp layers;
    the first stage also holds the embeddings, the last the tied output layer (a second copy of
    the word embedding, V*h/tp) and the final LayerNorm (2h): the first stage is the fullest.

    Simplification: a layer's 12h^2 + 13h parameters are all divided by tp; in Megatron-LM the
    LayerNorms and the row-parallel biases (6h per layer) are replicated on every tp rank,
    under 0.1 % of a layer for h >= 1024."""
    per_layer = 12 * hidden * hidden + 13 * hidden
    return (layers // pp) * per_layer / tp + vocab * hidden / tp + seq * hidden


def layer_activations(
    *,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    cp: int = 1,
) -> float:
    """Bytes one transformer layer keeps for backward, for one micro-batch, on one GPU: Table 2
    of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198), 16-bit activations and 1-byte dropout masks (s sequence, b micro-batch,
    h hidden, a heads, t tensor-parallel size):

    ==========================  =====================================================
    no tensor parallelism       s*b*h * (34 + 5*a*s/h)
    tensor parallel             s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel  s*b*h/t * (34 + 5*a*s/h)
    selective recomputation     the same without the 5*a*s/h term
    full recomputation          2*s*b*h (the layer's input; /t with sequence parallel)
    ==========================  =====================================================

    The 34 counts the linear layers' inputs, LayerNorm inputs and dropout masks; 5*a*s/h the
    attention's s x s scores, softmax output and its dropout mask, which grow with s^2 and are
    what selective recomputation recomputes instead of keeping. Without sequence parallelism
    the LayerNorms and dropouts (10*s*b*h) are replicated on every tp rank.

    Context parallelism (``cp``; ``labkit.strategies.cp``) divides all of it by cp: a GPU keeps
    the per-token activations of its s/cp positions, and its queries' scores over all s keys."""
    _check_recompute(recompute)
    _check_whole(tp=tp, cp=cp)
    if cp > 1:
        shape = dict(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp)
        kept = layer_activations(**shape, sequence_parallel=sequence_parallel, recompute=recompute)
        return kept / cp
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel or t == 1:
        return s * b * h / t * (34 + attention)
    return s * b * h * (10 + 24 / t + attention / t)


def transformer_layout(
    *,
    layers: int,
    hidden: int,
    heads: int,
    seq: int,
    vocab: int,
    micro_batch: int,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    zero: int = 0,
    recompute: str = "none",
    optimizer: str = "adam",
    microbatches_in_flight: int | None = None,
    sequence_parallel: bool = False,
    recipe: str = "paper",
    cp: int = 1,
) -> dict:
    """Bytes per GPU (``params``, ``grads``, ``optimizer``, ``activations``, ``total``) of a
    GPT-style transformer trained with tensor (``tp``), pipeline (``pp``) and data (``dp``)
    parallelism and a ZeRO stage, in mixed precision (2 + 2 + 12 bytes per parameter with Adam,
    or DeepSpeed's ``recipe``: see ``model_states``), on the fullest GPU: the first pipeline
    stage.

    * Model states: the first stage's parameters (``stage_parameters``), sharded by ZeRO over
      dp (``model_states``).
    * Activations: ``stack_activations`` over the stage's L/pp layers, times the micro-batches
      in flight. The rule implemented: under the 1F1B schedule stage i holds at most pp - i
      micro-batches' activations before their backward frees them, so the first stage holds pp
      of them (``microbatches_in_flight`` defaults to pp; pass min(pp, m) with m micro-batches
      per step, or m for GPipe). As Korthikanti notes, L/pp layers x pp micro-batches = L
      layers' worth, whatever pp is.
    * ZeRO-3 gathers each layer's parameters just before computing it and holds that layer's
      full 16-bit gradient until it is reduce-scattered: 4 bytes per parameter of one layer
      are added to ``params`` (more if the framework prefetches the next layers).
    * Left out (as in Table 2): the embedding's dropout mask and the output layer's logits
      (about s*b*h/t and 4*s*b*V/t bytes on the first and last stage), the framework's own
      memory (CUDA context, NCCL buffers, fragmentation): the advisor keeps a reserve for it."""
    _check_layout_knobs(dp=dp, zero=zero, tp=tp, pp=pp, optimizer=optimizer, recipe=recipe)
    _check_shape(layers=layers, hidden=hidden, heads=heads, tp=tp, pp=pp)
    in_flight = pp if microbatches_in_flight is None else microbatches_in_flight
    _check_whole(microbatches_in_flight=in_flight)
    psi = stage_parameters(layers=layers, hidden=hidden, vocab=vocab, seq=seq, tp=tp, pp=pp)
    out = _states(psi, dp, zero, _k(optimizer), recipe)
    out["params"] += _gathered_layer(hidden, tp, zero, dp, recipe)
    out["activations"] = stack_activations(
        layers=layers // pp,
        in_flight=in_flight,
        seq=seq,
        micro_batch=micro_batch,
        hidden=hidden,
        heads=heads,
        tp=tp,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
        cp=cp,  # context parallelism: each GPU's s/cp positions (``layer_activations``)
    )
    out["total"] = sum(out[c] for c in (*STATE_CATEGORIES, "activations"))
    return out


def stack_activations(
    *,
    layers: int,
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    in_flight: int = 1,
    cp: int = 1,
) -> float:
    """Peak bytes of activations on one GPU for ``layers`` transformer layers, each holding
    ``in_flight`` micro-batches: what each layer keeps (``layer_activations``), and with
    recomputation what the layer whose backward runs rebuilds on top of that, once (its full
    activations less what it kept). Full recomputation keeps each layer's 2*s*b*h-byte input
    (Korthikanti et al. 2022, Table 2); the rebuilt layer is the rest of backward's peak.
    ``transformer`` and ``transformer_layout`` both read this one definition."""
    _check_whole(layers=layers, in_flight=in_flight)
    shape = dict(seq=seq, micro_batch=micro_batch, hidden=hidden, heads=heads, tp=tp, cp=cp)
    kept = layer_activations(**shape, sequence_parallel=sequence_parallel, recompute=recompute)
    full = layer_activations(**shape, sequence_parallel=sequence_parallel)
    return layers * in_flight * kept + (full - kept if recompute != "none" else 0.0)


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")


def _check_layout_knobs(
    *, dp: int, zero: int, tp: int, pp: int, optimizer: str, recipe: str = "paper"
) -> None:
    if isinstance(zero, bool) or zero not in ZERO_STAGES:
        raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    _check_whole(dp=dp, tp=tp, pp=pp)
    if recipe not in RECIPES:
        raise ValueError(
            f"recipe must be 'paper' (the ZeRO paper's 16 bytes per parameter) or 'deepspeed' "
            f"(DeepSpeed's estimators, 18 per sharded parameter), got {recipe!r}"
        )
    if recipe == "deepspeed" and zero < 2:
        raise ValueError(
            "recipe='deepspeed' follows DeepSpeed's estimators, published for ZeRO-2 and ZeRO-3 "
            "only: use ZeRO stage 2 or 3 (strategy zero2, zero3, fsdp or hsdp), or recipe='paper'"
        )


def _check_whole(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _check_shape(*, layers: int, hidden: int, heads: int, tp: int, pp: int) -> None:
    if hidden % heads:
        raise ValueError(
            f"hidden {hidden} does not split into {heads} heads: choose a hidden size that is a "
            f"multiple of the number of heads (e.g. {heads * max(1, round(hidden / heads))})"
        )
    if heads % tp:
        raise ValueError(
            f"tp {tp} does not divide the {heads} heads: tensor parallelism gives each GPU "
            "whole heads; choose tp among the divisors of heads"
        )
    if layers % pp:
        raise ValueError(
            f"pp {pp} does not divide the {layers} layers: choose pp among the divisors of layers"
        )


# ---- a mixture of experts: parameters, and their states under expert parallelism --------------
#
# A mixture-of-experts layer (Shazeer et al. 2017, arXiv:1701.06538) replaces the MLP with a
# router and E expert MLPs, of which each token runs k: the parameters grow with E, the compute
# per token with k. Expert parallelism (GShard, Lepikhin et al. 2020, arXiv:2006.16668) puts
# E/ep experts on each of ep GPUs; everything else stays data parallel.


def moe_parameters(
    *,
    layers: int,
    hidden: int,
    heads: int,
    ffn_hidden: int,
    experts: int,
    top_k: int,
    vocab: int,
    kv_heads: int | None = None,
    gated: bool = True,
    tied: bool = False,
    seq: int = 0,
) -> dict:
    """Parameters of a decoder-only MoE transformer in Mixtral's form (Jiang et al. 2024,
    arXiv:2401.04088): no biases; per layer attention with ``kv_heads`` key/value heads
    (grouped-query: q and the output projection h x h, k and v h x kv_heads*h/heads each), a
    router (h x E), E experts of ``3 * h * ffn_hidden`` (SwiGLU; 2 with ``gated=False``) and
    two norms (h each); a word embedding and, unless ``tied``, an output layer (V x h each),
    ``seq`` x h learned positions (0: rotary), a final norm.

    Returns ``total``; ``active``, what one token runs (k experts per layer, the rest whole);
    ``experts``, all layers' experts; ``dense``, everything else; ``per_expert``, one expert.
    Mixtral 8x7B (h 4096, 32 layers, 32 heads, 8 kv heads, ffn 14336, E 8, k 2, V 32000): 46.70e9
    total, 12.88e9 active, as published (46.7B and 12.9B)."""
    _check_whole(layers=layers, hidden=hidden, heads=heads, ffn_hidden=ffn_hidden)
    _check_whole(experts=experts, top_k=top_k, vocab=vocab, kv_heads=kv_heads or heads)
    if top_k > experts or hidden % heads or heads % (kv_heads or heads):
        raise ValueError(
            f"need top_k <= experts ({top_k} > {experts}?), heads dividing hidden and kv_heads "
            f"dividing heads: got hidden {hidden}, heads {heads}, kv_heads {kv_heads}"
        )
    kv = (kv_heads or heads) * (hidden // heads)
    per_expert = (3 if gated else 2) * hidden * ffn_hidden
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + hidden * experts + 2 * hidden
    dense = layers * per_layer + vocab * hidden * (1 if tied else 2) + seq * hidden + hidden
    all_experts = layers * experts * per_expert
    return {
        "total": dense + all_experts,
        "active": dense + layers * top_k * per_expert,
        "experts": all_experts,
        "dense": dense,
        "per_expert": per_expert,
    }


def moe_states(
    dense: float,
    experts: float,
    *,
    ep: int = 1,
    dp: int = 1,
    zero: int = 0,
    optimizer: str = "adam",
    recipe: str = "paper",
) -> dict:
    """Bytes per GPU of the model states of an MoE model with ``dense`` non-expert and
    ``experts`` expert parameters on ``dp`` data-parallel GPUs, ``ep`` of which share out each
    layer's experts (ep divides dp, as in Megatron-Core and DeepSpeed-MoE):

    * the dense parameters are replicated on every GPU: ``model_states`` over dp (ZeRO shards
      their states over all dp GPUs);
    * each GPU holds experts / ep expert parameters, their gradients and optimizer state, and
      dp / ep GPUs hold the same experts: ZeRO shards the experts' states over those.

    ``ep=1`` is plain data parallelism of the whole model; labkit's ``ep`` strategy is ep = dp
    = N with no ZeRO: (dense + experts / N) x (4 + 4 + K) bytes in fp32."""
    _check_layout_knobs(dp=dp, zero=zero, tp=1, pp=1, optimizer=optimizer, recipe=recipe)
    _check_whole(ep=ep)
    if dp % ep:
        raise ValueError(
            f"ep {ep} does not divide dp {dp}: expert parallelism spreads the experts over ep of "
            f"the data-parallel GPUs, so choose ep among the divisors of {dp}"
        )
    if not dense >= 0 or not experts >= 0:
        raise ValueError(f"parameter counts must be >= 0, got {dense!r} and {experts!r}")
    k = _k(optimizer)
    d, e = _states(dense, dp, zero, k, recipe), _states(experts / ep, dp // ep, zero, k, recipe)
    out = {c: d[c] + e[c] for c in STATE_CATEGORIES}
    out["total"] = sum(out.values())
    return out


def moe_split(model: nn.Module) -> tuple[int, int]:
    """(non-expert, expert) parameters of a model built of ``labkit.moe.MoE`` blocks (or any
    model: (all, 0)): what ``moe_states`` and the ep strategy divide differently."""
    expert = {id(p) for m in moe_layers(model) for p in m.experts.parameters()}
    params = list(model.parameters())
    n_expert = sum(p.numel() for p in params if id(p) in expert)
    return sum(p.numel() for p in params) - n_expert, n_expert
