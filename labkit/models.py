"""Toy models built as ``nn.Sequential`` of blocks, so that any prefix/suffix is a stage."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import RunConfig
from .moe import MoE, MoESpec


def mlp(
    in_features: int = 32, width: int = 256, depth: int = 4, classes: int = 10
) -> nn.Sequential:
    """``depth`` hidden Linear+ReLU blocks and a Linear head: ``depth + 1`` splittable blocks."""
    widths = [in_features] + [width] * depth
    return _mlp_blocks(widths, classes)


def unbalanced_mlp(
    in_features: int = 32, width: int = 256, depth: int = 4, classes: int = 10
) -> nn.Sequential:
    """An MLP whose blocks grow 4x in width from first to last: splitting it by layer count puts
    most of the work in the last stage (the stage-balancing lesson)."""
    if depth == 1:
        return mlp(in_features, width, depth, classes)
    scale = [0.25 + 1.75 * i / (depth - 1) for i in range(depth)]  # 0.25w .. 2w
    widths = [in_features] + [max(8, int(width * s)) for s in scale]
    return _mlp_blocks(widths, classes)


def _mlp_blocks(widths: Sequence[int], classes: int) -> nn.Sequential:
    blocks = [nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*blocks, nn.Linear(widths[-1], classes))


def cnn(
    channels: int = 3, width: int = 32, depth: int = 3, classes: int = 10, image_size: int = 16
) -> nn.Sequential:
    """``depth`` conv blocks (3x3 conv, ReLU; a 2x2 pool on the first two) and a linear head."""
    blocks, c, size = [], channels, image_size
    for i in range(depth):
        layers = [nn.Conv2d(c, width, 3, padding=1), nn.ReLU()]
        if i < 2 and size >= 4:
            layers.append(nn.MaxPool2d(2))
            size //= 2
        blocks.append(nn.Sequential(*layers))
        c = width
    return nn.Sequential(*blocks, nn.Sequential(nn.Flatten(), nn.Linear(c * size * size, classes)))


# ---- a small transformer (tensor parallelism's model) -------------------------------------------


class Embed(nn.Module):
    """Each position's feature vector projected to the hidden size, plus a learned position."""

    def __init__(self, in_features: int, hidden: int, seq_len: int):
        super().__init__()
        self.proj = nn.Linear(in_features, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, hidden))
        # a seam, the identity here: sequence parallelism keeps only this rank's slice of the
        # sequence from here on (labkit.strategies.tp); it holds no parameters, so names stay
        self.to_shard = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, in) -> (batch, seq, hidden)
        return self.to_shard(self.proj(x) + self.pos[: x.shape[1]])


class SelfAttention(nn.Module):
    """Causal multi-head self-attention, ``softmax(q k^T / sqrt(d)) v`` per head.

    ``qkv`` is one Linear whose output rows are grouped by head (q, k, v of head 0, then of head
    1, ...), so any contiguous block of its rows is a set of whole heads: the cut tensor
    parallelism makes. The number of heads is read off the tensor (``-1`` below), so the same
    code runs a module holding all heads or a tensor-parallel rank's share of them.
    """

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
        self.head_dim = hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # shapes read here: under sequence parallelism x is a slice of the
        b, s = qkv.shape[:2]  # sequence and qkv gathers it whole
        qkv = qkv.view(b, s, -1, 3, self.head_dim)  # -1: the heads held here
        q, k, v = qkv.transpose(1, 2).unbind(3)  # each (batch, heads, seq, head_dim)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """h -> 4h -> h with a GELU between."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """A GPT-2 style pre-LayerNorm block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; with
    ``moe``, the feed-forward is a mixture of experts, each a ``FeedForward`` (``labkit.moe``)."""

    def __init__(self, hidden: int, heads: int, moe: MoESpec | None = None):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = (
            FeedForward(hidden) if moe is None else MoE(hidden, moe, lambda: FeedForward(hidden))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Classify a sequence from its last position, the only one a causal model lets see it all."""

    def __init__(self, hidden: int, classes: int):
        super().__init__()
        self.from_shard = nn.Identity()  # the seam where sequence parallelism gathers it back
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(self.from_shard(x)[:, -1]))


def transformer(
    in_features: int = 32,
    hidden: int = 64,
    layers: int = 2,
    classes: int = 10,
    heads: int = 4,
    seq_len: int = 16,
    moe: MoESpec | None = None,
) -> nn.Sequential:
    """A small GPT-style sequence classifier: embedding, ``layers`` blocks, head (``layers + 2``
    splittable blocks). Input (batch, seq_len, in_features), output (batch, classes).

    Causal, as in GPT (the model the Megatron-LM papers split): the mask changes nothing about
    how tensor parallelism cuts it (heads are independent either way), and the last position,
    which has attended to every other one, is what the head reads. ``moe``: every block's
    feed-forward a mixture of experts."""
    blocks = [Block(hidden, heads, moe) for _ in range(layers)]
    return nn.Sequential(Embed(in_features, hidden, seq_len), *blocks, Head(hidden, classes))


# ---- a GPT-style language model: the shape the published memory figures describe ---------------


class TokenEmbed(Embed):
    """Token ids to vectors: a word embedding (vocab x hidden) plus a learned position. An
    ``Embed``, so tensor parallelism finds its seam (``to_shard``) and replicates it."""

    def __init__(self, vocab: int, hidden: int, seq_len: int):
        nn.Module.__init__(self)
        self.tokens = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(0.02 * torch.randn(seq_len, hidden))
        self.to_shard = nn.Identity()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> (batch, seq, hidden)
        return self.to_shard(self.tokens(ids) + self.pos[: ids.shape[1]])


