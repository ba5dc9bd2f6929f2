"""The dry run beside the formulas: the calculator's bytes per category and the layout
advisor's bytes per step for the same layout, the difference per row, and the modelling
choices that make it, each named with its size.

For a language model by its shape in the paper's recipe (16-bit weights and gradients, fp32
master weights and Adam's moments) the formulas are ``labkit.predict.memory.transformer_layout``
(Megatron-LM's parameter count, ZeRO's sharding, Korthikanti et al.'s activations) and
``labkit.predict.layout.bytes_per_step`` (the advisor's terms). They describe Megatron-LM's model
on the first pipeline stage; labkit's differs in ways each row names and sizes:

* its word embedding and its own output layer are whole on every tensor-parallel rank
  (Megatron-LM splits the vocabulary and ties the two), and so are LayerNorms and row-parallel
  biases (the formula divides them by t);
* its blocks have no dropout (Korthikanti's 34 s b h counts two 1-byte masks) and attend through
  SDPA's fused kernel, which keeps no s x s scores: it recomputes them in backward, which is what
  selective recomputation does;
* its sequence parallelism keeps each column-parallel layer's all-gathered input for backward
  (Megatron-LM keeps its slice and gathers it again);
* outside the layers it keeps the final LayerNorm's input and output and the 16-bit
  log-probabilities over the vocabulary (not in Korthikanti's Table 2);
* the meter counts what forward leaves for backward, not the layer backward rebuilds under full
  recomputation (which the calculator adds once), nor ZeRO-3's gathered layer (which the
  calculator adds to the parameters); what FSDP still holds gathered when forward ends is under
  ``rest``;
* a pipeline cuts L + 2 blocks (the embedding and the head count as one each) into equal counts;
  FSDP pads each tensor's first dimension to a multiple of its ranks; ZeroRedundancyOptimizer
  owns whole tensors; Adam keeps a 4-byte step per tensor.

What no named choice accounts for is the ``residual``. For labkit's own models under the
data-parallel strategies the calculator is ``labkit.predict.memory.calculate``, which traces the
same model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from ... import registry
from ...models import even_bounds
from ...predict import layout as advisor
from ...predict import memory as calc
from ...predict.collectives import coefficients
from ...predict.memory import CATEGORIES
from .core import DryRun, RankRun, factories, model_parameters

GB = 1e9
STATE = ("params", "grads", "optimizer")
GATHERED = "the calculator's gathered layer (the meter: rest)"
BYTES = {"params": 2, "grads": 2, "optimizer": 12}  # the paper's recipe, per parameter


@dataclass(frozen=True)
class Layout:
    """A dry run's layout in the formulas' terms: tensor, pipeline and data degrees, the ZeRO
    stage and the ranks it shards over, the micro-batch b and m micro-batches per step per
    pipeline, the recomputation policy and the micro-batches a stage holds at once."""

    tp: int
    pp: int
    dp: int
    zero: int
    shard: int
    microbatch: int
    m: int
    recompute: str
    sequence_parallel: bool
    in_flight: int


def layout_of(run: DryRun) -> Layout:
    cfg = run.cfg
    s = registry.get(cfg.strategy)
    tp = cfg.tensor_parallel
    staged = cfg.strategy in registry.STAGED
    pp = cfg.stages if staged else 1
    dp = cfg.world_size // (tp * pp)
    zero = s.zero_stage or 0
    shard = cfg.shard_group if "shard_size" in s.knobs else dp
    m = cfg.microbatches if staged else cfg.accumulate
    in_flight = 1
    if staged:
        in_flight = m if s.schedule in ("gpipe", "model_parallel") else min(pp, m)
    recompute = "full" if cfg.activation_checkpointing else "none"
    return Layout(tp, pp, dp, zero, shard, cfg.batch_per_rank, m, recompute,
                  cfg.sequence_parallel, in_flight)  # fmt: skip


def compared_rank(run: DryRun) -> RankRun:
    """The rank the formulas describe: the first pipeline stage, else the fullest rank."""
    if run.cfg.strategy in registry.STAGED:
        return next(r for r in run.ranks if r.role == "stage 0")
    return run.fullest()


def beside(run: DryRun) -> pd.DataFrame:
    """One row per memory category and the total: the dry run's bytes (``compared_rank``),
    the calculator's, their difference, the named modelling choices (``why``: each with its
    bytes; ``terms``: the same as (name, bytes) pairs), the calculator with them
    (``explained``) and what is left (``residual``)."""
    rank = compared_rank(run)
    if run.shape is not None and run.recipe == "paper":
        formula, named = _transformer_rows(run, rank)
        source = "predict.memory.transformer_layout"
    elif run.shape is None and run.cfg.strategy in calc.STRATEGIES:
        formula, named = _traced_rows(run, rank), {}
        source = "predict.memory.calculate"
    else:  # a language model in labkit's recipe (the formulas are the paper's), or no formula
        formula, named, source = {}, {}, None
    rows = []
    for c in (*CATEGORIES, "total"):
        dry = rank.total if c == "total" else rank.memory[c]
        if c == "total":
            f = sum(formula.values()) if formula else None
            terms = [t for k in CATEGORIES for t in named.get(k, [])]
        else:
            f, terms = formula.get(c), named.get(c, [])
        explained = None if f is None else f + sum(b for _, b in terms)
        rows.append({
            "category": c,
            "dry_run": dry,
            "calculator": f,
            "difference": None if f is None else dry - f,
            "why": "; ".join(f"{name} {b / GB:+.3g} GB" for name, b in terms),
            "terms": terms,
            "explained": explained,
            "residual": None if explained is None else dry - explained,
        })  # fmt: skip
    out = pd.DataFrame(rows)
    out.attrs.update(rank=rank.rank, role=rank.role, source=source)
    return out


def _traced_rows(run: DryRun, rank: RankRun) -> dict:
    """``predict.memory.calculate`` on the same model (traced on the meta device)."""
    cfg = run.cfg
    fns = run.fns or factories(cfg, run.shape, run.recipe, None)
    model = model_parameters(cfg, fns)
    sample = fns.dataset(cfg)[0][0]
    df = calc.calculate(
        model, input_shape=tuple(sample.shape), classes=cfg.classes,
        global_batch=cfg.global_batch, strategy=cfg.strategy, world_size=cfg.world_size,
        precision=cfg.precision, checkpoint=cfg.activation_checkpointing,
        accumulate=cfg.accumulate,
        shard_size=cfg.shard_group if "shard_size" in registry.get(cfg.strategy).knobs else None,
    )  # fmt: skip
    row = df.iloc[rank.rank]
    return {c: float(row[c]) for c in CATEGORIES}


def _transformer_rows(run: DryRun, rank: RankRun) -> tuple[dict, dict]:
    """``transformer_layout`` for the layout, and the named choices per category."""
    shape, lay = run.shape, layout_of(run)
    L, h, a, s, V = shape.layers, shape.hidden, shape.heads, shape.seq_len, shape.vocab
    t, P, z, n = lay.tp, lay.pp, lay.zero, lay.shard
    mem = calc.transformer_layout(
        layers=L, hidden=h, heads=a, seq=s, vocab=V, micro_batch=lay.microbatch, tp=t, pp=P,
        dp=n, zero=z, recompute=lay.recompute, optimizer="adam",
        microbatches_in_flight=lay.in_flight, sequence_parallel=lay.sequence_parallel,
    )  # fmt: skip
    formula = {c: mem[c] for c in STATE} | {"activations": mem["activations"], "rest": 0.0}
    named = {c: [] for c in CATEGORIES}

    # ---- parameters, gradients, optimizer state: what labkit's model holds on this rank
    stage = _stage_layers(L, P)
    per_layer = 12 * h * h + 13 * h
    extra = {
        "the pipeline cuts L + 2 blocks into equal counts": (stage - L // P) * per_layer / t,
        "LayerNorms and row-parallel biases whole on every tp rank": stage * 6 * h * (1 - 1 / t),
        "word embedding whole on every tp rank (Megatron-LM splits the vocabulary)":
            V * h * (1 - 1 / t),
        "an output layer of its own (untied) and the final LayerNorm":
            (0 if shape.tie else V * h) + 2 * h if P == 1 else 0,
    }  # fmt: skip
    for c in STATE:
        divide = n if (z >= 3 or (c == "optimizer" and z >= 1)) else 1
        for name, params in extra.items():
            if params:
                named[c].append((name, BYTES[c] * params / divide))
    tensors = _tensor_shapes(run)
    numels = [math.prod(x) for x in tensors]
    owned = calc.zero1_partition(numels, n)[rank.rank] if z == 1 and n > 1 else numels
    named["optimizer"].append(("Adam's step, 4 bytes per tensor", 4 * len(owned)))
    if z >= 3:
        pad = sum(math.ceil(x[0] / n) * math.prod(x[1:]) for x in tensors)
        pad -= sum(math.prod(x) for x in tensors) / n
        for c in STATE:
            named[c].append(("FSDP pads dim 0 to a multiple of its ranks", BYTES[c] * pad))
        gathered = calc._gathered_layer(h, t, z, n, "paper")
        if gathered:
            named["params"].append((GATHERED, -gathered))
    if z == 1 and n > 1:
        named["optimizer"].append((
            "ZeroRedundancyOptimizer owns whole tensors (this rank's share)",
            BYTES["optimizer"] * (sum(owned) - sum(numels) / n),
        ))  # fmt: skip

    # ---- activations: Korthikanti's layer beside labkit's block, per micro-batch in flight
    sbh, b, sp = s * lay.microbatch * h, lay.microbatch, lay.sequence_parallel
    held = stage * lay.in_flight  # layers' worth of activations held when forward ends
    kept = calc.layer_activations(seq=s, micro_batch=b, hidden=h, heads=a, tp=t,
                                  sequence_parallel=sp, recompute=lay.recompute)  # fmt: skip
    if stage != L // P:
        named["activations"].append(("the pipeline cuts L + 2 blocks into equal counts",
                                     (stage - L // P) * lay.in_flight * kept))  # fmt: skip
    if lay.recompute == "full":
        full = calc.layer_activations(seq=s, micro_batch=b, hidden=h, heads=a, tp=t,
                                      sequence_parallel=sp)  # fmt: skip
        named["activations"].append(("the layer backward rebuilds (not held when forward ends)",
                                     -(full - kept)))  # fmt: skip
    else:
        named["activations"].append(("fused attention keeps no s x s scores (selective)",
                                     -held * 5 * a * s * s * b / t))  # fmt: skip
        named["activations"].append(("no dropout masks", -held * 2 * sbh / (t if sp else 1)))
        if sp and t > 1:
            named["activations"].append((
                "sequence parallelism keeps the gathered input of column-parallel layers",
                held * 4 * sbh * (1 - 1 / t),
            ))  # fmt: skip
    if P == 1:
        head = (2 if lay.recompute == "full" else 4) * sbh + 2 * s * b * V
        named["activations"].append(
            ("the final LayerNorm and the output layer's log-probabilities", head)
        )
    if P == 1:
        named["rest"].append(("the batch: token ids and targets, int64", 16 * s * b))
    else:  # a micro-batch is a view of the pipeline's batch, whose storage the meter weighs
        named["rest"].append(("the first stage's token ids: its whole batch's, int64",
                              8 * s * b * lay.m))  # fmt: skip
    return formula, named


def _stage_layers(layers: int, stages: int) -> int:
    """Transformer layers on the first stage: labkit cuts the L + 2 blocks (embedding, layers,
    head) into equal counts, and the embedding is one of the first stage's."""
    if stages == 1:
        return layers
    bounds = even_bounds(layers + 2, stages)
    return bounds[1] - bounds[0] - 1


