"""Figures of the memory lab: bytes per rank by category, counted and calculated, and the loss
curves of fp32 against bf16/fp16."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ..predict.memory import CATEGORIES

COLORS = {
    "params": "#4c78a8",
    "grads": "#f58518",
    "optimizer": "#54a24b",
    "activations": "#e45756",
    "rest": "#9e9e9e",
}
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _unit(largest: float) -> str:
    return next(u for u in ("GiB", "MiB", "KiB", "B") if largest >= UNITS[u] or u == "B")


def by_rank(table: pd.DataFrame, title: str = "Memory per rank by category (counted)") -> go.Figure:
    """Stacked bars, one per (run, rank), from ``labkit.labs.memory.memory_table`` (MiB columns)."""
    x = [f"{r} · rank {k}" for r, k in zip(table["run"], table["rank"])]
    fig = go.Figure()
    largest = float(table[[f"{c}_mib" for c in CATEGORIES]].sum(axis=1).max()) * 2**20
    unit = _unit(largest)
    for c in CATEGORIES:
        fig.add_trace(
            go.Bar(x=x, y=table[f"{c}_mib"] * 2**20 / UNITS[unit], name=c, marker_color=COLORS[c])
        )
    fig.update_layout(barmode="stack", title=title, yaxis_title=unit, height=380)
    return fig


def calculated(df: pd.DataFrame, title: str, counted: pd.DataFrame | None = None) -> go.Figure:
    """The calculator's stacked bar per rank; with ``counted`` (``calculator_error`` rows),
    a black tick per rank at the counted total."""
    largest = float(df[list(CATEGORIES)].sum(axis=1).max())
    unit = _unit(largest)
    x = [f"rank {r}" for r in df["rank"]]
    fig = go.Figure()
    for c in CATEGORIES:
        fig.add_trace(go.Bar(x=x, y=df[c] / UNITS[unit], name=c, marker_color=COLORS[c]))
    if counted is not None:
        tot = counted.groupby("rank")["counted"].sum()
        fig.add_trace(
            go.Scatter(
                x=[f"rank {r}" for r in tot.index],
                y=tot / UNITS[unit],
                mode="markers",
                name="counted (measured)",
                marker={"symbol": "line-ew-open", "size": 40, "color": "black"},
            )
        )
    fig.update_layout(barmode="stack", title=title, yaxis_title=unit, height=340)
    return fig


def loss_curves(records: pd.DataFrame) -> go.Figure:
    """The global-batch loss per step, one line per precision."""
    fig = go.Figure()
    for prec, g in records.groupby("precision", sort=False):
        g = g.groupby("step")["loss"].first()
        fig.add_trace(go.Scatter(x=g.index, y=g.values, mode="lines+markers", name=prec))
    fig.update_layout(
        title="Loss per step: fp32 against reduced precision",
        xaxis_title="step",
        yaxis_title="loss (global batch)",
        height=320,
    )
    return fig
