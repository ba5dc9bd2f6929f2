"""The dry run: one rank of a job of any size, its real strategy code run on tensors without
storage, and what that rank holds and sends in one step.

``dryrun(cfg, world_size=1024, rank=0)`` becomes rank 0 of a 1,024-rank job in this process
(``labkit.rank.storage_less``: a process group whose collectives return at once, torch's
``FakeTensorMode`` for every floating-point tensor) and calls the strategy's own ``run`` (the
module ``labkit.strategies`` holds) for one optimizer step. What it reports is read the way a real
run reads it: memory by the meter's five categories (``labkit.rank.memory_meter``: parameters,
gradients, optimizer state, activations at the schedule's peak, the rest) and every collective
the code issued, by name and group size, as the process group's hooks counted it
(``labkit.wire``). ``real(cfg)`` runs the same step on real ranks and reports the same tables,
so the two can be compared number for number at the sizes a laptop runs.

A model is one of labkit's (``cfg.model``) or a GPT-style language model given by its shape
(``Transformer``: layers, hidden, heads, sequence, vocabulary). Ranks that hold different things
(pipeline stages, ZeRO-1's largest and smallest partition, the last rank of an uneven FSDP
split) are each run (``ranks_that_differ``). A rank whose code cannot run without data (an
operation with no meta kernel, an API that needs a device) is reported with the error, never
filled in from a formula.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.data import Dataset

from ... import registry, wire
from ...config import RunConfig
from ...factories import Factories
from ...launch import launch
from ...models import lm
from ...predict.memory import CATEGORIES, zero1_partition
from ...rank import storage_less
from ...strategies import run_rank

GB = 1e9
RECIPES = ("labkit", "paper")
ATTENTION = ("fused", "math")
OPTIMIZERS = ("sgd_momentum", "adam")


# ---- what trains: a language model by its shape, its tokens, the paper's optimizer -----------


@dataclass(frozen=True)
class Transformer:
    """A GPT-style language model by its shape (``labkit.models.lm``): layers L, hidden size h,
    heads a, sequence length s, vocabulary V; ``tie`` shares the word embedding with the output
    layer. ``LLAMA_7B`` and ``LLAMA_70B`` are the shapes the issue names (dense, 4h MLP)."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    tie: bool = False

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.hidden % self.heads:
            fit = -(-self.hidden // self.heads) * self.heads
            raise ValueError(
                f"hidden {self.hidden} does not split into {self.heads} heads: choose a hidden "
                f"size that is a multiple of heads (e.g. {fit})"
            )

    @property
    def parameters(self) -> int:
        """L(12h^2 + 13h) + Vh + sh + 2h, and Vh for an untied output layer."""
        h = self.hidden
        out = self.layers * (12 * h * h + 13 * h) + self.vocab * h + self.seq_len * h + 2 * h
        return out + (0 if self.tie else self.vocab * h)

    def config(self, cfg: RunConfig | None = None, **fields) -> RunConfig:
        """A ``RunConfig`` with this shape in labkit's names (width h, depth L, classes V: each
        token's prediction is one of V classes) and ``fields``, or ``cfg`` with them: validated
        at once (heads and tensor degree, sequence and sequence parallelism, layers and stages).
        """
        shape = dict(
            model="transformer",
            width=self.hidden,
            depth=self.layers,
            heads=self.heads,
            seq_len=self.seq_len,
            classes=self.vocab,
        )
        batch = fields.get("global_batch", cfg.global_batch if cfg else 0)
        if "dataset_size" not in fields:  # token sequences are drawn when read: any size is free
            fields["dataset_size"] = max(batch, (cfg or RunConfig).dataset_size)
        return RunConfig(**shape, **fields) if cfg is None else cfg.replace(**shape, **fields)

    def __str__(self) -> str:
        b = self.parameters / 1e9
        return (
            f"transformer L={self.layers} h={self.hidden} a={self.heads} s={self.seq_len} "
            f"V={self.vocab} ({b:.3g}B parameters)"
        )


LLAMA_7B = Transformer(layers=32, hidden=4096, heads=32, seq_len=4096, vocab=32000)
LLAMA_70B = Transformer(layers=80, hidden=8192, heads=64, seq_len=4096, vocab=32000)


class TokenSequences(Dataset):
    """Random token ids, each sample (ids, the next ids): drawn when read from a generator
    seeded by the index, so a dataset of any size costs nothing until a rank reads its batch."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int = 0):
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        ids = torch.randint(self.vocab, (self.seq_len + 1,), generator=g)
        return ids[:-1], ids[1:]


class MasterAdam(torch.optim.Optimizer):
    """Adam on fp32 master copies of 16-bit parameters: the ZeRO paper's mixed-precision Adam
    (Rajbhandari et al. 2020, arXiv:1910.02054, section 3.1; Micikevicius et al. 2018,
    arXiv:1710.03740). Its state holds K = 12 bytes per parameter (the master weights, momentum,
    variance) and a step counter per tensor; it updates the master and copies it back."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            group["t"] = t = group.get("t", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["master"] = p.detach().float()
                    state["exp_avg"] = torch.zeros_like(state["master"])
                    state["exp_avg_sq"] = torch.zeros_like(state["master"])
                state["step"] += 1
                g, master = p.grad.float(), state["master"]
                state["exp_avg"].lerp_(g, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2**t)).sqrt_().add_(group["eps"])
                master.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1**t))
                p.copy_(master)


