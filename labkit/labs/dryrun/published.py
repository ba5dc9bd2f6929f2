"""Published figures through the real code: each reproduced by a dry run of labkit's strategies,
beside the figure, with the difference split into named modelling choices (``beside``).

* ``zero_paper``: the ZeRO paper's 7.5B model on 64 GPUs, model states per GPU for the baseline
  and stages 1 to 3 (Rajbhandari et al. 2020, arXiv:1910.02054, Figure 1: 120, 31.4, 16.6 and
  1.9 GB): DDP, ZeRO-1 (``ZeroRedundancyOptimizer``) and FSDP2 run; stage 2 is no strategy
  torch offers, and is reported so.
* ``korthikanti``: activations per transformer layer of GPT-3 175B and MT-NLG 530B at t = 8,
  with and without sequence parallelism, with selective, full or no recomputation (Korthikanti
  et al. 2022, arXiv:2205.05198, Table 2), measured as the difference between a one- and a
  two-layer dry run. labkit's attention is SDPA's fused kernel, which keeps no s x s scores
  (selective recomputation's memory); "no recomputation" runs SDPA's reference path, which on
  CPU keeps its scores in fp32.
* ``sc21``: a layout of Megatron-LM's weak-scaling table (Narayanan et al. 2021,
  arXiv:2104.04473, Table 1) that labkit's strategies compose (tensor x data parallelism, full
  recomputation): memory per GPU against the A100's 80 GB and bytes per step beside the
  advisor. A layout with pipeline stages too (145.6B: t = 8, P = 8) runs as ``mesh4d``; its 96
  micro-batches per step make it a dry run of minutes.
"""

from __future__ import annotations

import pandas as pd

from ... import registry
from ...predict import layout as advisor
from ...predict import memory as calc
from .beside import GATHERED, beside, traffic_beside
from .core import Transformer, dry_config, dryrun, factories, layout_config, ranks_that_differ

GB = 1e9
# untied: labkit's FSDP wraps each block, and FSDP2 refuses a weight shared by two groups
ZERO_7_5B = Transformer(layers=36, hidden=4096, heads=32, seq_len=2048, vocab=51200)
ZERO_FIGURE = {0: 120e9, 1: 31.4e9, 2: 16.6e9, 3: 1.9e9}  # Figure 1, psi = 7.5e9, N = 64, K = 12
GPT3_175B = Transformer(layers=96, hidden=12288, heads=96, seq_len=2048, vocab=51200)
MT_NLG_530B = Transformer(layers=105, hidden=20480, heads=128, seq_len=2048, vocab=51200)
STATE = ("params", "grads", "optimizer")


def strategy_for(zero: int) -> str | None:
    """The strategy that shards what ZeRO's ``zero`` stage shards over all data-parallel ranks
    (one process per rank, no shard groups), or None where torch offers none."""
    for name, s in registry.STRATEGIES.items():
        if s.data_parallel and s.zero_stage == zero and "shard_size" not in s.knobs:
            return name
    return None


def zero_paper(world_size: int = 64, stages=(0, 1, 2, 3)) -> pd.DataFrame:
    """Model states (parameters, gradients, optimizer state) per GPU of the paper's 7.5B model
    on ``world_size`` GPUs in its recipe (16-bit weights and gradients, fp32 master weights and
    Adam's moments), for each ZeRO stage: the published figure, the dry run's fullest rank and
    the named choices between them (the shape holds 7.47e9 parameters where the figure uses
    7.5e9; then ``beside``'s)."""
    shape, rows = ZERO_7_5B, []
    psi = calc.parameters(layers=shape.layers, hidden=shape.hidden, vocab=shape.vocab,
                          seq=shape.seq_len)  # fmt: skip
    for zero in stages:
        name = strategy_for(zero)
        row = {"stage": zero, "strategy": name, "published": ZERO_FIGURE[zero]}
        if name is None:
            rows.append({**row, "error": "no strategy in torch shards the gradients alone "
                                         "(ZeRO-2): FSDP2 shards parameters too"})  # fmt: skip
            continue
        cfg = dry_config(shape.config(strategy=name, world_size=world_size,
                                      global_batch=world_size), shape=shape)  # fmt: skip
        # the figure is the fullest rank's, which ranks_that_differ names first (ZeRO-1's
        # largest partition): only it runs
        first, role = ranks_that_differ(cfg, factories(cfg, shape, "paper", None))[0]
        run = dryrun(cfg, shape=shape, recipe="paper", rank=first)
        run.ranks[0].role = role
        if run.failed:
            rows.append({**row, "error": run.failed[0].error})
            continue
        table = beside(run).set_index("category")
        dry = sum(table.loc[c, "dry_run"] for c in STATE)
        rounding = 16 if zero == 0 else {1: 4 + 12 / world_size, 3: 16 / world_size}[zero]
        exact = sum(calc.model_states(7.5e9, dp=world_size, zero=zero).values())
        named = [("the figure rounds to 3 digits", exact - ZERO_FIGURE[zero]),
                 ("the shape holds 7.47e9 parameters, the figure 7.5e9",
                  rounding * (psi - 7.5e9))]  # fmt: skip
        for c in STATE:  # the figure has no gathered layer: only the calculator adds one
            named += [t for t in table.loc[c, "terms"] if t[0] != GATHERED]
        explained = ZERO_FIGURE[zero] + sum(b for _, b in named)
        rows.append({**row, "rank": table.attrs["role"], "dry_run": dry,
                     "difference": dry - ZERO_FIGURE[zero],
                     "why": "; ".join(f"{n} {b / GB:+.3g} GB" for n, b in named),
                     "residual": dry - explained, "error": None})  # fmt: skip
    return pd.DataFrame(rows)


