"""Figures of the tensor-parallel lab: runs of several layouts side by side, and the layout
advisor's ranked layouts (memory per GPU against the device, predicted step)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots


def layout_runs(table: pd.DataFrame) -> go.Figure:
    """Median step and bytes a rank sends per step, one bar per run (``LayoutPanel.table``)."""
    x = [f"{r}. {lay} {m}" for r, lay, m in zip(table["run"], table["layout"], table["model"])]
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("median step (ms)", "MB sent per rank per step (counted)")
    )
    fig.add_trace(go.Bar(x=x, y=table["step_ms"], marker_color="#4c78a8"), row=1, col=1)
    fig.add_trace(
        go.Bar(x=x, y=table["bytes_sent_per_rank_step"] / 1e6, marker_color="#e45756"),
        row=1,
        col=2,
    )
    fig.update_layout(showlegend=False, height=340, title="Each run, its own bars")
    return fig


def advisor_bars(frame: pd.DataFrame) -> go.Figure:
    """Memory per GPU (with the device's capacity) and predicted step, best layout first."""
    x = [
        f"tp{t} pp{p} dp{d} z{z} mb{m} {r}"
        for t, p, d, z, m, r in zip(
            frame["tp"], frame["pp"], frame["dp"], frame["zero"], frame["microbatch"],
            frame["recompute"],
        )
    ]  # fmt: skip
    colors = ["#54a24b" if f else "#bab0ac" for f in frame["fits"]]
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("memory per GPU (GB)", "predicted step (s)")
    )
    fig.add_trace(
        go.Bar(x=x, y=frame["mem_per_gpu_bytes"] / 1e9, marker_color=colors), row=1, col=1
    )
    if "device_memory_bytes" in frame:
        fig.add_hline(
            y=float(frame["device_memory_bytes"].iloc[0]) / 1e9,
            line_dash="dot",
            annotation_text="usable device memory",
            row=1,
            col=1,
        )
    fig.add_trace(go.Bar(x=x, y=frame["step_s"], marker_color="#4c78a8"), row=1, col=2)
    fig.update_layout(showlegend=False, height=380, title="The advisor's layouts, best first")
    return fig
