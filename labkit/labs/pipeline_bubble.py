"""Pipeline timelines: schedules and the bubble they leave (figures: ``labkit.plots.pipeline``;
stage balancing: ``labkit.models.partition``).

A pipeline step is a set of events ``{"stage", "chunk", "microbatch", "kind", "start", "end"}``
(seconds from the step start; ``stage`` is the rank's place in the pipeline, ``chunk`` the model
chunk the action ran, ``kind`` F, B, or a split backward's I and W). The same functions read
measured events (from the pipeline strategies' records) and theoretical ones
(``theoretical_events``, ``schedule_order``), so the notebook can put what ran beside what the
schedule predicts from other runs (``bubble_table``). With P equal stages and M micro-batches,
GPipe and 1F1B both leave each stage idle for (P-1)/(M+P-1) of the step (GPipe, Huang et al.
2019, arXiv:1811.06965; 1F1B from PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503):
they differ in how many micro-batches' activations a stage holds at once (M against at most P).
Interleaving v chunks per rank (Narayanan et al. 2021, arXiv:2104.04473) cuts the idle time
to (P-1)/(v·M) of the ideal; splitting the backward into I and W (Qi et al. 2023,
arXiv:2401.10241) lets W fill it (``labkit.predict.schedule.closed_form``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from .. import experiment
from ..config import RunConfig
from ..models import even_bounds, make_model, split
from ..pipeline_schedules import chunk_rank, chunks_per_rank, implementation, rank_actions
from ..predict.memory import activation_bytes
from ..predict.schedule import (
    ScheduleCosts,
    closed_form,
    costs_at,
    costs_from_steps,
    predict_step,
    simulate,
)
from ..records import step_bubbles
from ..registry import STRATEGIES

SCHEDULES = ("gpipe", "1f1b")  # one chunk per rank (notebook 03)
# several chunks per rank, or a split backward (notebook 05): by strategy name, its schedule
BEYOND_1F1B = ("pipeline_interleaved", "pipeline_zb", "pipeline_zbv", "pipeline_dualpipev")


def theoretical_events(
    schedule: str,
    stages: int,
    microbatches: int,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    latency_s: float = 0.0,
    virtual: int = 1,
) -> list[dict]:
    """The schedule on P identical stages (``labkit.predict.simulate`` with uniform costs; a
    split backward's I and W each half of ``backward_s``)."""
    costs = ScheduleCosts.uniform(stages, forward_s, backward_s, latency_s, virtual=virtual)
    return simulate(schedule, microbatches, costs)


def schedule_order(strategy: str, stages: int = 2, microbatches: int = 4, virtual=None) -> dict:
    """What ``strategy``'s schedule runs, before anything is measured: per rank its actions in
    the order the executor (labkit's, or torch's schedule object) runs them, and the same laid
    out in unit time (a forward 1, a full backward 2, its halves I and W 1 each, hand-offs
    free) as ``events``; ``virtual``: v (default: the schedule's)."""
    schedule = STRATEGIES[strategy].schedule
    v = chunks_per_rank(schedule, virtual)
    M = 1 if schedule == "model_parallel" else microbatches
    actions = {r: rank_actions(schedule, stages, M, r, v) for r in range(stages)}
    costs = ScheduleCosts.uniform(stages, 1.0, 2.0, virtual=v, weight_s=1.0)
    return {
        "strategy": strategy,
        "schedule": schedule,
        "stages": stages,
        "microbatches": M,
        "virtual": v,
        "rank_of": {c: chunk_rank(schedule, stages, c) for c in range(stages * v)},
        "actions": actions,
        "events": simulate(schedule, M, costs),
    }


def executed_orders(records: pd.DataFrame) -> dict[int, list[tuple[str, int, int]]]:
    """Per rank, the actions its last measured step ran, in the order it ran them (the
    events the executor's watch recorded)."""
    last = records[records["step"] == records["step"].max()]
    return {
        int(rec["stage"]): [
            (e["kind"], e["microbatch"], e.get("chunk", e["stage"]))
            for e in sorted(rec["events"], key=lambda e: e["start"])
        ]
        for rec in last.to_dict("records")
    }


def activations_in_flight(events: Sequence[dict], chunk_bytes: dict | None = None) -> dict:
    """Per stage, the most micro-batches forwarded but not yet backwarded at any moment (each
    chunk's counted apart: a micro-batch held by two chunks of one rank counts twice); with
    ``chunk_bytes`` (model chunk -> one micro-batch's activation bytes), the most bytes held.
    A forward's activations are held until the backward that frees them: B, or W (I keeps
    what W needs)."""
    peak: dict[int, float] = {}
    for s in sorted({e["stage"] for e in events}):
        # held from the end of its F to the end of its B or W (ties count it held)
        marks = []
        for e in events:
            if e["stage"] != s or e["kind"] == "I":
                continue
            size = 1 if chunk_bytes is None else chunk_bytes[e.get("chunk", s)]
            marks.append((e["end"], size if e["kind"] == "F" else -size))
        live = best = 0
        for _, d in sorted(marks, key=lambda m: (m[0], -m[1])):
            live += d
            best = max(best, live)
        peak[s] = best
    return peak


def chunk_activation_bytes(cfg: RunConfig, impl: str | None = None) -> dict[int, int]:
    """Model chunk -> the bytes one micro-batch's forward leaves for backward on it, from the
    calculator (``labkit.predict.memory.activation_bytes``, traced on the meta device, apart
    from any run), as the memory meter counts them: a chunk's input, the data or a received
    tensor, is not among them (the meter counts a received input, a leaf that requires grad, as
    ``rest`` beside the data); the last chunk's loss is where the forward computes it (labkit's
    executor; torch's schedule computes it outside ``forward_one_chunk``)."""
    schedule = STRATEGIES[cfg.strategy].schedule
    v = chunks_per_rank(schedule, cfg.virtual_stages)
    model = make_model(cfg)
    bounds = even_bounds(len(model), cfg.stages * v)
    parts = split(model, bounds)
    shape = (cfg.batch_per_rank, cfg.in_features)
    impl = implementation(schedule, impl or cfg.pipeline_impl)
    out = {}
    for c, part in enumerate(parts):
        last = c == len(parts) - 1
        counted = activation_bytes(part, shape, cfg.classes if last else 0)["activations"]
        if not (last and impl == "scratch"):
            counted -= 4 + (shape[0] * cfg.classes * 4 if last else 0)  # no loss in the forward
        out[c] = counted
        shape = (shape[0], part[-1].out_features if hasattr(part[-1], "out_features") else
                 part[-1][0].out_features)  # fmt: skip
    return out


def activation_table(records: pd.DataFrame, cfg: RunConfig) -> pd.DataFrame:
    """Per stage, the activations held at the peak, measured (the memory meter: micro-batch
    chunks held at once, and their bytes) beside the prediction from the schedule's order alone
    (its in-flight count in ``schedule_order``'s unit time: on one rank the actions run one
    after another, so the count depends on the order, not on timing) times each chunk's bytes
    from the calculator (``chunk_activation_bytes``)."""
    order = schedule_order(cfg.strategy, cfg.stages, cfg.microbatches, cfg.virtual_stages)
    per_chunk = chunk_activation_bytes(cfg)
    count = activations_in_flight(order["events"])
    held = activations_in_flight(order["events"], per_chunk)
    measured = records.groupby("stage")[["activations_peak", "activation_bytes_peak"]].max()
    rows = []
    for s, m in measured.iterrows():
        rows.append(
            {
                "strategy": cfg.strategy,
                "stage": int(s),
                "in_flight_measured": int(m["activations_peak"]),
                "in_flight_predicted": int(count[s]),
                "bytes_measured": int(m["activation_bytes_peak"]),
                "bytes_predicted": int(held[s]),
                "bytes_error": int(m["activation_bytes_peak"]) - int(held[s]),
            }
        )
    return pd.DataFrame(rows)


def step_costs(records: pd.DataFrame, min_cpu_share: float | None = 0.9) -> ScheduleCosts:
    """One run's measured costs per micro-batch (each stage's forward and backward, each
    hand-off, each stage's dispatch gap, with every sample), from its steps' events; with
    ``min_cpu_share``, only the steps in which every rank had that share of a core."""
    P = stages(records)
    keep = step_bubbles(records, min_cpu_share).index
    by = ["step", "replica"] if "replica" in records else ["step"]  # each pipeline on its own
    steps = [
        [e for evs in g["events"] for e in evs]
        for key, g in records.groupby(by)
        if (key[0] if isinstance(key, tuple) else key) in keep
    ]
    return costs_from_steps(steps, P)


def stages(records: pd.DataFrame) -> int:
    """P, the pipeline's depth (``world_size`` for records older than the ``stages`` column)."""
    return int(records["stages" if "stages" in records else "world_size"].iloc[0])


def bubble_table(
    records: pd.DataFrame,
    calibration: tuple[int, int] | None = None,
    min_cpu_share: float | None = 0.9,
) -> pd.DataFrame:
    """Per (schedule, v, M): the bubble measured (median over the clean steps: every rank had
    ``min_cpu_share`` of a core), predicted from *other* runs, and by the closed form.

    The prediction is out of sample: the costs measured in the runs at the two ``calibration``
    micro-batch counts (default: each schedule's smallest and largest M) are fitted as lines
    in the micro-batch size (``labkit.predict.schedule.costs_at``), and the schedule is
    simulated on them at every other M. The calibration runs' own rows carry no prediction
    (simulating a run on its own costs would be a replay).

    Two ratios, each as its source writes it: ``bubble_fraction``, ``bubble_predicted`` and
    ``theory`` are idle / step (the share of the step a rank idles); ``idle_over_ideal`` is
    the paper's bubble time / ideal time (the M micro-batches' own compute), measured
    (b / (1 - b)) beside ``closed_form`` ((P-1)/M, (P-1)/(v·M), ...: ``formula``)."""
    rows = []
    if "virtual_stages" not in records:
        records = records.assign(virtual_stages=1)
    for (schedule, v), runs in records.groupby(["schedule", "virtual_stages"]):
        P = stages(runs)
        batch = int(runs["global_batch"].iloc[0]) // int(
            runs.get("replica", pd.Series([0])).max() + 1
        )
        counts = sorted(int(m) for m in runs["microbatches"].unique())
        cal = tuple(calibration or (counts[0], counts[-1]))
        costs = {m: step_costs(runs[runs["microbatches"] == m], min_cpu_share) for m in cal}
        for M in counts:
            g = runs[runs["microbatches"] == M]
            measured = step_bubbles(g, min_cpu_share)
            b = measured.median()
            predicted = math.nan
            if M not in cal and len(counts) > 2:
                predicted = predict_step(schedule, M, costs_at(costs, batch, M))["bubble"]
            form = closed_form(schedule, P, M, int(v))
            rows.append(
                {
                    "schedule": schedule,
                    "virtual_stages": int(v),
                    "microbatches": M,
                    "role": "calibration" if M in cal else "predicted",
                    "bubble_fraction": b,
                    "bubble_predicted": predicted,
                    "error": predicted - b,
                    "theory": form["share"],
                    "idle_over_ideal": b / (1 - b) if b < 1 else math.inf,
                    "closed_form": form["over_ideal"],
                    "formula": form["formula"],
                    "clean_steps": len(measured),
                }
            )
    return pd.DataFrame(rows)


