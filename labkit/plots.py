"""Plotly figures from labkit's DataFrames. Functions return figures; callers display them."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .experiment import phase_breakdown
from .probes import PHASES

PHASE_COLORS = {"data": "#9e9e9e", "forward": "#4c78a8", "backward": "#f58518",
                "comm": "#e45756", "optimizer": "#54a24b"}


def throughput(table: pd.DataFrame) -> go.Figure:
    """Samples/s against world size per strategy, with ideal linear scaling from single."""
    fig = go.Figure()
    for strategy, g in table.groupby("strategy", sort=False):
        g = g.sort_values("world_size")
        fig.add_trace(go.Scatter(x=g["world_size"], y=g["samples_per_s"], name=strategy,
                                 mode="lines+markers"))
    single = table.loc[table["strategy"] == "single", "samples_per_s"]
    if len(single):
        sizes = sorted(table["world_size"].unique())
        fig.add_trace(go.Scatter(x=sizes, y=[single.iloc[0] * w for w in sizes], name="ideal",
                                 mode="lines", line={"dash": "dash", "color": "gray"}))
    _oversubscribed_note(fig, table)
    fig.update_layout(title="Throughput vs world size", xaxis_title="world size",
                      yaxis_title="samples / s", xaxis={"dtick": 1})
    return fig


def efficiency(table: pd.DataFrame) -> go.Figure:
    """Scaling efficiency (speed-up / world size); 1.0 is perfect scaling."""
    fig = go.Figure()
    for strategy, g in table[table["strategy"] != "single"].groupby("strategy", sort=False):
        g = g.sort_values("world_size")
        fig.add_trace(go.Bar(x=[f"{strategy} @{w}" for w in g["world_size"]], y=g["efficiency"],
                             name=strategy))
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray", annotation_text="perfect")
    fig.update_layout(title="Scaling efficiency (speed-up over single / world size)",
                      yaxis_title="efficiency", showlegend=False)
    return fig


def breakdown(records: pd.DataFrame) -> go.Figure:
    """Stacked mean time per phase for every (strategy, world size): where a step goes."""
    ph = phase_breakdown(records)
    labels = [f"{s} @{w}" for s, w in zip(ph["strategy"], ph["world_size"])]
    fig = go.Figure([go.Bar(x=labels, y=1e3 * ph[f"{p}_s"], name=p,
                            marker_color=PHASE_COLORS[p]) for p in PHASES])
    fig.update_layout(barmode="stack", title="Where a step's time goes (mean over ranks and steps)",
                      yaxis_title="ms per step")
    return fig


def loss_curves(records: pd.DataFrame) -> go.Figure:
    """Loss per step (rank 0's view) for every run: equal runs should overlap."""
    fig = go.Figure()
    for (strategy, w), g in records.groupby(["strategy", "world_size"], sort=False):
        g = g[g["rank"] == g["rank"].max()].sort_values("step")   # last rank: pipelines' loss
        fig.add_trace(go.Scatter(x=g["step"], y=g["loss"], name=f"{strategy} @{w}",
                                 mode="lines"))
    fig.update_layout(title="Training loss", xaxis_title="step", yaxis_title="loss")
    return fig


def _oversubscribed_note(fig: go.Figure, table: pd.DataFrame) -> None:
    if "oversubscribed" in table and table["oversubscribed"].any():
        sizes = sorted(table.loc[table["oversubscribed"], "world_size"].unique())
        fig.add_annotation(text=f"world size {', '.join(map(str, sizes))}: more ranks than cores "
                                f"(time-shared, not parallel)", showarrow=False, xref="paper",
                           yref="paper", x=0, y=1.08, font={"color": "#b00"})
