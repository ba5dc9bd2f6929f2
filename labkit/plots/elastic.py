"""Figures of an elastic run: world size, loss and throughput over time, with what was done to the
job (a node joining or leaving, a worker killed) marked where it happened."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

EVENT_COLORS = {"join": "#54a24b", "leave": "#f58518", "kill": "#e45756"}


def elastic_timeline(
    steps: pd.DataFrame,
    events: list[dict] | None = None,
    t0: float = 0.0,
    title: str = "an elastic job over time",
) -> go.Figure:
    """Three rows against seconds since the first agent started: world size, the global-batch
    loss and samples/s (one point per step; a step trained twice after a restart shows twice).
    ``events``: ``ElasticJob.events`` (time.time() stamps), drawn as vertical lines."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        subplot_titles=("world size", "loss (global batch)", "samples/s"),
    )
    palette = qualitative.Plotly
    for n, (attempt, g) in enumerate(steps.groupby("attempt", sort=True)):
        label, color = f"attempt {attempt}", palette[n % len(palette)]  # one colour per attempt
        hover = "step %{customdata}<br>%{y}<extra>" + label + "</extra>"
        common = dict(name=label, customdata=g["step"], hovertemplate=hover, legendgroup=label)
        fig.add_trace(
            go.Scatter(
                x=g["time_s"],
                y=g["world_size"],
                mode="markers",
                marker={"size": 4, "color": color},
                **common,
            ),
            1,
            1,
        )
        fig.add_trace(
            go.Scatter(
                x=g["time_s"],
                y=g["loss"],
                mode="lines+markers",
                marker={"size": 3, "color": color},
                line={"color": color},
                showlegend=False,
                **common,
            ),
            2,
            1,
        )
        fig.add_trace(
            go.Scatter(
                x=g["time_s"],
                y=g["samples_per_s"],
                mode="markers",
                marker={"size": 3, "color": color},
                showlegend=False,
                **common,
            ),
            3,
            1,
        )
    for ev in events or []:
        x = ev["time"] - t0
        if ev["event"] == "join" and x <= 0.01:  # the first node: not a change
            continue
        color = EVENT_COLORS.get(ev["event"], "gray")
        fig.add_vline(x=x, line={"dash": "dot", "color": color})  # through every row
        # named once, inside the bottom row: at the top, the names ran over the subplot titles
        fig.add_annotation(
            x=x,
            y=0.02,
            xref="x3",
            yref="y3 domain",
            text=ev["event"],
            showarrow=False,
            textangle=-90,
            xanchor="right",
            yanchor="bottom",
            font={"color": color, "size": 11},
        )
    fig.update_yaxes(dtick=1, rangemode="tozero", row=1, col=1)
    fig.update_xaxes(title_text="seconds since the first agent started", row=3, col=1)
    fig.update_layout(title=title, height=620, margin={"t": 80})
    return fig


def loss_by_step(steps: pd.DataFrame, reference: pd.Series | None = None) -> go.Figure:
    """The loss against the step number, coloured by world size (the last time each step was
    trained), beside a reference curve (e.g. one uninterrupted run): the curves lie on top of
    each other when joins, leaves and restarts changed nothing but the speed."""
    last = steps.drop_duplicates("step", keep="last")
    fig = go.Figure()
    if reference is not None:
        fig.add_trace(
            go.Scatter(
                x=list(reference.index),
                y=list(reference.values),
                mode="lines",
                name="uninterrupted run",
                line={"color": "gray", "width": 4},
                opacity=0.5,
            )
        )
    for ws, g in last.groupby("world_size"):
        fig.add_trace(
            go.Scatter(
                x=g["step"],
                y=g["loss"],
                mode="markers",
                name=f"elastic run, world size {ws}",
                marker={"size": 5},
            )
        )
    fig.update_layout(
        title="the loss curve goes on through every change",
        xaxis_title="optimizer step",
        yaxis_title="loss (global batch)",
        height=380,
    )
    return fig
