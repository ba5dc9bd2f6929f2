"""Pipeline timelines: schedules and the bubble they leave (figures: ``labkit.plots.pipeline``;
stage balancing: ``labkit.models.partition``).

A pipeline step is a set of events ``{"stage", "microbatch", "kind": "F"|"B", "start", "end"}``
(seconds from the step start). The same functions read measured events (from the pipeline
strategies' records) and theoretical ones (``theoretical_events``), so the notebook can put
what ran beside what the schedule predicts. With P equal stages and M micro-batches, GPipe and
1F1B both leave each stage idle for (P-1)/(M+P-1) of the step (GPipe, Huang et al. 2019,
arXiv:1811.06965; 1F1B from PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): they
differ in how many micro-batches' activations a stage holds at once (M against at most P).
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from .predict.schedule import ScheduleCosts, simulate, theory_bubble
from .records import bubble_error, step_bubbles

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


def bubble_table(records, min_cpu_share: float | None = 0.9):
    """Per (schedule, M): the bubble measured, predicted and by the closed form (median step;
    with ``min_cpu_share``, only steps where every rank had that share of a core), and the
    prediction's error (median over those steps of predicted minus measured)."""
    rows = []
    for (schedule, M), g in records.groupby(["schedule", "microbatches"]):
        measured = step_bubbles(g, min_cpu_share)
        rows.append(
            {
                "schedule": schedule,
                "microbatches": int(M),
                "bubble_fraction": measured.median(),
                "bubble_predicted": step_bubbles(g, min_cpu_share, "bubble_predicted").median(),
                "error": bubble_error(g, min_cpu_share),
                "theory": theory_bubble(int(g["world_size"].iloc[0]), int(M)),
                "clean_steps": len(measured),
            }
        )
    return pd.DataFrame(rows)