def factories(
    cfg: RunConfig,
    shape: Transformer | None,
    recipe: str,
    optimizer: str | None,
    model_fn=None,
    data_fn=None,
) -> Factories:
    """What trains: labkit's model, the language model ``shape`` or yours (``model_fn``,
    ``data_fn``: see ``labkit.factories``); in ``recipe`` "paper" 16-bit weights and
    ``MasterAdam`` (the ZeRO paper's bytes), else fp32 weights (autocast by ``cfg.precision``)
    and ``optimizer`` (None: labkit's SGD with momentum)."""
    optimizer_fn = None
    if shape is not None:
        tie = shape.tie

        def model_fn(c):
            return lm(c.classes, c.width, c.depth, c.heads, c.seq_len, tie=tie)

        def data_fn(c):
            return TokenSequences(c.dataset_size, c.seq_len, c.classes, c.seed)

    if recipe == "paper":
        build = model_fn

        def model_fn(c):  # noqa: F811 - the same model, built in 16 bits
            from ...models import make_model

            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # (.to() cannot convert fake parameters)
            try:
                return build(c) if build is not None else make_model(c)
            finally:
                torch.set_default_dtype(default)

        def optimizer_fn(c, params):
            return MasterAdam(params, lr=c.lr)

    elif optimizer == "adam":

        def optimizer_fn(c, params):
            return torch.optim.Adam(params, lr=c.lr, foreach=True)

    return Factories(model_fn=model_fn, data_fn=data_fn, optimizer_fn=optimizer_fn)


# ---- one rank, and the ranks that differ -----------------------------------------------------


@dataclass
class RankRun:
    """One rank's step: ``memory`` (bytes by ``CATEGORIES``), ``collectives`` (one dict per
    operation and group size: op, group_size, count, payload_bytes, sent_bytes), ``error``
    (why it could not run; then both are empty), ``seconds`` (wall time of the run here)."""

    rank: int
    role: str
    memory: dict = field(default_factory=dict)
    collectives: list = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    reads: int = 0  # numbers read out of tensors without data (read as 0)

    @property
    def total(self) -> int:
        return sum(self.memory.values())


