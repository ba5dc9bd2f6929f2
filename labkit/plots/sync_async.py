"""Figures of the sync/async lab: loss against updates, wall time and bytes; the staleness
distribution; what each mode spent to reach a target loss, with and without a straggler."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .. import registry

AXES = {
    "update": "model updates",
    "time_s": "seconds since the first measured step",
    "bytes": "MB communicated (payload, all ranks)",
    "samples": "samples trained",
}


def loss_curves(curves: pd.DataFrame, x: str = "time_s", target: float | None = None) -> go.Figure:
    """Smoothed training loss of every run (``sync_async.updates``) against ``x``: "update",
    "time_s", "bytes" or "samples". Runs with a straggler are dashed."""
    if x not in AXES:
        raise ValueError(f"x must be one of {', '.join(AXES)}, got {x!r}")
    fig = go.Figure()
    for run, g in curves.groupby("run", sort=False):
        xs = g[x] / 1e6 if x == "bytes" else g[x]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=g["loss_smooth"],
                mode="lines",
                name=run,
                line={
                    "color": registry.get(g["strategy"].iloc[0]).colour,
                    "dash": "dash" if "slow" in run else "solid",
                },
            )
        )
    if target is not None:
        fig.add_hline(
            y=target, line={"dash": "dot", "color": "gray"}, annotation_text=f"target {target:.3f}"
        )
    fig.update_layout(
        title=f"Training loss (smoothed over 4 global batches) against {AXES[x]}",
        xaxis_title=AXES[x],
        yaxis_title="loss",
        height=360,
    )
    return fig


def staleness_histogram(stale: pd.DataFrame) -> go.Figure:
    """Share of updates per staleness (``sync_async.staleness``), one bar group per async run."""
    fig = go.Figure()
    for run, g in stale.groupby("run", sort=False):
        fig.add_trace(
            go.Bar(
                x=g["staleness"],
                y=g["share"],
                name=run,
                hovertext=[f"{c} updates" for c in g["count"]],
            )
        )
    fig.update_layout(
        title="Staleness: how many other updates landed while a gradient was computed",
        xaxis_title="staleness (updates)",
        yaxis_title="share of updates",
        yaxis_tickformat=".0%",
        barmode="group",
        height=320,
    )
    return fig


def to_target_bars(table: pd.DataFrame, column: str = "seconds_to_target") -> go.Figure:
    """One bar per run of ``sync_async.to_target``'s ``column`` (seconds, updates, samples or
    bytes to the target); straggler runs hatched beside their mode's plain run."""
    label = column.replace("_", " ")
    fig = go.Figure(
        go.Bar(
            x=table["run"],
            y=table[column] / (1e6 if "bytes" in column else 1),
            marker_color=[registry.get(s).colour for s in table["strategy"]],
            marker_pattern_shape=["/" if "slow" in r else "" for r in table["run"]],
            text=[
                ("-" if pd.isna(v) else f"{v / 1e6:.1f} MB" if "bytes" in column else f"{v:.3g}")
                for v in table[column]
            ],
            textposition="outside",
        )
    )
    fig.update_layout(
        title=f"{label.capitalize()} (not reached: no bar)",
        yaxis_title=label + (" (MB)" if "bytes" in column else ""),
        height=340,
    )
    return fig
