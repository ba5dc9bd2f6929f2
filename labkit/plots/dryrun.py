"""Figures of the dry run (``labkit.labs.dryrun``, notebook 16): each rank's memory by category
as a stacked bar against the device's memory, the calculator's bar beside it."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

GB = 1e9
COLOURS = {
    "params": "#4c78a8",
    "grads": "#f58518",
    "optimizer": "#54a24b",
    "activations": "#e45756",
    "rest": "#9d755d",
}


def fit_bars(memory: pd.DataFrame, usable_bytes: float | None = None, calculator=None) -> go.Figure:
    """One stacked bar per rank run (``DryRun.memory()``), and the calculator's bar (a row of
    bytes by category, or None) beside them; a line at ``usable_bytes`` (the device's memory
    less what the framework keeps)."""
    ok = memory[memory["error"].isna()] if "error" in memory else memory
    labels = [f"rank {int(r)}<br>{role}" for r, role in zip(ok["rank"], ok["role"])]
    fig = go.Figure()
    for c, colour in COLOURS.items():
        y = list(ok[c] / GB)
        x = list(labels)
        if calculator is not None:
            x.append("calculator")
            y.append(float(calculator.get(c) or 0.0) / GB)
        fig.add_bar(name=c, x=x, y=y, marker_color=colour)
    fig.update_layout(
        barmode="stack",
        title="will it fit? bytes per rank by category (dry run) and the calculator's",
        yaxis_title="GB",
        legend_title="category",
        height=380,
        margin=dict(t=50, b=40, l=50, r=20),
    )
    if usable_bytes:
        fig.add_hline(
            y=usable_bytes / GB,
            line_dash="dash",
            line_color="#b00",
            annotation_text=f"device memory usable: {usable_bytes / GB:.0f} GB",
        )
    return fig


def collectives_table(collectives: pd.DataFrame) -> pd.DataFrame:
    """The collectives of one step as a person reads them: MB handed over and MB put on the
    wire by this rank (ring algorithms), per operation and group size."""
    if collectives.empty:
        return pd.DataFrame(columns=["rank", "op", "group", "count", "payload MB", "sent MB"])
    return pd.DataFrame(
        {
            "rank": collectives["rank"],
            "op": collectives["op"],
            "group": collectives["group_size"],
            "count": collectives["count"],
            "payload MB": (collectives["payload_bytes"] / 1e6).round(2),
            "sent MB": (collectives["sent_bytes"] / 1e6).round(2),
        }
    )