def korthikanti(
    shape: Transformer = GPT3_175B,
    tp: int = 8,
    sequence_parallel: bool = False,
    recompute: str = "selective",
    micro_batch: int = 1,
) -> dict:
    """Bytes one layer keeps for backward on one GPU, for one micro-batch: the dry run (a
    two-layer minus a one-layer run of ``shape``'s layer under ``tp``), Table 2's formula
    (``predict.memory.layer_activations``), and the named choices between them (see the
    module docstring); ``residual`` is what they leave (LayerNorm and attention statistics)."""
    if recompute not in calc.RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(calc.RECOMPUTE)}")
    held = []
    for layers in (1, 2):
        sh = Transformer(layers, shape.hidden, shape.heads, shape.seq_len, shape.vocab)
        cfg = sh.config(strategy="tp", world_size=tp, global_batch=micro_batch,
                        sequence_parallel=sequence_parallel,
                        activation_checkpointing=recompute == "full")  # fmt: skip
        run = dryrun(cfg, shape=sh, recipe="paper", rank=0,
                     attention="math" if recompute == "none" else "fused")  # fmt: skip
        if run.failed:
            return {"error": run.failed[0].error}
        held.append(run.ranks[0].memory["activations"])
    s, b, h, a, t = shape.seq_len, micro_batch, shape.hidden, shape.heads, tp
    sbh, sp = s * b * h, sequence_parallel
    formula = calc.layer_activations(seq=s, micro_batch=b, hidden=h, heads=a, tp=t,
                                     sequence_parallel=sp, recompute=recompute)  # fmt: skip
    named = []
    if recompute != "full":
        named.append(("no dropout masks after attention and the MLP", -2 * sbh / (t if sp else 1)))
        if sp and t > 1:
            named.append(("the column-parallel layers keep their gathered input",
                          4 * sbh * (1 - 1 / t)))  # fmt: skip
    if recompute == "none":
        named += [
            ("no attention dropout (its mask and output)", -3 * a * s * s * b / t),
            ("SDPA's reference path on CPU keeps the softmax in fp32", 2 * a * s * s * b / t),
            ("and q, k, v in fp32 (the 16-bit qkv output is not kept)", 6 * sbh / t),
        ]  # fmt: skip
    dry = held[1] - held[0]
    explained = formula + sum(x for _, x in named)
    return {"model": str(shape), "tp": t, "sequence_parallel": sp, "recompute": recompute,
            "dry_run": dry, "formula": formula, "difference": dry - formula,
            "why": "; ".join(f"{n} {x / 1e6:+.4g} MB" for n, x in named),
            "explained": explained, "residual": dry - explained}  # fmt: skip


def sc21(name: str = "18.4B", device: str = "A100 80GB") -> dict:
    """One row of Megatron-LM's table run as the dry run of labkit's strategy for its layout
    (full recomputation, the micro-batch the advisor finds fastest for it): memory of the
    fullest GPU against the device's, and bytes per step beside the advisor's terms."""
    row = next((r for r in advisor.SC21 if r.name == name), None)
    if row is None:
        raise ValueError(
            f"no SC'21 row {name!r}: choose one of {', '.join(r.name for r in advisor.SC21)}"
        )
    out = {"model": name, "gpus": row.gpus, "tp": row.tp, "pp": row.pp, "dp": row.dp}
    # tied only without stages: labkit's pipelines do not keep a tied embedding in step
    shape = Transformer(row.layers, row.hidden, row.heads, row.seq, row.vocab, tie=row.pp == 1)
    best = advisor.plan(layers=row.layers, hidden=row.hidden, heads=row.heads, seq=row.seq,
                        vocab=row.vocab, gpus=row.gpus, global_batch=row.global_batch,
                        device=device, tp_choices=[row.tp], pp_choices=[row.pp],
                        zero_stages=(0,), recompute=("full",))[0]  # fmt: skip
    cfg = layout_config(shape, tp=row.tp, pp=row.pp, dp=row.dp, zero=0,
                        microbatch=best.microbatch, recompute="full",
                        global_batch=row.global_batch)  # fmt: skip
    strategy = cfg.strategy
    run = dryrun(cfg, shape=shape, recipe="paper", rank=0)
    if run.failed:
        return {**out, "error": run.failed[0].error}
    table, traffic = beside(run).set_index("category"), traffic_beside(run).set_index("traffic")
    usable = advisor.DEVICES[device].memory_bytes * (1 - advisor.RESERVE)
    return {**out, "strategy": strategy, "microbatch": best.microbatch, "m": best.microbatches,
            "dry_run": table.loc["total", "dry_run"], "calculator": best.mem_per_gpu_bytes,
            "memory_residual": table.loc["total", "residual"], "usable": usable,
            "fits": table.loc["total", "dry_run"] <= usable, "memory": table,
            "traffic": traffic, "error": None}  # fmt: skip
