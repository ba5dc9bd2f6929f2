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


def lanes(records: pd.DataFrame, steps: int = 8) -> go.Figure:
    """Who waits for whom: one lane per run and rank, its first ``steps`` measured steps on the
    shared clock (from each run's first measured step), each step split into compute, wait,
    communication and optimizer (``labkit.plots.balance.SEGMENTS``). DDP's lanes communicate
    every step; local SGD's and DiLoCo's every H steps; a parameter server's workers never wait
    for each other, and the server (rank 0) waits for pushes."""
    from . import records_label
    from .balance import SEGMENTS

    df = records.assign(run=records_label(records))
    bars = {name: ([], [], [], []) for name, _, _ in SEGMENTS}  # base, width, lane, hover
    for run, recs in df.groupby("run", sort=False):
        recs = recs[recs["step"] < recs["step"].min() + steps]
        t0 = recs["start_s"].min()
        for _, r in recs.iterrows():
            at = r["start_s"] - t0
            for name, cols, _ in SEGMENTS:
                width = sum(float(r[c]) for c in cols if c in r and pd.notna(r[c]))
                if width > 0:
                    base, widths, lane, hover = bars[name]
                    base.append(1e3 * at)
                    widths.append(1e3 * width)
                    lane.append(f"{run} · rank {int(r['rank'])}")
                    hover.append(f"step {int(r['step'])}: {name} {1e3 * width:.1f} ms")
                    at += width
    fig = go.Figure()
    for name, _, colour in SEGMENTS:
        base, widths, lane, hover = bars[name]
        fig.add_trace(
            go.Bar(
                base=base,
                x=widths,
                y=lane,
                orientation="h",
                name=name,
                marker_color=colour,
                hovertext=hover,
            )  # fmt: skip
        )
    n_lanes = df.groupby(["run", "rank"]).ngroups
    fig.update_layout(
        barmode="overlay",
        title=f"The first {steps} steps of each mode, per rank: who waits for whom",
        xaxis_title="ms since the run's first measured step",
        yaxis={"autorange": "reversed"},
        height=140 + 28 * n_lanes,
    )
    return fig