def sweep(base: RunConfig, strategies: Sequence[str], counts: Sequence[int]) -> pd.DataFrame:
    """Every strategy at every micro-batch count, one run each (``base`` otherwise): the
    records ``bubble_table`` reads."""
    runs = [
        experiment.run(base.replace(strategy=s, microbatches=M)).records
        for s in strategies
        for M in counts
    ]
    return pd.concat(runs, ignore_index=True)


# torchtitan's published 3-D run (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md,
# Table 5): Llama 3.1 405B on 512 H100s, FSDP 8 x TP 8 x PP 8, local batch 32, tokens per second
# per GPU by schedule. M = 32 assumes torchtitan's default micro-batch of 1 sample; the page does
# not say how many stages per rank its interleaved run used.
TORCHTITAN_405B = {"stages": 8, "microbatches": 32, "1f1b": 100.0, "interleaved": 128.0}


def against_torchtitan(virtual: Sequence[int] = (2, 4)) -> pd.DataFrame:
    """torchtitan's published gain from interleaving beside what labkit's simulator gives for the
    bubble alone at the same P and M (equal chunks, free hand-offs): the throughput ratio
    (1 - b_interleaved) / (1 - b_1F1B), per v; and the ceiling a bubble of zero would give."""
    P, M = TORCHTITAN_405B["stages"], TORCHTITAN_405B["microbatches"]
    published = TORCHTITAN_405B["interleaved"] / TORCHTITAN_405B["1f1b"]
    one = predict_step("1f1b", M, ScheduleCosts.uniform(P))["bubble"]
    rows = []
    for v in virtual:
        b = predict_step("interleaved", M, ScheduleCosts.uniform(P, virtual=v))["bubble"]
        rows.append({"v": v, "bubble_1f1b": one, "bubble_interleaved": b,
                     "predicted_ratio": (1 - b) / (1 - one), "published_ratio": published,
                     "zero_bubble_ratio": 1 / (1 - one)})  # fmt: skip
    return pd.DataFrame(rows)
