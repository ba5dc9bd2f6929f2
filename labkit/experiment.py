"""Run configs on rank processes and turn their records into tables.

Data flows one way: RunConfig -> ``launch`` -> per-rank records -> a tidy DataFrame (one row per
rank and step) -> ``summarize`` (one row per strategy and world size). Aggregates are always
computed from the records, never stored beside them.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch

from .config import PIPELINE_STRATEGIES, STRATEGY_RANKS, SYNC_ASYNC, RunConfig
from .env import cpu_cores, oversubscription, resolve_device
from .factories import Factories, validate
from .launch import launch
from .predict.schedule import ScheduleCosts, bubble_per_stage, costs_from_steps, predict_step
from .probes import TIME_COLUMNS
from .strategies import run_rank
from .timeline import theory_bubble

Progress = Callable[[int, dict], None]


@dataclass
class RunResult:
    cfg: RunConfig
    records: pd.DataFrame
    params: dict | None  # whole-model parameters (check mode), merged over ranks
    notes: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list, repr=False)  # raw per-rank results


def run(
    cfg: RunConfig,
    *,
    model_fn=None,
    data_fn=None,
    loss_fn=None,
    optimizer_fn=None,
    on_progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> RunResult:
    """Launch ``cfg`` on ``cfg.ranks`` processes and collect what every rank measured.

    Your own ``model_fn``/``data_fn``/``loss_fn``/``optimizer_fn`` (see ``labkit.factories``)
    are checked here, before any rank starts."""
    fns = Factories(model_fn, data_fn, loss_fn, optimizer_fn)
    validate(cfg, fns)
    kind = resolve_device(cfg.device, cfg.ranks)
    threads = cfg.threads or _threads_for(cfg, kind)
    oversub = oversubscription(cfg.ranks, threads) if kind == "cpu" else None
    notes = [oversub] if oversub else []
    results = launch(
        run_rank,
        cfg.ranks,
        args=(cfg, fns),
        timeout_s=cfg.timeout_s,
        device=kind,
        backend=cfg.backend,
        threads=threads,
        on_progress=on_progress,
        cancel=cancel,
    )
    records = finalize([rec for res in results for rec in res["records"]])
    records["oversubscribed"] = oversub is not None
    records["variant"] = variant(cfg)
    notes += records.attrs.pop("notes", [])
    for res in results:
        notes += [n for n in res.get("notes", []) if n not in notes]
    params = None
    if cfg.deterministic:
        params = {}
        for res in results:  # DDP: every rank holds all; pipeline: one stage each
            params.update(res["params"] or {})
    return RunResult(cfg, records, params, notes, results)


def _threads_for(cfg: RunConfig, kind: str) -> int:
    # On CPU the ranks share the cores; a lone process (single, dp) may use all of them, which is
    # the honest baseline: that is what you would do without labkit.
    return max(1, cpu_cores() // cfg.ranks) if kind == "cpu" else 1


def finalize(records: list[dict]) -> pd.DataFrame:
    """One run's per-rank records -> the records labkit shows (the launcher and torchrun alike).

    * ``loss`` is the global batch's loss: the sample-weighted mean of the ranks' shard losses
      (for pipelines, the last stage's, the only one with a loss).
    * At world size 1 nothing is communicated: what the comm phase measured (DDP's reducer, a
      one-rank all-reduce) moves to ``sync_overhead_s``.
    * ``start_s`` is measured from the run's first step; pipeline events from their step's
      earliest start on any rank (one clock for every rank: the shared ``perf_counter``).
    * Pipelines get ``bubble_fraction`` (measured), ``bubble_predicted`` (the schedule simulated
      on this step's measured stage costs and hand-offs) and ``bubble_theory`` ((P-1)/(M+P-1)).
    """
    df = pd.DataFrame(records)
    if df.empty:
        return df
    weight = df["samples"].where(df["shard_loss"].notna(), 0)
    num = (df["shard_loss"].fillna(0) * weight).groupby(df["step"]).sum()
    den = weight.groupby(df["step"]).sum()
    df["loss"] = df["step"].map(num / den.where(den > 0))
    if "sync_overhead_s" not in df:
        df["sync_overhead_s"] = 0.0
    alone = df["world_size"] == 1
    df.loc[alone, "sync_overhead_s"] += df.loc[alone, "comm_s"]
    df.loc[alone, "comm_s"] = 0.0
    if "comm_total_s" in df:
        df.loc[alone, "comm_total_s"] = 0.0
    if "events" in df:
        _pipeline_columns(df)
    df["start_s"] = df["start_s"] - df["start_s"].min()
    return df


def _pipeline_columns(df: pd.DataFrame) -> None:
    """Per step: every stage's events on one origin; the bubble measured, and predicted by
    simulating the schedule on that step's measured costs (``labkit.predict.schedule``)."""
    schedule, M = df["schedule"].iloc[0], int(df["microbatches"].iloc[0])
    P = int(df["world_size"].iloc[0])
    steps = []
    for col in (
        "span_s",
        "bubble_fraction",
        "bubble_predicted",
        "span_predicted_s",
        "handoff_s",
        "dispatch_gap_s",
    ):
        df[col] = math.nan
    for _, g in df.groupby("step"):
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
        predicted = predict_step(schedule, M, costs)
        for i in g.index:
            s = int(df.at[i, "stage"])
            df.at[i, "span_s"] = span
            df.at[i, "bubble_fraction"] = measured[s]
            df.at[i, "bubble_predicted"] = predicted["bubble_per_stage"][s]
            df.at[i, "span_predicted_s"] = predicted["span_s"]
            df.at[i, "handoff_s"] = costs.handoff_s[s] if s < P - 1 else math.nan
            df.at[i, "dispatch_gap_s"] = costs.gap_s[s]
        steps.append(events)
    df["bubble_theory"] = theory_bubble(P, M)
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
        f"the closed form (P-1)/(M+P-1) counts as zero; the measured bubble sits above it. "
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


def grid(base: RunConfig, strategies: Sequence[str], world_sizes: Sequence[int]) -> list[RunConfig]:
    """Configs for every strategy at every world size it can use (single once, at 1; pipeline
    strategies once, at ``stages``); invalid combinations raise with the fix.

    On CPU, ``single`` is also run on one rank's share of the cores for each rank share the
    grid uses (e.g. 1 thread beside ddp@2 on 2 cores): the parallel-efficiency reference, next
    to single on all cores (what you would get without distributing)."""
    configs = []
    for name in strategies:
        if name not in STRATEGY_RANKS:
            raise ValueError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGY_RANKS)}")
        if name == "single":
            sizes = [1]
        elif name in PIPELINE_STRATEGIES:
            sizes = [base.stages]
        else:
            sizes = list(world_sizes)
        configs += [
            (_reference(base) if name == "single" else base.replace(strategy=name, world_size=w))
            for w in sizes
        ]
    if "single" in strategies and resolve_device(base.device, 1) == "cpu" and base.threads is None:
        whole = _threads_for(_reference(base), "cpu")
        shares = sorted({_threads_for(c, "cpu") for c in configs} - {whole})
        at = next(i for i, c in enumerate(configs) if c.strategy == "single") + 1
        configs[at:at] = [configs[at - 1].replace(threads=t) for t in shares]
    return configs


