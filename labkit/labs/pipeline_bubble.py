"""Pipeline timelines: schedules and the bubble they leave (figures: ``labkit.plots.pipeline``;
stage balancing: ``labkit.models.partition``).

A pipeline step is a set of events ``{"stage", "microbatch", "kind": "F"|"B", "start", "end"}``
(seconds from the step start). The same functions read measured events (from the pipeline
strategies' records) and theoretical ones (``theoretical_events``), so the notebook can put
what ran beside what the schedule predicts from other runs (``bubble_table``). With P equal
stages and M micro-batches, GPipe and 1F1B both leave each stage idle for (P-1)/(M+P-1) of the
step (GPipe, Huang et al. 2019, arXiv:1811.06965; 1F1B from PipeDream-Flush, Narayanan et al.
2021, arXiv:2006.09503): they differ in how many micro-batches' activations a stage holds at
once (M against at most P).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd

from ..predict.schedule import (
    ScheduleCosts,
    bubble_over_compute,
    costs_at,
    costs_from_steps,
    predict_step,
    simulate,
    theory_bubble,
)
from ..records import step_bubbles

SCHEDULES = ("gpipe", "1f1b")


def theoretical_events(
    schedule: str,
    stages: int,
    microbatches: int,
    forward_s: float = 1.0,
    backward_s: float = 2.0,
    latency_s: float = 0.0,
) -> list[dict]:
    """The schedule on P identical stages (``labkit.predict.simulate`` with uniform costs)."""
    return simulate(
        schedule, microbatches, ScheduleCosts.uniform(stages, forward_s, backward_s, latency_s)
    )


def activations_in_flight(events: Sequence[dict]) -> dict[int, int]:
    """Per stage, the most micro-batches forwarded but not yet backwarded at any moment."""
    peak: dict[int, int] = {}
    for s in sorted({e["stage"] for e in events}):
        # a micro-batch is held from the end of its F to the end of its B (ties count it held)
        marks = sorted(
            ((e["end"], 1 if e["kind"] == "F" else -1) for e in events if e["stage"] == s),
            key=lambda m: (m[0], -m[1]),
        )
        live = best = 0
        for _, d in marks:
            live += d
            best = max(best, live)
        peak[s] = best
    return peak


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
    """Per (schedule, M): the bubble measured (median over the clean steps: every rank had
    ``min_cpu_share`` of a core), predicted from *other* runs, and by the two closed forms.

    The prediction is out of sample: the costs measured in the runs at the two ``calibration``
    micro-batch counts (default: each schedule's smallest and largest M) are fitted as lines
    in the micro-batch size (``labkit.predict.schedule.costs_at``), and the schedule is
    simulated on them at every other M. The calibration runs' own rows carry no prediction
    (simulating a run on its own costs would be a replay)."""
    rows = []
    for schedule, runs in records.groupby("schedule"):
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
            predicted = math.nan
            if M not in cal and len(counts) > 2:
                predicted = predict_step(schedule, M, costs_at(costs, batch, M))["bubble"]
            rows.append(
                {
                    "schedule": schedule,
                    "microbatches": M,
                    "role": "calibration" if M in cal else "predicted",
                    "bubble_fraction": measured.median(),
                    "bubble_predicted": predicted,
                    "error": predicted - measured.median(),
                    "theory": theory_bubble(P, M),
                    "idle_over_compute": bubble_over_compute(P, M),
                    "clean_steps": len(measured),
                }
            )
    return pd.DataFrame(rows)
