"""A mixture of experts and expert parallelism (notebook 15): where the router sends the tokens,
how many the capacity drops, what the all-to-alls carry, and one real dispatch drawn.

The block is ``labkit.moe.MoE``, the strategy ``labkit.strategies.ep``; every training run of a
model with MoE blocks records the router's load (``labkit.rank.router_load``: ``expert_routed``,
``expert_dropped`` per block and expert, ``aux_loss_value``), and the tables here read those
records. ``dispatch`` runs one MoE block's all-to-all on gloo ranks that are threads of this
process and reports where each token went: the picture a lesson draws before it measures.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

from .. import experiment, registry
from ..config import RunConfig
from ..dist import on_threads
from ..models import FeedForward
from ..moe import MoE, MoESpec
from ..predict.collectives import coefficients
from ..strategies.ep import owned, spread_experts

COUNT_BYTES = 8  # the counts exchange: one int64 per expert

# ---- one dispatch, drawn from the code that runs it --------------------------------------------


@dataclass
class Dispatch:
    """One MoE block's dispatch on ``world_size`` thread ranks. ``trips``: one row per token and
    choice (its source ``rank``, ``token``, ``choice``, ``expert``, the expert's ``owner``,
    ``kept`` or dropped by the capacity, its ``gate``); ``arrived``: one row per row an expert
    computed (``owner``, ``expert``, and the ``rank`` and ``token`` it came from), in the order
    the expert saw them; ``capacity`` per expert and group (each rank's tokens are one group)."""

    world_size: int
    experts: int
    top_k: int
    capacity: int
    trips: pd.DataFrame
    arrived: pd.DataFrame


def dispatch(
    world_size: int = 2,
    experts: int = 4,
    tokens: int = 8,
    *,
    top_k: int = 1,
    capacity_factor: float = 1.0,
    router_skew: float = 0.0,
    hidden: int = 8,
    seed: int = 0,
) -> Dispatch:
    """Route ``tokens`` tokens per rank through one MoE block whose experts are spread over
    ``world_size`` gloo ranks (threads), by ``labkit.strategies.ep``'s all-to-all; record what
    each rank's router chose and, through a hook on every expert, which rows it computed."""
    if experts % world_size:
        raise ValueError(f"{experts} experts do not split over {world_size} ranks")
    torch.manual_seed(seed)
    spec = MoESpec(experts, top_k, capacity_factor, 0.0, router_skew, groups=1)
    block = MoE(hidden, spec, lambda: FeedForward(hidden))
    xs = torch.randn(world_size, 1, tokens, hidden)

    def rank(group):
        r = group.rank()
        moe = copy.deepcopy(block)
        spread_experts(moe, group)
        seen = []
        for e, expert in moe.experts.items():
            expert.register_forward_pre_hook(lambda m, a, e=int(e): seen.append((e, a[0])))
        with torch.no_grad():
            moe(xs[r])
        return moe.last, seen

    runs = on_threads(rank, world_size)
    where = {  # a row's bytes -> the rank and token it started as (the rows are distinct)
        xs[r, 0, t].numpy().tobytes(): (r, t) for r in range(world_size) for t in range(tokens)
    }
    trips, arrived = [], []
    for r, (last, seen) in enumerate(runs):
        kept = set(zip(last.token.tolist(), last.expert.tolist()))
        gates = dict(zip(zip(last.token.tolist(), last.expert.tolist()), last.gate.tolist()))
        chosen = last.chosen[0].tolist()
        for t in range(tokens):
            for c, e in enumerate(chosen[t]):
                trips.append(
                    {
                        "rank": r,
                        "token": t,
                        "choice": c,
                        "expert": e,
                        "owner": e // (experts // world_size),
                        "kept": (t, e) in kept,
                        "gate": gates.get((t, e), 0.0),
                    }
                )
        for e, rows in seen:
            for row in rows:
                src, t = where[row.numpy().tobytes()]
                arrived.append({"owner": r, "expert": e, "rank": src, "token": t})
    return Dispatch(
        world_size,
        experts,
        top_k,
        runs[0][0].capacity,
        pd.DataFrame(trips),
        pd.DataFrame(arrived, columns=["owner", "expert", "rank", "token"]),
    )


# ---- the router's load, from the records -------------------------------------------------------


def expert_load(records: pd.DataFrame) -> pd.DataFrame:
    """Per run, step, MoE block and expert: assignments ``routed`` to it and ``dropped`` by its
    capacity, summed over the ranks (each routes its own tokens), and ``kept``; ``share``: its
    part of the step's assignments (1/E when the load is even)."""
    rows = []
    for _, rec in _moe_records(records).iterrows():
        for layer, (routed, dropped) in enumerate(zip(rec["expert_routed"], rec["expert_dropped"])):
            for e, (n, d) in enumerate(zip(routed, dropped)):
                rows.append(
                    {
                        "strategy": rec["strategy"],
                        "world_size": int(rec["world_size"]),
                        "run": rec.get("run", ""),
                        "step": int(rec["step"]),
                        "layer": layer,
                        "expert": e,
                        "routed": int(n),
                        "dropped": int(d),
                    }
                )
    keys = ["run", "strategy", "world_size", "step", "layer", "expert"]
    t = pd.DataFrame(rows).groupby(keys, sort=False)[["routed", "dropped"]].sum().reset_index()
    t["kept"] = t["routed"] - t["dropped"]
    t["share"] = t["routed"] / t.groupby(keys[:-1])["routed"].transform("sum")
    return t


def rank_load(records: pd.DataFrame, ep: int | None = None) -> pd.DataFrame:
    """Per run, step, MoE block and rank under expert parallelism: the rows its experts
    computed (the kept assignments of every rank of its group to the experts it owns) and its
    share of them. ``ep``: ranks per group sharing out the experts (None: all of them)."""
    rows = []
    kept = _kept(records)
    for (run, step, r), layers in kept.items():
        w = _world(records, run)
        d = ep or w
        group = range(r // d * d, r // d * d + d)
        mine = owned(r % d, d, len(layers[0]))
        for layer in range(len(layers)):
            computed = sum(kept[(run, step, q)][layer][e] for q in group for e in mine)
            rows.append(
                {"run": run, "world_size": w, "step": step, "layer": layer, "rank": r,
                 "kept": computed}
            )  # fmt: skip
    t = pd.DataFrame(rows).sort_values(["run", "step", "layer", "rank"], kind="stable")
    keys = ["run", "world_size", "step", "layer"]
    t["share"] = t["kept"] / t.groupby(keys, sort=False)["kept"].transform("sum")
    return t.reset_index(drop=True)


def _kept(records: pd.DataFrame) -> dict:
    """(run, step, rank) -> per block, per expert: the kept assignments of that rank's tokens."""
    return {
        (rec["run"], int(rec["step"]), int(rec["rank"])): [
            [a - d for a, d in zip(ro, dr)]
            for ro, dr in zip(rec["expert_routed"], rec["expert_dropped"])
        ]
        for _, rec in _moe_records(records).iterrows()
    }


def _world(records: pd.DataFrame, run: str) -> int:
    recs = _moe_records(records)
    return int(recs.loc[recs["run"] == run, "world_size"].iloc[0])


def imbalance(records: pd.DataFrame) -> pd.DataFrame:
    """Per run and step: the busiest expert's share of the assignments over an even share
    (``max_over_mean``: 1 is even, E is one expert taking everything), the share of assignments
    dropped, and the auxiliary loss (mean over ranks and blocks)."""
    load = expert_load(records)
    keys = ["run", "strategy", "world_size", "step"]
    g = load.groupby(keys, sort=False)
    e = load["expert"].max() + 1
    out = g.agg(routed=("routed", "sum"), dropped=("dropped", "sum")).reset_index()
    out["max_over_mean"] = g["share"].max().to_numpy() * e  # the busiest block's busiest
    out["drop_fraction"] = out["dropped"] / out["routed"]
    aux = _moe_records(records).groupby(["run", "step"], sort=False)["aux_loss_value"].mean()
    out["aux_loss"] = [aux[(r, s)] for r, s in zip(out["run"], out["step"])]
    return out


def _moe_records(records: pd.DataFrame) -> pd.DataFrame:
    if "expert_routed" not in records:
        raise ValueError(
            "these records have no router load: train a model with mixture-of-experts blocks "
            "(model='transformer', experts=E)"
        )
    out = records[records["expert_routed"].map(lambda v: isinstance(v, list))].copy()
    if "run" not in out:
        out["run"] = [f"{s}@{w}" for s, w in zip(out["strategy"], out["world_size"])]
    return out


def drops_compared(single: pd.DataFrame, parallel: pd.DataFrame) -> pd.DataFrame:
    """Per step, block and expert: the assignments single-device training dropped beside those
    the expert-parallel run's ranks dropped together (``same``: equal counts, and equal routed
    counts too)."""
    a, b = expert_load(single), expert_load(parallel)
    keys = ["step", "layer", "expert"]
    m = a[keys + ["routed", "dropped"]].merge(
        b[keys + ["routed", "dropped"]], on=keys, suffixes=("_single", "_parallel")
    )
    m["same"] = (m["dropped_single"] == m["dropped_parallel"]) & (
        m["routed_single"] == m["routed_parallel"]
    )
    return m


# ---- what the all-to-alls carry ----------------------------------------------------------------


def all_to_all_bytes(records: pd.DataFrame, cfg: RunConfig) -> pd.DataFrame:
    """Per step and rank of an expert-parallel run: the bytes handed to the all-to-alls that
    carry rows (``labkit.wire``'s payload, its spans summed, less the counts exchange: E int64
    per block), beside what the router's counts say they must be, and the formula.

    Each MoE block sends rows four times a step: dispatch and combine forward, their gradients
    backward. Dispatch hands in the rank's kept assignments, combine the rows its experts
    computed, the backward ones the same again: ``2 x (sent + computed) x hidden x 4`` bytes
    (float32). ``formula_bytes`` is the issue's rule, ``tokens x hidden x (N-1)/N`` per
    all-to-all with tokens = this rank's b x s x k (no drops, an even router), four per block;
    ``counted_sent_bytes`` is what ``labkit.wire`` counts as sent: (N-1)/N of the payload, the
    same model, so the two differ by the drops and the router's imbalance. With ``cfg.ep`` < N
    the all-to-alls run inside groups of ``ep`` ranks, and N is ``ep`` above."""
    recs = _moe_records(records)
    n = int(recs["world_size"].iloc[0])
    d = cfg.ep or n  # the all-to-alls run inside groups of d ranks
    experts = len(recs["expert_routed"].iloc[0][0])
    h, share = cfg.width, coefficients("all_to_all", d)[1]
    tokens = cfg.batch_per_rank * cfg.seq_len * cfg.top_k
    kept = _kept(recs)
    rows = []
    for _, rec in recs.iterrows():
        run, step, r = rec["run"], int(rec["step"]), int(rec["rank"])
        layers = kept[(run, step, r)]
        group, mine = range(r // d * d, r // d * d + d), owned(r % d, d, experts)
        sent = sum(sum(block) for block in layers)
        computed = sum(
            kept[(run, step, q)][b][e] for q in group for b in range(len(layers)) for e in mine
        )
        spans = [s for s in rec["comm_spans"] if s[0] == "all_to_all"]
        payload = sum(s[3] for s in spans) - len(layers) * experts * COUNT_BYTES
        rows.append(
            {
                "step": step,
                "rank": r,
                "all_to_alls": len(spans),
                "rows_sent": sent,
                "rows_computed": computed,
                "counted_payload_bytes": payload,
                "router_payload_bytes": 2 * (sent + computed) * h * 4,
                "counted_sent_bytes": payload * share,
                "formula_bytes": 4 * len(layers) * tokens * h * 4 * share,
            }
        )
    return pd.DataFrame(rows)


# ---- runs ----------------------------------------------------------------------------------------


def versus_single(cfg: RunConfig, **kwargs) -> dict:
    """``cfg`` (an expert-parallel run) and single-device training of the same model on the same
    batches and token groups, both returning their final parameters: ``max_abs_diff`` over
    every parameter, the drops compared (``drops_compared``) and both runs' records."""
    if registry.get(cfg.strategy).kind != "expert_parallel":
        raise ValueError(f"versus_single compares an expert-parallel run, not {cfg.strategy!r}")
    cfg = cfg.replace(deterministic=True, expert_groups=cfg.token_groups)
    ref = cfg.replace(strategy=registry.REFERENCE, world_size=1)
    a, b = experiment.run(ref, **kwargs), experiment.run(cfg, **kwargs)
    diff = max((a.params[k] - b.params[k]).abs().max().item() for k in a.params)
    if set(a.params) != set(b.params):
        raise AssertionError(f"{cfg.strategy} returned other parameters than single")
    return {
        "max_abs_diff": diff,
        "drops": drops_compared(a.records, b.records),
        "single": a.records,
        "parallel": b.records,
    }


def runs(base: RunConfig, settings: Sequence[dict], on_result=None, cancel=None) -> pd.DataFrame:
    """``base`` run once per setting (changes to it, e.g. ``{"router_skew": 3}``), every run's
    records in one frame, its ``run`` column naming the setting."""
    out = []
    for changes in settings:
        cfg = base.replace(**changes)
        res = experiment.run(cfg, cancel=cancel)
        res.records["run"] = _name(changes)
        out.append(res.records)
        if on_result is not None:
            on_result(res)
    return pd.concat(out, ignore_index=True)


def _name(changes: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "base"


__all__ = [
    "Dispatch",
    "dispatch",
    "expert_load",
    "rank_load",
    "imbalance",
    "drops_compared",
    "all_to_all_bytes",
    "versus_single",
    "runs",
]
