"""Pipeline timelines: schedules, the bubble they leave, stage balancing, and their figures.

A pipeline step is a set of events ``{"stage", "microbatch", "kind": "F"|"B", "start", "end"}``
(seconds from the step start). The same functions read measured events (from the pipeline
strategies' records) and theoretical ones (``theoretical_events``), so the notebook can put
what ran beside what the schedule predicts. With P equal stages and M micro-batches, GPipe and
1F1B both leave each stage idle for (P-1)/(M+P-1) of the step (GPipe, Huang et al. 2019,
arXiv:1811.06965; 1F1B from PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): they
differ in how many micro-batches' activations a stage holds at once (M against at most P).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .predict.schedule import (  # noqa: F401 (re-exported)
    ScheduleCosts,
    simulate,
    stage_actions,
)
from .predict.schedule import bubble_per_stage as bubble_fraction
from .probes import sync

if TYPE_CHECKING:
    import plotly.graph_objects as go

SCHEDULES = ("gpipe", "1f1b")
_COLORS = {"F": "#4C78A8", "B": "#F58518"}


# ---- schedules and their theory ----------------------------------------------------------------


def theory_bubble(stages: int, microbatches: int) -> float:
    """Idle share of each stage for P equal stages and M micro-batches: (P-1)/(M+P-1)."""
    return (stages - 1) / (microbatches + stages - 1)


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


# ---- stage balancing ---------------------------------------------------------------------------


def layer_costs(
    model: nn.Sequential, example: torch.Tensor, repeats: int = 5, warmup: int = 2
) -> list[float]:
    """Median forward+backward seconds of each block of ``model`` on the real input shapes."""
    costs, x = [], example.detach()
    for block in model:
        times = []
        for i in range(warmup + repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            sync(inp.device)
            t0 = time.perf_counter()
            out = block(inp)
            out.float().sum().backward()
            sync(inp.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        block.zero_grad(set_to_none=True)
        costs.append(statistics.median(times))
        x = out.detach()
    return costs


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


# ---- figures (returned, never shown; plotly is imported by each, so ranks never load it) ------


def _gantt_traces(events: Sequence[dict], show_legend: bool = True) -> list[go.Bar]:
    import plotly.graph_objects as go  # plotly loads only for figures

    traces = []
    for kind, name in (("F", "forward"), ("B", "backward")):
        evs = [e for e in events if e["kind"] == kind]
        traces.append(
            go.Bar(
                orientation="h",
                name=name,
                legendgroup=kind,
                showlegend=show_legend,
                y=[f"stage {e['stage']}" for e in evs],
                base=[e["start"] for e in evs],
                x=[e["end"] - e["start"] for e in evs],
                text=[str(e["microbatch"]) for e in evs],
                textposition="inside",
                insidetextanchor="middle",
                marker_color=_COLORS[kind],
                hovertemplate=(
                    "%{y} micro-batch %{text}<br>start %{base:.4f}<br>%{x:.4f}<extra></extra>"
                ),
            )
        )
    return traces


def gantt(events: Sequence[dict], title: str = "pipeline timeline", unit: str = "s") -> go.Figure:
    """A Gantt chart of one step's events: one row per stage, micro-batch numbers on the bars."""
    import plotly.graph_objects as go  # plotly loads only for figures

    fig = go.Figure(_gantt_traces(events))
    fig.update_layout(
        title=title,
        barmode="overlay",
        xaxis_title=f"time ({unit})",
        yaxis=dict(autorange="reversed"),
        height=120 + 50 * _n_stages(events),
    )
    return fig


