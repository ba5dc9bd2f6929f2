"""Figures of the scheduling lab: JCT distributions, allocation Gantt charts, policy metrics,
and the simulator's prediction beside the real replay."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import plotly.graph_objects as go

COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#eeca3b", "#9d755d")


def _hours(seconds: float, unit: str) -> float:
    return seconds / {"s": 1, "min": 60, "h": 3600}[unit]


def jct_cdf(runs: Mapping, unit: str = "h") -> go.Figure:
    """Share of jobs finished within x (JCT), one line per policy (``sim.compare``'s runs).
    With heavy-tailed jobs the left part (short jobs) is where policies differ most."""
    fig = go.Figure()
    for i, (name, res) in enumerate(runs.items()):
        jct = sorted(_hours(j.jct_s, unit) for j in res.jobs if j.jct_s is not None)
        n = len(jct)
        fig.add_trace(
            go.Scatter(
                x=jct,
                y=[(k + 1) / n for k in range(n)],
                mode="lines",
                name=name,
                line={"color": COLORS[i % len(COLORS)]},
            )
        )
    fig.update_layout(
        title="Job completion time: share of jobs done within x",
        xaxis_title=f"JCT ({unit}, log scale)",
        yaxis_title="share of jobs",
        xaxis_type="log",
        height=340,
    )
    return fig


def policy_bars(
    table: pd.DataFrame, metrics=("mean_jct_s", "p95_jct_s"), unit: str = "h"
) -> go.Figure:
    """Per policy, the chosen JCT metrics side by side (``sim.compare``'s table)."""
    fig = go.Figure()
    for i, m in enumerate(metrics):
        fig.add_trace(
            go.Bar(
                x=table["policy"],
                y=_hours(table[m], unit) if m.endswith("_s") else table[m],  # seconds to unit
                name=m.replace("_s", f" ({unit})").replace("_", " "),
                marker_color=COLORS[i % len(COLORS)],
            )
        )
    fig.update_layout(
        barmode="group",
        title="Policies on the same trace and cluster",
        yaxis_title=unit,
        height=320,
    )
    return fig


def gantt(result, max_jobs: int = 40, unit: str = "h") -> go.Figure:
    """One lane per job (the first ``max_jobs`` by arrival), a bar per allocation segment,
    labelled with its GPUs; the hatched start of a bar is the (re)start cost, spread placements
    drawn lighter. Gaps inside a lane are preemptions."""
    ids = sorted({g["job_id"] for g in result.gantt})[:max_jobs]
    keep = set(ids)
    segs = [g for g in result.gantt if g["job_id"] in keep]
    arrivals = {j.job_id: j.arrival_s for j in result.jobs}
    fig = go.Figure()
    for spread, color in ((False, "#4c78a8"), (True, "#9ecae9")):
        part = [g for g in segs if g["spread"] == spread]
        if not part:
            continue
        fig.add_trace(
            go.Bar(
                base=[_hours(g["start_s"], unit) for g in part],
                x=[_hours(g["end_s"] - g["start_s"], unit) for g in part],
                y=[f"job {g['job_id']}" for g in part],
                orientation="h",
                marker_color=color,
                text=[str(g["gpus"]) for g in part],
                textposition="inside",
                name="spread over nodes" if spread else "on one node",
                hovertext=[
                    f"{g['gpus']} GPU(s) on node(s) "
                    f"{', '.join(f'{n}:{c}' for n, c in g['nodes'])}, priority {g['priority']}"
                    for g in part
                ],
            )
        )
    restarts = [g for g in segs if g["ready_s"] > g["start_s"]]
    if restarts:
        fig.add_trace(
            go.Bar(
                base=[_hours(g["start_s"], unit) for g in restarts],
                x=[_hours(g["ready_s"] - g["start_s"], unit) for g in restarts],
                y=[f"job {g['job_id']}" for g in restarts],
                orientation="h",
                marker={"color": "#e45756", "pattern": {"shape": "/"}},
                name="start-up / restart",
            )
        )
    fig.add_trace(
        go.Scatter(
            x=[_hours(arrivals[i], unit) for i in ids],
            y=[f"job {i}" for i in ids],
            mode="markers",
            name="arrival",
            marker={"symbol": "line-ns-open", "size": 10, "color": "black"},
        )
    )
    fig.update_layout(
        barmode="overlay",
        title=f"Allocations under {result.policy} (bar text: GPUs)",
        xaxis_title=unit,
        yaxis={"autorange": "reversed"},
        height=max(260, 16 * len(ids) + 120),
    )
    return fig


def sim_vs_real(report) -> go.Figure:
    """Mean JCT per policy, simulated (fed with this machine's measured curves and restart
    costs) beside the real replay."""
    t = report.table
    fig = go.Figure(
        [
            go.Bar(x=t["policy"], y=t["sim_mean_jct_s"], name="simulated", marker_color=COLORS[0]),
            go.Bar(
                x=t["policy"],
                y=t["real_mean_jct_s"],
                name="real replay",
                marker_color=COLORS[1],
                text=[f"{e:+.0%}" for e in t["error"]],
                textposition="outside",
            ),
        ]
    )
    fig.update_layout(
        barmode="group",
        title="Mean JCT: simulator vs real replay (label: simulated / real - 1)",
        yaxis_title="seconds",
        height=320,
    )
    return fig


def per_job(report) -> go.Figure:
    """Each job's JCT, simulated against real, one colour per policy; on the diagonal the
    simulator was exact."""
    jobs = report.jobs
    fig = go.Figure()
    for i, (policy, g) in enumerate(jobs.groupby("policy", sort=False)):
        fig.add_trace(
            go.Scatter(
                x=g["real_jct_s"],
                y=g["sim_jct_s"],
                mode="markers",
                name=policy,
                marker={"color": COLORS[i % len(COLORS)], "size": 9},
                text=[f"job {j}" for j in g["job_id"]],
            )
        )
    top = max(jobs["real_jct_s"].max(), jobs["sim_jct_s"].max()) * 1.05
    fig.add_trace(
        go.Scatter(
            x=[0, top],
            y=[0, top],
            mode="lines",
            name="exact",
            line={"dash": "dash", "color": "gray"},
        )
    )
    fig.update_layout(
        title="Per job: simulated vs real JCT",
        xaxis_title="real JCT (s)",
        yaxis_title="simulated JCT (s)",
        height=340,
    )
    return fig