def _tensor_shapes(run: DryRun) -> list[tuple]:
    """The shapes of the parameter tensors one rank holds before ZeRO shards them: the first
    stage's, each split by tensor parallelism as labkit's plan splits it (qkv and fc1 by rows,
    proj and fc2 by columns; embeddings, LayerNorms, row-parallel biases and the head whole)."""
    cfg, lay = run.cfg, layout_of(run)
    model = model_parameters(cfg, run.fns or factories(cfg, run.shape, run.recipe, None))
    blocks = list(model)
    if lay.pp > 1:
        bounds = even_bounds(len(blocks), lay.pp)
        blocks = blocks[: bounds[1]]
    shapes, t, seen = [], lay.tp, set()
    for block in blocks:
        for name, p in block.named_parameters():
            if id(p) in seen:  # a tied weight, held once
                continue
            seen.add(id(p))
            shape = list(p.shape)
            leaf = name.rsplit(".", 2)
            if t > 1 and len(leaf) >= 2 and leaf[-2] in ("qkv", "fc1"):
                shape[0] //= t
            elif t > 1 and len(leaf) >= 2 and leaf[-2] in ("proj", "fc2") and leaf[-1] == "weight":
                shape[1] //= t
            shapes.append(tuple(shape))
    return shapes


def traffic_beside(run: DryRun) -> pd.DataFrame:
    """Bytes this rank sent in the step by what they are for (tensor, pipeline and data
    parallelism, told apart by group size and kind) beside the advisor's terms
    (``predict.layout.bytes_per_step``) for a language model by its shape in the paper's recipe;
    the difference, the named choices with their bytes (``why``), and the ``residual``."""
    rank, lay = compared_rank(run), layout_of(run)
    dry = {"tensor": 0, "pipeline": 0, "data": 0}
    for c in rank.collectives:
        if c["op"] in ("send", "recv"):
            dry["pipeline"] += c["sent_bytes"]
        elif c["group_size"] == lay.tp and lay.tp > 1:
            dry["tensor"] += c["sent_bytes"]
        else:
            dry["data"] += c["sent_bytes"]
    formula, named = {}, {k: [] for k in dry}
    if run.shape is not None and run.recipe == "paper":
        formula, named = _traffic_terms(run, rank, lay)
    rows = []
    for k in dry:
        f = formula.get(k)
        explained = None if f is None else f + sum(b for _, b in named[k])
        rows.append({
            "traffic": k, "dry_run": dry[k], "advisor": f,
            "difference": None if f is None else dry[k] - f,
            "why": "; ".join(f"{name} {b / GB:+.3g} GB" for name, b in named[k]),
            "explained": explained, "residual": None if f is None else dry[k] - explained,
        })  # fmt: skip
    out = pd.DataFrame(rows)
    out.attrs.update(rank=rank.rank, role=rank.role, ambiguous=lay.tp > 1 and lay.tp == lay.dp)
    return out