@dataclass
class DryRun:
    """What ``dryrun`` (or ``real``) found: one ``RankRun`` per rank run; ``notes``: what the
    dry run did that a real run does not (``labkit.rank.storage_less.NOTES``)."""

    cfg: RunConfig
    shape: Transformer | None
    recipe: str
    ranks: list
    notes: list = field(default_factory=list)
    kind: str = "dry run"
    fns: Factories | None = field(default=None, repr=False)  # what trained (beside reads it)

    @property
    def failed(self) -> list:
        return [r for r in self.ranks if r.error]

    def memory(self) -> pd.DataFrame:
        """One row per rank: bytes in each category and their total."""
        rows = [
            {"rank": r.rank, "role": r.role, **{c: r.memory.get(c) for c in CATEGORIES},
             "total": r.total if not r.error else None, "error": r.error}
            for r in self.ranks
        ]  # fmt: skip
        return pd.DataFrame(rows)

    def collectives(self) -> pd.DataFrame:
        """One row per (rank, operation, group size): how many, payload and bytes sent."""
        rows = [{"rank": r.rank, "role": r.role, **c} for r in self.ranks for c in r.collectives]
        cols = ["rank", "role", "op", "group_size", "count", "payload_bytes", "sent_bytes"]
        return pd.DataFrame(rows, columns=cols)

    def fullest(self) -> RankRun:
        """The rank that holds the most (the one that must fit)."""
        ok = [r for r in self.ranks if not r.error]
        if not ok:
            raise ValueError(f"no rank ran: {self.ranks[0].error}")
        return max(ok, key=lambda r: r.total)

    def to_dict(self) -> dict:
        """What ``--json`` writes: the layout and, per rank run, each category's bytes and each
        collective's op, group size, bytes and count."""
        return {
            "kind": self.kind,
            "strategy": self.cfg.strategy,
            "world_size": self.cfg.world_size,
            "model": str(self.shape) if self.shape else self.cfg.model,
            "recipe": self.recipe,
            "notes": self.notes,
            "ranks": [
                {"rank": r.rank, "role": r.role, "memory_bytes": r.memory, "error": r.error,
                 "collectives": r.collectives, "seconds": r.seconds}
                for r in self.ranks
            ],
        }  # fmt: skip


def dry_config(
    cfg: RunConfig, world_size: int | None = None, shape: Transformer | None = None
) -> RunConfig:
    """``cfg`` as the dry run runs it: at ``world_size``, with ``shape``, one step, nothing
    timed or saved. Bad input stops here with the fix (``RunConfig``'s checks, and the dry
    run's own: ``check``)."""
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
        cfg = cfg.replace(world_size=world_size)
    if shape is not None:
        cfg = shape.config(cfg)
    cfg = cfg.replace(
        warmup=0, steps=1, deterministic=False, profile_dir=None, checkpoint_dir=None, pace_s=0.0
    )
    if shape is not None and cfg.dataset_size < cfg.global_batch:
        cfg = cfg.replace(dataset_size=cfg.global_batch)  # token sequences cost nothing
    check(cfg, shape)
    return cfg


def supported(name: str) -> bool:
    """Strategies the dry run runs: those that synchronise every step, one process per rank
    (periodic and asynchronous ones train H steps, or forever, between synchronisations)."""
    s = registry.get(name)
    return s.kind not in ("periodic", "asynchronous") and (s.reference or not s.one_process)


def check(cfg: RunConfig, shape: Transformer | None) -> None:
    """What the dry run refuses before anything runs, with the fix."""
    if not supported(cfg.strategy):
        ok = ", ".join(n for n in registry.STRATEGIES if supported(n))
        raise ValueError(
            f"the dry run runs one step of a strategy that synchronises every step, one process "
            f"per rank: {cfg.strategy} does not; choose one of {ok}"
        )
    if cfg.balance_stages:
        raise ValueError(
            "balance_stages cuts the stages by timing each block, which needs real compute: set "
            "balance_stages=False for a dry run (equal layer counts)"
        )
    if shape is not None and shape.tie and cfg.strategy in registry.STAGED:
        raise ValueError(
            "a tied word embedding sits on the first and the last stage, which labkit's "
            "pipelines do not keep in step: set tie=False"
        )


