"""A run's records: built from what the ranks returned, and read into tables.

A record is one flat dict per (rank, step), made inside the rank (``labkit.rank.recorder``).
``from_ranks`` turns one run's per-rank results into the records labkit shows, the same way
for ``labkit.experiment.run`` and the torchrun worker; everything else here reads them:
``summarize`` (one row per run: the median step, gated by its slowest rank), the labels runs
go by in tables and charts, the pipeline bubble per step, and save/load as JSON. Aggregates are
always computed from the records, never stored beside them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import pandas as pd
import torch

from .config import RunConfig
from .env import resolve_device, threads_per_rank
from .predict.schedule import (
    ScheduleCosts,
    bubble_per_stage,
    costs_from_steps,
    ideal_bubble,
    predict_step,
)
from .rank.probes import TIME_COLUMNS
from .registry import REFERENCE, STRATEGIES, SYNC_ASYNC
from .shares import format_slowdown


def from_ranks(cfg: RunConfig, results: Sequence[dict], oversubscribed: str | None) -> pd.DataFrame:
    """One run's records from its ranks' results (``{"records": [...], "notes": [...]}`` each):
    finalized (below), labelled with the run's variant and whether its ranks outnumbered the
    cores (``oversubscribed``: the sentence saying so, or None). The run's notes, each once, go
    to ``.attrs["notes"]``."""
    records = finalize([rec for res in results for rec in res["records"]])
    records["oversubscribed"] = oversubscribed is not None
    records["variant"] = variant(cfg)
    notes = [oversubscribed] if oversubscribed else []
    for note in [*records.attrs.pop("notes", []), *(n for r in results for n in r["notes"])]:
        if note not in notes:
            notes.append(note)
    records.attrs["notes"] = notes
    return records


def finalize(records: list[dict]) -> pd.DataFrame:
    """One run's per-rank records -> the records labkit shows (the launcher and torchrun alike).

    * ``loss`` is the global batch's loss: the sample-weighted mean of the ranks' shard losses
      (for pipelines, the last stage's, the only one with a loss).
    * At world size 1 nothing is communicated: what the comm phase measured (DDP's reducer, a
      one-rank all-reduce) moves to ``sync_overhead_s``.
    * ``start_s`` is measured from the run's first step; pipeline events from their step's
      earliest start on any rank (one clock for every rank: the shared ``perf_counter``).
    * Pipelines get ``bubble_fraction`` (measured), ``bubble_replay`` (the schedule replayed on
      this very step's measured stage costs and hand-offs: a check that the simulator
      reproduces what ran, not a prediction; ``labkit.labs.pipeline_bubble.bubble_table``
      predicts from other runs) and ``bubble_theory`` (the schedule's order on equal stages
      with free hand-offs, ``labkit.predict.schedule.ideal_bubble``: (P-1)/(M+P-1) for GPipe
      and 1F1B).
    """
    df = pd.DataFrame(records)
    if df.empty:
        return df
    weight = df["samples"].where(df["shard_loss"].notna(), 0)
    num = (df["shard_loss"].fillna(0) * weight).groupby(df["step"]).sum()
    den = weight.groupby(df["step"]).sum()
    df["loss"] = df["step"].map(num / den.where(den > 0))
    alone = df["world_size"] == 1
    df.loc[alone, "sync_overhead_s"] += df.loc[alone, "comm_s"]
    df.loc[alone, "comm_s"] = 0.0
    if "comm_total_s" in df:
        df.loc[alone, "comm_total_s"] = 0.0
    if "events" in df:
        _pipeline_columns(df)
    origin = df["start_s"].min()  # one clock for every rank: the shared perf_counter
    df["start_s"] = df["start_s"] - origin
    if "checkpoint_start_s" in df:
        df["checkpoint_start_s"] = df["checkpoint_start_s"] - origin
    if "comm_spans" in df:  # each collective in flight: (op, start, end, payload bytes)
        df["comm_spans"] = [
            [[op, a - origin, b - origin, n] for op, a, b, n in spans]
            if isinstance(spans, list)
            else []
            for spans in df["comm_spans"]
        ]
    return df


def _pipeline_columns(df: pd.DataFrame) -> None:
    """Per step: every stage's events on one origin; the bubble measured, and replayed by
    simulating the schedule on that step's own measured costs (``labkit.predict.schedule``)."""
    schedule, M = df["schedule"].iloc[0], int(df["microbatches"].iloc[0])
    P = int(df["stages"].iloc[0]) if "stages" in df else int(df["world_size"].iloc[0])
    if "replica" not in df:  # records saved before replicas existed: one pipeline
        df["replica"] = 0
    steps = []
    for col in (
        "span_s",
        "bubble_fraction",
        "bubble_replay",
        "span_replay_s",
        "handoff_s",
        "dispatch_gap_s",
    ):
        df[col] = math.nan
    for _, g in df.groupby(["step", "replica"]):  # each pipeline of each step on its own
        origin = g["start_s"].min()
        for i in g.index:
            df.at[i, "events"] = [
                {**e, "start": e["start"] - origin, "end": e["end"] - origin}
                for e in df.at[i, "events"]
            ]
        events = [e for i in g.index for e in df.at[i, "events"]]
        span = max(e["end"] for e in events) - min(e["start"] for e in events)
        measured = bubble_per_stage(events)  # one formula for both columns
        costs = costs_from_steps([events], P)
        replayed = predict_step(schedule, M, costs)
        for i in g.index:
            s = int(df.at[i, "stage"])
            df.at[i, "span_s"] = span
            df.at[i, "bubble_fraction"] = measured[s]
            df.at[i, "bubble_replay"] = replayed["bubble_per_stage"][s]
            df.at[i, "span_replay_s"] = replayed["span_s"]
            df.at[i, "handoff_s"] = costs.handoff_s[s] if s < P - 1 else math.nan
            df.at[i, "dispatch_gap_s"] = costs.gap_s[s]
        steps.append(events)
    v = int(df["virtual_stages"].iloc[0]) if "virtual_stages" in df else 1
    df["bubble_theory"] = ideal_bubble(schedule, P, M, v)
    df.attrs["notes"] = [n for n in [latency_note(costs_from_steps(steps, P), M)] if n]


def latency_note(costs: ScheduleCosts, microbatches: int) -> str | None:
    """A sentence when hand-offs and dispatch rival a micro-batch's compute, else None."""
    compute = min(f + b for f, b in zip(costs.forward_s, costs.backward_s))
    overhead = max(costs.handoff_s, default=0.0) + max(costs.gap_s, default=0.0)
    if compute <= 0 or overhead < 0.25 * compute:
        return None
    return (
        f"micro-batches are latency-bound: each costs {1e3 * compute:.2f} ms of compute (F+B) "
        f"on its fastest stage, but {1e3 * overhead:.2f} ms of hand-off and dispatch, which "
        f"the closed form counts as zero; the measured bubble sits above it. "
        f"Fewer micro-batches (M={microbatches} now), a larger global batch or a wider "
        f"model give each micro-batch more compute per message"
    )


class LiveLoss:
    """The global-batch loss of the latest step every rank has reported, from progress messages
    (each carries a rank's (step, shard loss, samples) since its last message)."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.seen: dict[int, dict[int, tuple[float, int]]] = {}
        self.latest: tuple[int, float] | None = None

    def update(self, rank: int, metrics: dict) -> tuple[int, float] | None:
        """Feed one rank's progress message; return (step, global loss) or None yet."""
        for step, loss, samples in metrics.get("losses", ()):
            self.seen.setdefault(step, {})[rank] = (loss, samples)
        done = [s for s, got in self.seen.items() if len(got) == self.ranks]
        if done:
            step = max(done)
            pairs = [(v, n) for v, n in self.seen[step].values() if n > 0 and not math.isnan(v)]
            n = sum(n for _, n in pairs)
            if n:
                self.latest = (step, sum(v * n for v, n in pairs) / n)
            self.seen = {s: got for s, got in self.seen.items() if s > step}
        return self.latest


# A rank that got less than this share of a core while computing was descheduled: something
# else ran on its core, and its timings say more about that than about the strategy. Not higher:
# a DDP rank's own gloo threads reduce buckets on the same cores while backward runs, and cost
# it up to a quarter of its core on an idle 2-core machine (0.74-0.98 measured); one other
# busy process per core brings it to about a half, two to a third.
BUSY_SHARE = 0.6


def cpu_share(records: pd.DataFrame) -> float:
    """One run's CPU share: the least any rank got while computing, per step, median over steps
    (NaN where it was not measured). Below ``BUSY_SHARE`` the run is flagged busy."""
    if "compute_cpu_share" not in records:
        return math.nan
    return float(records.groupby("step")["compute_cpu_share"].min().median())


def run_label(strategy: str, world_size: int, threads, variant: str = "") -> str:
    """How a run is named in tables and charts: ``ddp@2``; single says its thread count; a
    load-balancing run its policy and heterogeneity (``ddp_naive@2 dynamic, slow 1:2``)."""
    tail = f" {variant}" if isinstance(variant, str) and variant else ""
    if strategy == REFERENCE:
        return f"{strategy} ({int(threads)} thread{'s' if threads != 1 else ''})" + tail
    return f"{strategy}@{world_size}" + tail


def variant(cfg: RunConfig) -> str:
    """What tells two runs of one strategy and world size apart in a lab: the load-balancing
    policy and the injected heterogeneity; the sync/async lab's period H and staleness-aware lr;
    reduced precision and activation checkpointing; "" for a plain run."""
    knobs = STRATEGIES[cfg.strategy].knobs
    parts = ([f"H={cfg.period}"] if "period" in knobs else []) + (
        ["staleness lr"] if "staleness_lr" in knobs and cfg.staleness_lr else []
    )
    if cfg.balancing:
        policy = [] if cfg.strategy in SYNC_ASYNC else [cfg.rebalance]  # a straggler, no policy
        parts += (
            policy
            + ([f"slow {format_slowdown(cfg.slowdown)}"] if cfg.slowdown else [])
            + ([f"skew {cfg.skew:g}"] if cfg.skew else [])
        )
    parts += [cfg.precision] if cfg.precision != "fp32" else []  # labkit.labs.memory
    parts += ["checkpointed"] if cfg.activation_checkpointing else []
    return ", ".join(parts)


def config_label(cfg: RunConfig) -> str:
    """``run_label`` of a config before it runs (threads resolved as ``run`` will)."""
    kind = resolve_device(cfg.device, cfg.ranks)
    return run_label(
        cfg.strategy, cfg.world_size, cfg.threads or threads_per_rank(cfg.ranks, kind), variant(cfg)
    )


def kept_apart(finished: list[pd.DataFrame]) -> pd.DataFrame:
    """The records of several runs in one table, each run its own: a run whose name repeats an
    earlier one's (the same strategy, world size, threads and variant) gets "repeat 2", "repeat
    3", ... in its variant, so no table or chart pools two runs' steps into one row."""
    seen: dict[tuple, int] = {}
    frames = []
    for df in finished:
        if df.empty:
            continue
        row = df.iloc[0]
        v = row.get("variant", "")
        v = v if isinstance(v, str) else ""
        key = (row["strategy"], int(row["world_size"]), row.get("threads", 1), v)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            df = df.assign(variant=", ".join(filter(None, [v, f"repeat {seen[key]}"])))
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _runs(records: pd.DataFrame):
    keys = ["strategy", "world_size"] + [k for k in ("threads", "variant") if k in records]
    if "variant" in records:
        records = records.assign(variant=records["variant"].fillna(""))
    return records.groupby(keys, sort=False)


def labels(med: pd.DataFrame) -> list[str]:
    variants = med["variant"] if "variant" in med else [""] * len(med)
    return [
        run_label(s, w, t, v)
        for s, w, t, v in zip(med["strategy"], med["world_size"], med["threads"], variants)
    ]


def median_steps(records: pd.DataFrame) -> pd.DataFrame:
    """For each run, the record of the rank that gated its median step.

    A step is gated by its slowest rank (max over ranks of step_s); the median step is the
    step whose gated time is the median (the lower one of an even count, so it is a real step).
    Every table and chart shows this one statistic, so a table's step time is exactly the sum
    of the phases its chart stacks."""
    rows = []
    for _, g in _runs(records):
        slowest = g.loc[g.groupby("step")["step_s"].idxmax()].sort_values("step_s")
        rows.append(slowest.iloc[(len(slowest) - 1) // 2])
    return pd.DataFrame(rows).reset_index(drop=True)


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    """One row per run: the median step (gated by the slowest rank) and what follows from it.

    step_ms, comm_ms: the median step's time and its exposed communication; samples_per_s:
    global batch / step time; speedup_all_cores: over single on all cores (what you get without
    distributing); speedup_same_cores: over single on one rank's share of the cores (threads per
    rank), and efficiency = that / world_size; cpu_share: median over steps of the least CPU
    share any rank got while computing; busy: below ``BUSY_SHARE``, the machine was busy and the
    row is not comparable; loss: the global batch's loss at the last step; bytes_per_sample:
    bytes a rank sends per optimizer step (counted where they travel, ring algorithms:
    ``labkit.wire``) over the samples it trains on in it; comm_total_ms: time any collective
    was in flight; hidden_ms: the part of it not exposed.
    Load-balancing runs add ``throughput``'s whole-run columns
    (throughput_fraction against the sum of the ranks' solo throughputs, wait_share).
    """
    if records.empty:
        return pd.DataFrame()
    if "threads" not in records:
        records = records.assign(threads=1)
    med = median_steps(records)
    table = pd.DataFrame(
        {
            "run": labels(med),
            "strategy": med["strategy"],
            "world_size": med["world_size"].astype(int),
            "threads": med["threads"].astype(int),
            "device": med["device"] if "device" in med else "cpu",
            "step_ms": 1e3 * med["step_s"],
            "samples_per_s": med["global_batch"] / med["step_s"],
            "comm_ms": 1e3 * med["comm_s"],
            "comm_share": med["comm_s"] / med["step_s"],
        }
    )
    if "comm_bytes" in med:  # bytes a rank sends per sample it trains (labkit.wire)
        table["bytes_per_sample"] = (med["comm_bytes"] / med["samples"]).to_numpy()
    if "comm_total_s" in med:  # all communication in flight, and the part not exposed
        table["comm_total_ms"] = (1e3 * med["comm_total_s"]).to_numpy()
        table["hidden_ms"] = (table["comm_total_ms"] - table["comm_ms"]).clip(lower=0)
    runs = _runs(records)
    table["loss"] = [float(g.loc[g["step"] == g["step"].max(), "loss"].iloc[0]) for _, g in runs]
    table["peak_mem_mb"] = [g["peak_mem_bytes"].max() / 2**20 for _, g in runs]
    if "compute_cpu_share" in records:
        table["cpu_share"] = [cpu_share(g) for _, g in runs]
        table["busy"] = table["cpu_share"] < BUSY_SHARE
    single = table[table["strategy"] == REFERENCE].set_index("threads")["samples_per_s"]
    all_cores = single.loc[single.index.max()] if len(single) else math.nan
    table["speedup_all_cores"] = table["samples_per_s"] / all_cores
    table["speedup_same_cores"] = table["samples_per_s"] / table["threads"].map(single)
    table["efficiency"] = table["speedup_same_cores"] / table["world_size"]
    if "bubble_fraction" in records:  # pipelines: the stages' mean idle share, median step
        for col in ("bubble_fraction", "bubble_replay", "bubble_theory"):
            table[col] = [
                step_bubbles(g, column=col).median() if col in g else math.nan for _, g in runs
            ]
    if "share" in records:  # load balancing: against what the ranks could do alone
        lb = pd.DataFrame([throughput(g) if g["share"].notna().any() else {} for _, g in runs])
        for col in lb:
            table[col] = lb[col].to_numpy()
    if "oversubscribed" in records:
        table["oversubscribed"] = [bool(g["oversubscribed"].any()) for _, g in runs]
    return table


def throughput(records) -> dict:
    """One run's throughput against what its ranks could do alone, from its records.

    Over the whole run (dynamic shares adapt during it, so a median step would hide that):
    ``samples_per_s``: samples trained / the steps' gated time (each step ends when its slowest
    rank does); a rank's solo throughput: its samples / its own compute time (its step minus
    its wait and communication: what it does alone); ``ideal_samples_per_s``: the sum of the
    ranks' solo throughputs; ``throughput_fraction``: the first over the second (communication,
    waiting and a rank left idle all lower it); ``wait_share``: of all rank-seconds, the share
    spent waiting at the arrival point."""
    steps = records.groupby("step").agg(samples=("samples", "sum"), step_s=("step_s", "max"))
    own = (
        records["step_s"]
        - records["wait_s"]
        - records["comm_s"]
        - records.get("sync_overhead_s", 0.0)
    )
    per_rank = (
        records.assign(own=own).groupby("rank").agg(samples=("samples", "sum"), own=("own", "sum"))
    )
    measured = steps["samples"].sum() / steps["step_s"].sum()
    ideal = float((per_rank["samples"] / per_rank["own"]).sum())
    return {
        "samples_per_s_run": measured,
        "ideal_samples_per_s": ideal,
        "throughput_fraction": measured / ideal,
        "wait_share": float(records["wait_s"].sum() / records["step_s"].sum()),
    }


def step_bubbles(
    records: pd.DataFrame, min_cpu_share: float | None = None, column: str = "bubble_fraction"
) -> pd.Series:
    """Per step, the stages' mean idle share (measured, or ``column="bubble_replay"``);
    with ``min_cpu_share``, only the steps in which every rank got at least that share of a
    core (the others measured the machine's load)."""
    per_step = records.groupby("step").agg(
        bubble=(column, "mean"), cpu=("compute_cpu_share", "min")
    )
    if min_cpu_share is not None:
        per_step = per_step[per_step["cpu"] >= min_cpu_share]
    return per_step["bubble"]


def phase_breakdown(records: pd.DataFrame) -> pd.DataFrame:
    """Seconds per phase of each run's median step, on the rank that gated it."""
    med = median_steps(records if "threads" in records else records.assign(threads=1))
    med.insert(0, "run", labels(med))
    return med[["run", "strategy", "world_size", *(c for c in TIME_COLUMNS if c in med)]]


# ---- save / load -------------------------------------------------------------------------------


def save_records(records: pd.DataFrame, path: str, **meta) -> None:
    """Write records as JSON: {"meta": {...}, "records": [ {...}, ... ]}."""
    payload = {
        "meta": {**meta, "notes": records.attrs.get("notes", {}), "torch": torch.__version__},
        "records": json.loads(records.to_json(orient="records")),
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def load_records(path: str) -> pd.DataFrame:
    with open(path) as f:
        payload = json.load(f)
    df = pd.DataFrame(payload["records"])
    df.attrs["notes"] = payload.get("meta", {}).get("notes", {})
    return df