def _traffic_terms(run: DryRun, rank: RankRun, lay: Layout) -> tuple[dict, dict]:
    sh = run.shape
    L, h, s, V, b, m, t, P, n = (sh.layers, sh.hidden, sh.seq_len, sh.vocab, lay.microbatch,
                                 lay.m, lay.tp, lay.pp, lay.dp)  # fmt: skip
    formula = advisor.bytes_per_step(
        layers=L, hidden=h, seq=s, vocab=V, global_batch=run.cfg.global_batch, tp=t, pp=P,
        dp=n, zero=lay.zero, microbatch=b, recompute=lay.recompute,
    )  # fmt: skip
    named = {k: [] for k in formula}
    act, stage = 2 * b * s * h, _stage_layers(L, P)
    ar, ag = coefficients("all_reduce", t)[1], coefficients("all_gather", t)[1]
    if t > 1 and stage != L // P:
        per = (6 if lay.recompute == "full" else 4) * ar * act
        named["tensor"].append(("the pipeline cuts L + 2 blocks into equal counts",
                                (stage - L // P) * m * per))  # fmt: skip
    if t > 1 and lay.recompute == "full":
        named["tensor"].append((
            "torch's checkpoint stops recomputing once backward has what it needs: the MLP's "
            "last all-reduce is not repeated (5 per layer, the advisor counts 6)",
            -stage * m * ar * act,
        ))  # fmt: skip
    if t > 1 and lay.sequence_parallel:
        named["tensor"].append(("the sequence gathered before the head, and the embedding's "
                                "gradient in backward", 2 * m * ag * act))  # fmt: skip
        named["tensor"].append(("LayerNorm and row-parallel bias gradients all-reduced",
                                ar * 2 * 6 * h * stage))  # fmt: skip
    if P > 1:
        first_or_last = rank.rank % P in (0, P - 1)
        sends = (1 if first_or_last else 2) * m * act  # each tp rank its whole activation
        named["pipeline"].append(("a stage sends one message per micro-batch each way, whole "
                                  "on every tp rank (the advisor: 2(m + P - 1) of 1/t, its "
                                  "critical path and Megatron-LM's split)",
                                  sends - formula["pipeline"]))  # fmt: skip
    if n > 1:
        shapes = _tensor_shapes(run)
        numels = [math.prod(x) for x in shapes]
        megatron = calc.stage_parameters(layers=L, hidden=h, vocab=V, seq=s, tp=t, pp=P)
        times = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[lay.zero] * coefficients("all_gather", n)[1]
        named["data"].append(("parameters the formula does not count (rows above)",
                              times * 2 * (sum(numels) - megatron)))  # fmt: skip
        if lay.zero >= 3:
            pad = sum(math.ceil(x[0] / n) * math.prod(x[1:]) for x in shapes) - sum(numels) / n
            named["data"].append(("FSDP pads dim 0 to a multiple of its ranks",
                                  times * 2 * pad * n))  # fmt: skip
        if lay.zero == 1:  # each partition broadcast from its owner, along a chain
            parts = calc.zero1_partition(numels, n)
            after = parts[(rank.rank + 1) % n]  # the chain ends on the rank before the root
            named["data"].append(("ZeroRedundancyOptimizer broadcasts each partition from its "
                                  "owner", 2 * (sum(numels) - sum(after))))  # fmt: skip
    return formula, named