def ranks_that_differ(cfg: RunConfig, fns: Factories) -> list[tuple[int, str]]:
    """The ranks whose memory or traffic can differ, each with why: every pipeline stage (of
    the first replica); under ZeRO-1 the ranks whose optimizer owns the most and the least (the
    partition ``ZeroRedundancyOptimizer`` makes, by whole tensors); under FSDP the last rank of
    a shard group when a tensor's first dimension does not split evenly (its shard is
    shorter); under context parallelism the ranks holding the first and the last positions (the
    head reads the last); else rank 0, which holds what every rank holds."""
    s, n = registry.get(cfg.strategy), cfg.world_size
    if cfg.strategy in registry.STAGED:  # on a mesh whose first dimension is "pp", stage p is
        stride = n // cfg.stages if s.mesh[:1] == ("pp",) else 1  # rank p * N/P; else rank p
        return [(r * stride, f"stage {r}") for r in range(cfg.stages)]
    if "cp" in s.knobs and n > 1:  # the positions a rank holds: the last ones feed the head
        ring = n if s.kind == "context_parallel" else (cfg.cp or n)
        return [(0, "the first positions"), (ring - 1, "the last positions")]
    if s.zero_stage in (1, 3) and n > 1:
        with torch.device("meta"):
            shapes = [tuple(p.shape) for p in fns.model(cfg).parameters() if p.requires_grad]
        if s.zero_stage == 1:
            parts = [sum(p) for p in zero1_partition([math.prod(x) for x in shapes], n)]
            most, least = parts.index(max(parts)), parts.index(min(parts))
            if parts[most] == parts[least]:
                return [(0, "every rank")]
            return [(most, "owns the most optimizer state"), (least, "owns the least")]
        group = cfg.shard_group if "shard_size" in s.knobs else n
        if any(x and x[0] % group for x in shapes):
            return [(0, "first rank"), (group - 1, "last rank of an uneven split")]
    return [(0, "every rank")]