class LMHead(Head):
    """Every position's logits over the vocabulary: a final LayerNorm and the output layer, its
    output (batch, vocab, seq) as ``nn.CrossEntropyLoss`` takes it against (batch, seq) ids."""

    def __init__(self, hidden: int, vocab: int):
        nn.Module.__init__(self)
        self.from_shard = nn.Identity()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(self.from_shard(x))).transpose(1, 2)


def lm(
    vocab: int = 256,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq_len: int = 16,
    tie: bool = False,
) -> nn.Sequential:
    """A GPT-style language model: token and position embeddings, ``layers`` blocks, a final
    LayerNorm and the output layer over the vocabulary (``layers + 2`` splittable blocks); it
    predicts every position's next token. Parameters: L(12h^2 + 13h) + Vh + sh + 2h, and Vh more
    for an output layer of its own; ``tie`` shares the word embedding with it (GPT-2, Megatron-LM;
    not across pipeline stages, which labkit's pipelines do not keep in step)."""
    model = nn.Sequential(
        TokenEmbed(vocab, hidden, seq_len),
        *[Block(hidden, heads) for _ in range(layers)],
        LMHead(hidden, vocab),
    )
    if tie:
        model[-1].out.weight = model[0].tokens.weight
    return model


def make_model(cfg: RunConfig) -> nn.Sequential:
    """The model a config asks for, initialised from ``cfg.seed`` (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    if cfg.model == "cnn":
        return cnn(width=cfg.width // 8 or 8, depth=cfg.depth, classes=cfg.classes)
    if cfg.model == "transformer":  # heads, seq_len: RunConfig fields to come
        return transformer(
            cfg.in_features,
            cfg.width,
            cfg.depth,
            cfg.classes,
            heads=cfg.heads,
            seq_len=cfg.seq_len,
            moe=moe_spec(cfg),
        )
    build = unbalanced_mlp if cfg.model == "unbalanced_mlp" else mlp
    return build(cfg.in_features, cfg.width, cfg.depth, cfg.classes)


def moe_spec(cfg: RunConfig) -> MoESpec | None:
    """The mixture of experts a config asks for (None: ``experts=0``, the dense feed-forward);
    its groups are one rank's share of ``cfg.token_groups``."""
    if not cfg.experts:
        return None
    return MoESpec(
        cfg.experts,
        cfg.top_k,
        cfg.capacity_factor,
        cfg.aux_loss,
        cfg.router_skew,
        groups=cfg.groups_per_rank,
    )


def even_bounds(n_layers: int, stages: int) -> list[int]:
    """Block indices where each stage starts, giving stages equal layer counts (±1)."""
    if not 1 <= stages <= n_layers:
        raise ValueError(
            f"cannot split {n_layers} blocks into {stages} stages: "
            f"use between 1 and {n_layers} stages"
        )
    return [round(i * n_layers / stages) for i in range(stages)]


def split(model: nn.Sequential, bounds: Sequence[int]) -> list[nn.Sequential]:
    """Cut a Sequential at ``bounds`` (start index of each stage). Parameters keep their names
    relative to ``model`` via ``stage_param_names`` so stages can be compared with the whole."""
    ends = list(bounds[1:]) + [len(model)]
    if list(bounds) != sorted(set(bounds)) or bounds[0] != 0 or ends[-1] <= bounds[-1]:
        raise ValueError(
            f"bounds {list(bounds)} must start at 0 and strictly increase below {len(model)}"
        )
    # Renumber from 0: slicing a Sequential keeps the whole model's indices as names.
    return [nn.Sequential(*list(model)[a:b]) for a, b in zip(bounds, ends)]


def stage_param_names(bounds: Sequence[int], stage: int, stage_module: nn.Module) -> dict[str, str]:
    """Map a stage's local parameter names ('0.0.weight') to the whole model's ('2.0.weight')."""
    return {name: _whole_name(bounds[stage], name) for name, _ in stage_module.named_parameters()}


def stage_state_names(bounds: Sequence[int], stage: int, stage_module: nn.Module) -> dict[str, str]:
    """``stage_param_names`` for parameters and buffers (BatchNorm's running statistics)."""
    names = [n for n, _ in stage_module.named_parameters()]
    names += [n for n, _ in stage_module.named_buffers()]
    return {name: _whole_name(bounds[stage], name) for name in names}


def _whole_name(offset: int, local: str) -> str:
    head, _, rest = local.partition(".")
    return f"{int(head) + offset}.{rest}"


# ---- stage balancing: where to cut by measured cost -------------------------------------------


def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Stage start indices splitting ``costs`` into contiguous runs that minimise the slowest
    stage's total (dynamic programming over cut points; n is a few dozen blocks at most)."""
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot split {n} blocks into {stages} stages: use 1..{n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest slowest-stage cost putting the first i blocks on k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def stage_costs(costs: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Summed block cost of each stage for the given stage start indices."""
    ends = list(bounds[1:]) + [len(costs)]
    return [sum(costs[a:b]) for a, b in zip(bounds, ends)]


# ---- activation checkpointing ------------------------------------------------------------------


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing per block: each child of an ``nn.Sequential`` keeps only its
    input for backward and recomputes its inside then (``torch.utils.checkpoint``, non-reentrant:
    the first block's input needs no gradient). Parameter names are unchanged."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"activation_checkpointing=True checkpoints each block of an nn.Sequential; the model "
            f"is a {type(model).__name__}: return nn.Sequential(block1, block2, ...) "
            f"from model_fn, or set activation_checkpointing=False"
        )
    for block in model:
        block.forward = _checkpointed(block.forward)
    return model


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