def gantt_vs_theory(
    events: Sequence[dict], schedule: str, stages: int, microbatches: int
) -> go.Figure:
    """One step three ways: measured (top); predicted, i.e. the schedule simulated on this
    step's measured stage times, hand-offs and dispatch; and the closed form's ideal, equal
    stages with the same mean F/B times and free hand-offs."""
    from plotly.subplots import make_subplots

    from .predict.schedule import costs_from_steps, predict_step

    f = [e["end"] - e["start"] for e in events if e["kind"] == "F"] or [1.0]
    b = [e["end"] - e["start"] for e in events if e["kind"] == "B"] or [2.0]
    ideal = theoretical_events(
        schedule, stages, microbatches, statistics.mean(f), statistics.mean(b)
    )
    costs = costs_from_steps([events], stages)
    predicted = predict_step(schedule, microbatches, costs)
    measured = statistics.mean(bubble_fraction(events).values())
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.09,
        subplot_titles=(
            f"measured ({schedule}, P={stages}, M={microbatches}): bubble {measured:.2f}",
            f"predicted from this step's measured costs (hand-off "
            f"{1e3 * max(costs.handoff_s, default=0):.2f} ms, dispatch "
            f"{1e3 * max(costs.gap_s, default=0):.2f} ms; mean costs drawn): expected bubble "
            f"{predicted['bubble']:.2f}",
            f"closed form, equal stages and free hand-offs: (P-1)/(M+P-1) = "
            f"{theory_bubble(stages, microbatches):.2f}",
        ),
    )
    for row, evs in enumerate((events, predicted["events"], ideal), start=1):
        for trace in _gantt_traces(evs, show_legend=row == 1):
            fig.add_trace(trace, row=row, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="seconds from step start", row=3, col=1)
    fig.update_layout(
        barmode="overlay", height=260 + 120 * stages, margin=dict(t=60, b=40, l=70, r=20)
    )
    return fig


def bubble_table(records, min_cpu_share: float | None = 0.9):
    """Per (schedule, M): the bubble measured, predicted and by the closed form (median step;
    with ``min_cpu_share``, only steps where every rank had that share of a core), and the
    prediction's error (median over those steps of predicted minus measured)."""
    import pandas as pd

    from .experiment import bubble_error, step_bubbles

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


def bubble_vs_microbatches(table, stages: int) -> go.Figure:
    """Measured bubble fraction against M (points per schedule) with the theory curve."""
    import plotly.graph_objects as go  # plotly loads only for figures

    fig = go.Figure()
    for schedule, g in table.groupby("schedule"):
        fig.add_trace(
            go.Scatter(
                x=g["microbatches"],
                y=g["bubble_fraction"],
                name=f"{schedule} measured",
                mode="markers+lines",
            )
        )
        if "bubble_predicted" in g:
            fig.add_trace(
                go.Scatter(
                    x=g["microbatches"],
                    y=g["bubble_predicted"],
                    name=f"{schedule} predicted",
                    mode="markers",
                    marker=dict(symbol="x", size=10),
                )
            )
    ms = list(range(1, int(table["microbatches"].max()) + 1))
    fig.add_trace(
        go.Scatter(
            x=ms,
            y=[theory_bubble(stages, m) for m in ms],
            mode="lines",
            name="(P-1)/(M+P-1)",
            line=dict(dash="dash", color="black"),
        )
    )
    fig.update_layout(
        title=f"pipeline bubble at P={stages}",
        xaxis_title="micro-batches M",
        yaxis_title="idle share of the step",
        yaxis_range=[0, 1],
    )
    return fig


def activation_memory(table, column: str = "activations_peak") -> go.Figure:
    """Activations held per stage (micro-batches or bytes), one bar group per schedule."""
    import plotly.graph_objects as go  # plotly loads only for figures

    fig = go.Figure()
    for schedule, g in table.groupby("schedule"):
        fig.add_trace(go.Bar(x=[f"stage {s}" for s in g["stage"]], y=g[column], name=str(schedule)))
    label = "micro-batches held" if column == "activations_peak" else "bytes held"
    fig.update_layout(
        title=f"activation memory per stage ({column})", barmode="group", yaxis_title=label
    )
    return fig


def stage_times(before: Sequence[float], after: Sequence[float]) -> go.Figure:
    """Per-stage cost before and after balancing: the slowest stage sets the pipeline's pace."""
    import plotly.graph_objects as go  # plotly loads only for figures

    fig = go.Figure(
        [
            go.Bar(
                x=[f"stage {i}" for i in range(len(before))], y=before, name="equal layer counts"
            ),
            go.Bar(x=[f"stage {i}" for i in range(len(after))], y=after, name="balanced by cost"),
        ]
    )
    fig.update_layout(title="per-stage compute per step", barmode="group", yaxis_title="seconds")
    return fig


def _n_stages(events: Iterable[dict]) -> int:
    return len({e["stage"] for e in events}) or 1