def dryrun(
    cfg: RunConfig,
    world_size: int | None = None,
    rank: int | list | None = None,
    *,
    shape: Transformer | None = None,
    recipe: str = "labkit",
    optimizer: str | None = None,
    model_fn=None,
    data_fn=None,
    attention: str = "fused",
) -> DryRun:
    """Run one step of ``cfg.strategy`` as ``rank`` of ``world_size`` (default
    ``cfg.world_size``) in this process, on tensors without storage (see the module docstring).
    ``rank``: a rank, a list of them, or None for ``ranks_that_differ``. ``shape``: a language
    model by its shape (else ``cfg.model``, or your ``model_fn`` and ``data_fn``); ``recipe``:
    "labkit" (fp32 weights, autocast by ``cfg.precision``, ``optimizer``) or "paper" (16-bit
    weights, ``MasterAdam``). ``attention``: "fused" (SDPA's choice: a fused kernel that keeps
    no s x s scores) or "math" (SDPA's reference path, which keeps the softmax's output)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    cfg, fns, ranks = _plan(cfg, world_size, rank, shape, recipe, optimizer, model_fn, data_fn)
    runs = [_one_rank(cfg, fns, r, role, attention) for r, role in ranks]
    notes = [storage_less.NOTES[k] for k in _notes_for(cfg)]
    return DryRun(cfg, shape, recipe, runs, notes, fns=fns)


def _plan(cfg, world_size, rank, shape, recipe, optimizer, model_fn=None, data_fn=None):
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)} or None")
    if recipe == "paper" and cfg.precision != "fp32":
        raise ValueError(
            "the paper's recipe trains 16-bit weights already: leave precision='fp32' (autocast "
            "is for fp32 weights)"
        )
    if shape is not None and (model_fn is not None or data_fn is not None):
        raise ValueError("shape builds the model and its data: drop model_fn and data_fn")
    cfg = dry_config(cfg, world_size, shape)
    fns = factories(cfg, shape, recipe, optimizer, model_fn, data_fn)
    if rank is None:
        ranks = ranks_that_differ(cfg, fns)
    else:
        wanted = [rank] if isinstance(rank, int) else list(rank)
        for r in wanted:
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < cfg.world_size:
                raise ValueError(f"rank must be in 0..{cfg.world_size - 1}, got {r!r}")
        ranks = [(r, f"rank {r}") for r in wanted]
    return cfg, fns, ranks


def _notes_for(cfg: RunConfig) -> list[str]:
    s = registry.get(cfg.strategy)
    keys = ["module_to"]
    if s.grad_sync == "buckets" or s.zero_stage in (0, 1) and s.data_parallel:
        keys += ["ddp_verify", "calibration"]
    if s.zero_stage == 3:
        keys.append("fsdp_chunks")
    return keys


def _one_rank(cfg: RunConfig, fns: Factories, rank: int, role: str, attention="fused") -> RankRun:
    """``rank``'s step on tensors without storage, read as a real run reads it."""
    t0 = time.perf_counter()
    reads = 0
    kernel = nullcontext() if attention == "fused" else sdpa_kernel(SDPBackend.MATH)
    try:
        with warnings.catch_warnings(), kernel, storage_less.rank(rank, cfg.world_size) as ctx:
            warnings.simplefilter("ignore")
            wire.count_ops()
            try:
                with storage_less.storage_less() as mode:
                    out = run_rank(ctx, cfg, fns)
                reads = mode.reads
            finally:
                wire.count_ops(False)
    except Exception as exc:  # reported as such, never filled in from a formula
        where = traceback.extract_tb(exc.__traceback__)[-1]
        first = (str(exc).splitlines() or [""])[0]
        error = (
            f"could not run without data: {type(exc).__name__}: {first} "
            f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})"
        )
        return RankRun(rank, role, error=error, seconds=time.perf_counter() - t0)
    return _read(out, rank, role, time.perf_counter() - t0, reads)


def _read(out: dict, rank: int, role: str, seconds: float, reads: int = 0) -> RankRun:
    """The step's record as the tables read it: the meter's columns, the hooks' operations."""
    rec = out["records"][-1]
    memory = {c: int(rec[f"mem_{c}_bytes"]) for c in CATEGORIES}
    ops = [
        {"op": op, "group_size": n, "count": int(calls), "payload_bytes": int(payload),
         "sent_bytes": int(round(sent))}
        for (op, n), (calls, payload, sent) in sorted(rec.get("comm_ops", {}).items())
    ]  # fmt: skip
    return RankRun(rank, role, memory, ops, None, seconds, reads)


# ---- the same step on real ranks -------------------------------------------------------------


def _counted_rank(ctx, cfg: RunConfig, fns: Factories) -> dict:
    """A real rank's step, its collectives tallied by name and group size (``wire.count_ops``)."""
    wire.count_ops()
    try:
        out = run_rank(ctx, cfg, fns)
    finally:
        wire.count_ops(False)
    return {"records": out["records"][-1:]}


def real(
    cfg: RunConfig,
    world_size: int | None = None,
    *,
    shape: Transformer | None = None,
    recipe: str = "labkit",
    optimizer: str | None = None,
    model_fn=None,
    data_fn=None,
) -> DryRun:
    """The dry run's step on ``world_size`` real rank processes (gloo on CPU), read the same
    way, every rank reported: what ``dryrun`` must equal."""
    cfg, fns, _ = _plan(cfg, world_size, 0, shape, recipe, optimizer, model_fn, data_fn)
    t0 = time.perf_counter()
    results = launch(_counted_rank, cfg.world_size, args=(cfg, fns), timeout_s=cfg.timeout_s,
                     device="cpu")  # fmt: skip
    seconds = time.perf_counter() - t0
    runs = [_read(res, r, f"rank {r}", seconds) for r, res in enumerate(results)]
    return DryRun(cfg, shape, recipe, runs, [], kind="real run", fns=fns)