def _reference(base: RunConfig) -> RunConfig:
    """Single-device training on ``base``'s model and batch: never slowed or balanced (those are
    ddp_naive's knobs), the reference the other runs are read against."""
    return base.replace(strategy="single", world_size=1, slowdown=(), skew=0.0, rebalance="static")


def compare(
    configs: Iterable[RunConfig],
    *,
    model_fn=None,
    data_fn=None,
    loss_fn=None,
    optimizer_fn=None,
    on_progress: Callable[[RunConfig, int, dict], None] | None = None,
    on_result: Callable[[RunResult], None] | None = None,
    cancel: threading.Event | None = None,
) -> pd.DataFrame:
    """Run each config in turn; return all records in one DataFrame (notes in ``.attrs``)."""
    results = []
    for cfg in configs:
        cb = None if on_progress is None else (lambda r, m, cfg=cfg: on_progress(cfg, r, m))
        res = run(
            cfg,
            model_fn=model_fn,
            data_fn=data_fn,
            loss_fn=loss_fn,
            optimizer_fn=optimizer_fn,
            on_progress=cb,
            cancel=cancel,
        )
        results.append(res)
        if on_result is not None:
            on_result(res)
    return combine(results)


def combine(results: Sequence[RunResult]) -> pd.DataFrame:
    """Several runs' records in one DataFrame, each run's notes in ``.attrs["notes"]``."""
    df = pd.concat([r.records for r in results], ignore_index=True) if results else pd.DataFrame()
    df.attrs["notes"] = {config_label(r.cfg): r.notes for r in results if r.notes}
    return df


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
    if strategy == "single":
        return f"single ({int(threads)} thread{'s' if threads != 1 else ''})" + tail
    return f"{strategy}@{world_size}" + tail


