"""Plotly figures from labkit's DataFrames. Functions return figures; callers display them."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from .. import registry
from ..rank.probes import PHASES
from ..records import phase_breakdown, run_label

PHASE_COLORS = {
    "data": "#9e9e9e",
    "forward": "#4c78a8",
    "backward": "#f58518",
    "wait": "#bab0ac",
    "comm": "#e45756",
    "sync_overhead": "#b279a2",
    "optimizer": "#54a24b",
    "other": "#d8d8d8",
}


def throughput(table: pd.DataFrame) -> go.Figure:
    """Samples/s (median step) against world size per strategy; single on all cores as a
    line, and the ideal: single on one rank's share of the cores, times the world size."""
    fig = go.Figure()
    runs = table[table["strategy"] != registry.REFERENCE]
    for strategy, g in runs.groupby("strategy", sort=False):
        g = g.sort_values("world_size")
        fig.add_trace(
            go.Scatter(
                x=g["world_size"],
                y=g["samples_per_s"],
                name=strategy,
                mode="lines+markers",
                text=g["run"],
                line={"color": registry.get(strategy).colour},
            )
        )
    ideal = runs.assign(ideal=runs["samples_per_s"] / runs["efficiency"]).dropna(subset=["ideal"])
    if len(ideal):
        ideal = ideal.groupby("world_size")["ideal"].median()
        fig.add_trace(
            go.Scatter(
                x=list(ideal.index),
                y=list(ideal.values),
                mode="lines",
                name="ideal (single on a rank's cores x world size)",
                line={"dash": "dash", "color": "gray"},
            )
        )
    single = table[table["strategy"] == registry.REFERENCE].sort_values("threads")
    if len(single):
        fig.add_hline(
            y=single["samples_per_s"].iloc[-1],
            line_dash="dot",
            line_color="black",
            annotation_text=single["run"].iloc[-1],
            annotation_position="top left",
        )
    _flags(fig, table)
    fig.update_layout(
        title="Throughput vs world size (median step)",
        xaxis_title="world size",
        yaxis_title="samples / s",
        xaxis={"dtick": 1},
    )
    return fig


def efficiency(table: pd.DataFrame) -> go.Figure:
    """Scaling efficiency (speed-up / world size); 1.0 is perfect scaling."""
    fig = go.Figure()
    for strategy, g in table[table["strategy"] != registry.REFERENCE].groupby(
        "strategy", sort=False
    ):
        g = g.sort_values("world_size")
        fig.add_trace(go.Bar(x=g["run"], y=g["efficiency"], name=strategy))
    fig.add_hline(y=1.0, line_dash="dash", line_color="gray", annotation_text="perfect")
    _flags(fig, table)
    fig.update_layout(
        title="Parallel efficiency (vs single on a rank's share of the cores, / world size)",
        yaxis_title="efficiency",
        yaxis_tickformat=".0%",
        showlegend=False,
    )
    return fig


def breakdown(records: pd.DataFrame) -> go.Figure:
    """Where a step's time goes: each run's median step, on the rank that gated it (the same
    step the tables report, so the stack adds up to their step time)."""
    ph = phase_breakdown(records)
    fig = go.Figure(
        [
            go.Bar(x=ph["run"], y=1e3 * ph[f"{p}_s"], name=p, marker_color=PHASE_COLORS[p])
            for p in PHASES
        ]
    )
    fig.update_layout(
        barmode="stack",
        yaxis_title="ms per step",
        title="Where a step's time goes (median step, slowest rank)",
    )
    return fig


def loss_curves(records: pd.DataFrame) -> go.Figure:
    """The global batch's loss per step for every run: equal runs overlap."""
    fig = go.Figure()
    for label, g in records.groupby(records_label(records), sort=False):
        g = g.groupby("step", sort=True)["loss"].first()
        fig.add_trace(go.Scatter(x=g.index, y=g.values, name=label, mode="lines"))
    fig.update_layout(title="Training loss (global batch)", xaxis_title="step", yaxis_title="loss")
    return fig


def records_label(records: pd.DataFrame) -> pd.Series:
    """Each record's run label (``run_label``)."""
    threads = records["threads"] if "threads" in records else pd.Series(1, index=records.index)
    variants = records["variant"].fillna("") if "variant" in records else [""] * len(records)
    return pd.Series(
        [
            run_label(s, w, t, v)
            for s, w, t, v in zip(records["strategy"], records["world_size"], threads, variants)
        ],
        index=records.index,
    )


def _flags(fig: go.Figure, table: pd.DataFrame) -> None:
    """Say on the chart which runs are oversubscribed or ran on a busy machine."""
    notes = []
    if "oversubscribed" in table and table["oversubscribed"].any():
        sizes = sorted(table.loc[table["oversubscribed"], "world_size"].unique())
        notes.append(
            f"world size {', '.join(map(str, sizes))}: more ranks than cores "
            f"(time-shared, not parallel)"
        )
    if "busy" in table and table["busy"].any():
        notes.append(f"busy machine, not comparable: {', '.join(table.loc[table['busy'], 'run'])}")
    for i, text in enumerate(notes):
        fig.add_annotation(
            text=text,
            showarrow=False,
            xref="paper",
            yref="paper",
            x=0,
            y=1.08 + 0.07 * i,
            font={"color": "#b00"},
        )