def model_parameters(cfg: RunConfig, fns: Factories) -> nn.Module:
    """The whole model on the meta device (shapes only): what the calculator traces."""
    with torch.device("meta"):
        return fns.model(cfg)


# ---- a layout (the advisor's terms) as a labkit strategy and config -------------------------


def strategy_for_layout(tp: int, pp: int, dp: int, zero: int) -> tuple[str | None, str]:
    """The labkit strategy that runs tensor degree ``tp``, pipeline degree ``pp``, data degree
    ``dp`` and ZeRO stage ``zero`` (found by the registry's properties), or None and why not."""
    rows = registry.STRATEGIES.items()
    if zero == 2:
        return None, "no strategy in torch shards the gradients alone (ZeRO-2)"
    if tp > 1 and pp > 1:  # a mesh with both dimensions (mesh4d: pp, dp, cp, tp)
        name = next((n for n, s in rows if {"tp", "pp"} <= set(s.mesh)), None)
        if name is None or zero:
            return None, "tensor and pipeline parallelism together, with ZeRO: no labkit strategy"
        return name, ""
    if pp > 1:
        if zero:
            return None, f"ZeRO-{zero} with pipeline stages: no labkit strategy shards them"
        kind = "composed" if dp > 1 else "pipeline"
        return next(n for n, s in rows if s.kind == kind and s.schedule == "1f1b"), ""
    if tp > 1:
        if zero == 1:
            return None, "ZeRO-1 with tensor parallelism: no labkit strategy (fsdp_tp is ZeRO-3)"
        if dp == 1:
            if zero:
                return None, "ZeRO shards over data-parallel ranks, and there is one"
            return next(n for n, s in rows if s.kind == "tensor_parallel" and not s.dtensor), ""
        return next(n for n, s in rows if s.kind == "composed" and "tp" in s.knobs
                    and (s.zero_stage or 0) == zero), ""  # fmt: skip
    if dp == 1:
        return (registry.REFERENCE, "") if not zero else (None, "ZeRO needs data parallelism")
    return next(n for n, s in rows if s.data_parallel and s.zero_stage == zero
                and "shard_size" not in s.knobs), ""  # fmt: skip


def layout_config(
    shape: Transformer,
    *,
    tp: int,
    pp: int,
    dp: int,
    zero: int,
    microbatch: int,
    recompute: str,
    global_batch: int,
    sequence_parallel: bool = False,
) -> RunConfig:
    """The RunConfig of a layout: its strategy (``strategy_for_layout``, or a ValueError saying
    why none), ``microbatch`` samples per forward, the rest of each rank's share of
    ``global_batch`` as micro-batches (a pipeline's M, else gradient accumulation), full
    recomputation as per-block checkpointing (labkit's attention keeps no s x s scores: the
    selective policy's memory, whatever ``recompute`` says otherwise)."""
    name, why = strategy_for_layout(tp, pp, dp, zero)
    if name is None:
        raise ValueError(f"tp {tp} x pp {pp} x dp {dp}, ZeRO-{zero}: {why}")
    if global_batch % (dp * microbatch):
        raise ValueError(
            f"a global batch of {global_batch} does not split into micro-batches of {microbatch} "
            f"over {dp} data-parallel ranks: pick a multiple of {dp * microbatch}"
        )
    m = global_batch // (dp * microbatch)
    fields = dict(strategy=name, world_size=tp * pp * dp, global_batch=global_batch,
                  activation_checkpointing=recompute == "full")  # fmt: skip
    if tp > 1:
        fields.update(tp=tp, sequence_parallel=sequence_parallel)
    if pp > 1:
        fields.update(stages=pp, microbatches=m)
    elif m > 1:
        fields.update(accumulate=m)
    return shape.config(**fields)
