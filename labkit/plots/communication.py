"""Figures of the communication lab (notebook 06): bandwidth curves, knobs, what-if scaling."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ..predict.collectives import AlphaBeta, bus_factor

OP_COLORS = {
    "all_reduce": "#4c78a8",
    "all_gather": "#f58518",
    "reduce_scatter": "#54a24b",
    "broadcast": "#b279a2",
}


def bandwidth(
    table: pd.DataFrame, ceilings: dict | None = None, fits: dict[str, AlphaBeta] | None = None
) -> go.Figure:
    """Measured busbw against message size per op (p10-p90 as error bars), the alpha-beta fit as
    a dashed line, and this machine's ceilings (measured in the same run) as horizontal lines."""
    fig = go.Figure()
    for op, g in table.groupby("op", sort=False):
        g = g.sort_values("bytes")
        factor = g["busbw"] / g["algbw"]
        lo = g["bytes"] / g["p90_s"] / 1e9 * factor  # slowest repeats: lowest bandwidth
        hi = g["bytes"] / g["p10_s"] / 1e9 * factor
        color = OP_COLORS.get(op)
        fig.add_trace(
            go.Scatter(
                x=g["bytes"],
                y=g["busbw"],
                name=f"{op} (measured)",
                mode="lines+markers",
                line={"color": color},
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": hi - g["busbw"],
                    "arrayminus": g["busbw"] - lo,
                    "thickness": 1,
                },
            )
        )
        if fits and op in fits:
            n = int(g["world_size"].iloc[0])
            model = [fits[op].time(op, s, n) for s in g["bytes"]]
            fig.add_trace(
                go.Scatter(
                    x=g["bytes"],
                    y=[s / t / 1e9 * bus_factor(op, n) for s, t in zip(g["bytes"], model)],
                    name=f"{op} (alpha-beta fit)",
                    mode="lines",
                    line={"color": color, "dash": "dash"},
                )
            )
    span = [table["bytes"].min(), table["bytes"].max()] if len(table) else [1, 2]
    for name, gbps in (ceilings or {}).items():  # traces, not add_hline: on a log axis a line's
        fig.add_trace(  # annotation is placed in log10 units and stretched the axis to 10^32
            go.Scatter(
                x=span,
                y=[gbps, gbps],
                mode="lines",
                name=f"ceiling: {name} {gbps:.1f} GB/s",
                line={"color": "gray", "dash": "dot"},
            )
        )
    n = int(table["world_size"].iloc[0]) if len(table) else 0
    backend = table["backend"].iloc[0] if len(table) else ""
    fig.update_layout(
        title=f"Bus bandwidth vs message size ({n} ranks, {backend})",
        xaxis={"type": "log", "title": "message size (bytes)"},
        yaxis={"type": "log", "title": "busbw (GB/s)"},
    )
    return fig


def knobs(table: pd.DataFrame) -> go.Figure:
    """Per configuration: the step split into compute, exposed and hidden communication (ms),
    and the payload bytes per training sample on a second axis."""
    fig = go.Figure()
    x = table["config"]
    fig.add_trace(go.Bar(x=x, y=table["compute_ms"], name="compute + rest", marker_color="#4c78a8"))
    fig.add_trace(go.Bar(x=x, y=table["comm_ms"], name="exposed comm", marker_color="#e45756"))
    if "predicted_step_ms" in table:
        fig.add_trace(
            go.Scatter(
                x=x,
                y=table["predicted_step_ms"],
                name="predicted step",
                mode="markers",
                marker={"symbol": "diamond", "size": 11, "color": "black"},
            )
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=table["bytes_per_sample"],
            name="bytes / sample",
            yaxis="y2",
            mode="lines+markers",
            line={"color": "#f58518"},
        )
    )
    fig.update_layout(
        barmode="stack",
        title="DDP's knobs: step time and bytes per sample",
        yaxis={"title": "ms per optimizer step (median)"},
        yaxis2={
            "title": "bytes sent per sample (counted)",
            "overlaying": "y",
            "side": "right",
            "type": "log",
            "tickformat": "~s",  # 10k, 100k: not "10.12492k"
            "exponentformat": "SI",
        },
        xaxis={"tickangle": -30, "automargin": True},
        # the legend above the plot: below it, it ran into the configurations' long labels
        legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
        margin={"t": 90},
    )
    return fig


def whatif(rows: pd.DataFrame, metric: str = "efficiency") -> go.Figure:
    """Predicted scaling per (device, interconnect) against world size (log x)."""
    fig = go.Figure()
    for name, g in rows.groupby("scenario", sort=False):
        fig.add_trace(go.Scatter(x=g["world_size"], y=g[metric], name=name, mode="lines+markers"))
    titles = {
        "efficiency": "scaling efficiency (1 = perfect)",
        "step_ms": "step time (ms)",
        "samples_per_s": "samples / s",
    }
    sizes = sorted(rows["world_size"].unique())
    fig.update_layout(
        title=f"What if: predicted {titles.get(metric, metric)}",
        # ticks at the world sizes predicted, not at 1.1 ... 1.9 between them
        xaxis={
            "type": "log",
            "title": "world size",
            "tickmode": "array",
            "tickvals": sizes,
            "ticktext": [str(int(n)) for n in sizes],
        },
        yaxis={"title": titles.get(metric, metric)},
        # one line per scenario: a legend below the plot, in columns, needs no scrolling
        legend={"orientation": "h", "y": -0.2, "yanchor": "top"},
        height=420 + 20 * (rows["scenario"].nunique() // 3),
    )
    return fig


def predicted_vs_measured(table: pd.DataFrame) -> go.Figure:
    """Measured and predicted step per run, the error on each bar."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=table["run"], y=table["measured_ms"], name="measured"))
    fig.add_trace(
        go.Bar(
            x=table["run"],
            y=table["predicted_ms"],
            name="predicted",
            text=[f"{e:+.0%}" for e in table["error"]],
            textposition="outside",
        )
    )
    fig.update_layout(
        barmode="group",
        title="Step time: predicted beside measured",
        yaxis={"title": "ms per step (median)"},
    )
    return fig