def variant(cfg: RunConfig) -> str:
    """What tells two runs of one strategy and world size apart in a lab: the load-balancing
    policy and the injected heterogeneity; the sync/async lab's period H and staleness-aware lr;
    reduced precision and activation checkpointing; "" for a plain run."""
    parts = ([f"H={cfg.period}"] if cfg.strategy in ("local_sgd", "diloco") else []) + (
        ["staleness lr"] if cfg.strategy == "async_ps" and cfg.staleness_lr else []
    )
    if cfg.balancing:
        from .balance import format_slowdown

        policy = [] if cfg.strategy in SYNC_ASYNC else [cfg.rebalance]  # a straggler, no policy
        parts += (
            policy
            + ([f"slow {format_slowdown(cfg.slowdown)}"] if cfg.slowdown else [])
            + ([f"skew {cfg.skew:g}"] if cfg.skew else [])
        )
    parts += [cfg.precision] if cfg.precision != "fp32" else []  # labkit.memory
    parts += ["checkpointed"] if cfg.checkpoint else []
    return ", ".join(parts)


def config_label(cfg: RunConfig) -> str:
    """``run_label`` of a config before it runs (threads resolved as ``run`` will)."""
    kind = resolve_device(cfg.device, cfg.ranks)
    return run_label(
        cfg.strategy, cfg.world_size, cfg.threads or _threads_for(cfg, kind), variant(cfg)
    )


def _runs(records: pd.DataFrame):
    keys = ["strategy", "world_size"] + [k for k in ("threads", "variant") if k in records]
    if "variant" in records:
        records = records.assign(variant=records["variant"].fillna(""))
    return records.groupby(keys, sort=False)


def _labels(med: pd.DataFrame) -> list[str]:
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
    gradient bytes a rank all-reduces per optimizer step over the samples it trains on in it;
    comm_total_ms: time any all-reduce was in flight; hidden_ms: the part of it not exposed.
    Load-balancing runs add ``labkit.balance.throughput``'s whole-run columns
    (throughput_fraction against the sum of the ranks' solo throughputs, wait_share).
    """
    if records.empty:
        return pd.DataFrame()
    if "threads" not in records:
        records = records.assign(threads=1)
    med = median_steps(records)
    table = pd.DataFrame(
        {
            "run": _labels(med),
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
    if "comm_bytes" in med:  # gradient payload a rank all-reduces per sample it trains
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
    single = table[table["strategy"] == "single"].set_index("threads")["samples_per_s"]
    all_cores = single.loc[single.index.max()] if len(single) else math.nan
    table["speedup_all_cores"] = table["samples_per_s"] / all_cores
    table["speedup_same_cores"] = table["samples_per_s"] / table["threads"].map(single)
    table["efficiency"] = table["speedup_same_cores"] / table["world_size"]
    if "bubble_fraction" in records:  # pipelines: the stages' mean idle share, median step
        for col in ("bubble_fraction", "bubble_predicted", "bubble_theory"):
            table[col] = [
                step_bubbles(g, column=col).median() if col in g else math.nan for _, g in runs
            ]
    if "share" in records:  # load balancing: against what the ranks could do alone
        from .balance import throughput

        lb = pd.DataFrame([throughput(g) if g["share"].notna().any() else {} for _, g in runs])
        for col in lb:
            table[col] = lb[col].to_numpy()
    if "oversubscribed" in records:
        table["oversubscribed"] = [bool(g["oversubscribed"].any()) for _, g in runs]
    return table


def step_bubbles(
    records: pd.DataFrame, min_cpu_share: float | None = None, column: str = "bubble_fraction"
) -> pd.Series:
    """Per step, the stages' mean idle share (measured, or ``column="bubble_predicted"``);
    with ``min_cpu_share``, only the steps in which every rank got at least that share of a
    core (the others measured the machine's load)."""
    per_step = records.groupby("step").agg(
        bubble=(column, "mean"), cpu=("compute_cpu_share", "min")
    )
    if min_cpu_share is not None:
        per_step = per_step[per_step["cpu"] >= min_cpu_share]
    return per_step["bubble"]


def bubble_error(records: pd.DataFrame, min_cpu_share: float | None = None) -> float:
    """The median over steps of predicted minus measured bubble. Each step is predicted from
    its own measured costs, so the error is read step by step; medians of the two columns taken
    apart would pair one step's prediction with another step's measurement."""
    diff = step_bubbles(records, min_cpu_share, column="bubble_predicted") - step_bubbles(
        records, min_cpu_share
    )
    return float(diff.median()) if len(diff) else math.nan


def phase_breakdown(records: pd.DataFrame) -> pd.DataFrame:
    """Seconds per phase of each run's median step, on the rank that gated it."""
    med = median_steps(records if "threads" in records else records.assign(threads=1))
    med.insert(0, "run", _labels(med))
    return med[["run", "strategy", "world_size", *(c for c in TIME_COLUMNS if c in med)]]


def check(base: RunConfig, strategies: Sequence[str], world_size: int = 2, **kwargs):
    """Same model as single-device training? See ``labkit.equivalence.check``."""
    from .equivalence import check as check_equivalence

    return check_equivalence(base, strategies, world_size, **kwargs)


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
