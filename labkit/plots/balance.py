"""Figures of the load-balancing lab: who computed, who waited, and how the shares moved."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import PHASE_COLORS, records_label

# what a rank did in a step, in order: its own work, then the sync it shares with everyone
SEGMENTS = (
    ("compute", ("data_s", "forward_s", "backward_s"), "#4c78a8"),
    ("wait", ("wait_s",), PHASE_COLORS["wait"]),
    ("comm", ("comm_s",), PHASE_COLORS["comm"]),
    ("optimizer", ("optimizer_s",), PHASE_COLORS["optimizer"]),
)


def rank_timeline(records: pd.DataFrame, steps: int = 6) -> go.Figure:
    """One lane per rank, the first ``steps`` measured steps on the shared clock: each rank's
    compute (a slowed rank's is longer), its wait at the sync for the slowest, the all-reduce
    and the optimizer. The straggler is the lane that never waits."""
    recs = records[records["step"] < records["step"].min() + steps]
    fig = go.Figure()
    for name, cols, color in SEGMENTS:
        starts, widths, lanes, text = [], [], [], []
        for _, r in recs.iterrows():
            offset = sum(
                r[c] for _, cs, _ in SEGMENTS[: [s[0] for s in SEGMENTS].index(name)] for c in cs
            )
            starts.append(1e3 * (r["start_s"] + offset))
            widths.append(1e3 * sum(r[c] for c in cols))
            lanes.append(f"rank {int(r['rank'])} ({r.get('slowdown', 1.0):g}x)")
            text.append(f"step {int(r['step'])}, share {r.get('share', float('nan')):.0%}")
        fig.add_trace(
            go.Bar(
                base=starts,
                x=widths,
                y=lanes,
                orientation="h",
                name=name,
                marker_color=color,
                hovertext=text,
            )
        )
    fig.update_layout(
        barmode="overlay",
        title="Per-rank timeline: compute, wait at the sync, all-reduce, optimizer",
        xaxis_title="ms since the first measured step",
        yaxis={"autorange": "reversed"},
        height=260,
    )
    return fig


def rank_utilisation(records: pd.DataFrame) -> go.Figure:
    """Per run and rank, where its time went over the whole run (shares of its wall time)."""
    df = records.assign(run=records_label(records))
    fig = go.Figure()
    rows = []
    for (run, rank), g in df.groupby(["run", "rank"], sort=False):
        total = g["step_s"].sum()
        rows.append(
            {
                "lane": f"{run} · rank {int(rank)}",
                **{name: sum(g[c].sum() for c in cols) / total for name, cols, _ in SEGMENTS},
            }
        )
    table = pd.DataFrame(rows)
    for name, _, color in SEGMENTS:
        fig.add_trace(
            go.Bar(
                y=table["lane"],
                x=table[name],
                name=name,
                orientation="h",
                marker_color=color,
                text=[f"{v:.0%}" for v in table[name]],
                textposition="inside",
            )
        )
    total = table[[name for name, _, _ in SEGMENTS]].sum(axis=1).max()
    fig.update_layout(
        barmode="stack",
        title="Where each rank's time went (whole run)",
        # shares of a rank's wall time: the axis from 0 to the whole (a little more where the
        # phases overlap), not the -50 % to 150 % that plotly picked around the labels
        xaxis={
            "title": "share of the rank's time",
            "tickformat": ".0%",
            "range": [0, max(1.0, float(total)) * 1.02],
        },
        yaxis={"autorange": "reversed", "type": "category", "automargin": True, "dtick": 1},
        legend={"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"},
        height=max(320, 170 + 55 * len(table)),
        margin={"t": 100},
    )
    return fig


def shares_over_time(records: pd.DataFrame) -> go.Figure:
    """Top: each run's throughput per step (its samples over the slowest rank's step time).
    Bottom: each rank's share of the global batch, moving where the policy is dynamic."""
    df = records.assign(run=records_label(records))
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        subplot_titles=("throughput per step", "share of the global batch"),
    )
    for run, g in df.groupby("run", sort=False):
        per = g.groupby("step").agg(samples=("samples", "sum"), step_s=("step_s", "max"))
        fig.add_trace(
            go.Scatter(
                x=per.index,
                y=per["samples"] / per["step_s"],
                name=run,
                mode="lines+markers",
                legendgroup=run,
            ),
            row=1,
            col=1,
        )
        for rank, r in g.groupby("rank"):
            fig.add_trace(
                go.Scatter(
                    x=r["step"],
                    y=r["share"],
                    mode="lines",
                    name=f"{run} · rank {int(rank)}",
                    legendgroup=run,
                    line={"dash": "dot" if rank else "solid"},
                ),
                row=2,
                col=1,
            )
    fig.update_yaxes(title_text="samples / s", row=1, col=1)
    fig.update_yaxes(title_text="share", tickformat=".0%", row=2, col=1)
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(title="Throughput as the shares adapt", height=480)
    return fig


def predicted_vs_measured(rows: pd.DataFrame) -> go.Figure:
    """Step time per policy: measured beside the step-time predictor's (``balance_rows``)."""
    fig = go.Figure()
    fig.add_trace(go.Bar(x=rows["run"], y=rows["measured_ms"], name="measured (median step)"))
    fig.add_trace(go.Bar(x=rows["run"], y=rows["predicted_ms"], name="predicted"))
    fig.update_layout(
        barmode="group", title="Step time: predicted beside measured", yaxis_title="ms"
    )
    return fig


def sharding(rows: pd.DataFrame) -> go.Figure:
    """Per policy, each rank's compute in every step: random equal counts vs cost-aware cuts."""
    fig = go.Figure()
    for (policy, rank), g in rows.groupby(["policy", "rank"]):
        fig.add_trace(
            go.Bar(
                x=g["step"],
                y=1e3 * g["compute_s"],
                name=f"{policy} · rank {rank}",
                offsetgroup=f"{policy}{rank}",
                marker_pattern_shape="" if policy == "cost" else "/",
            )
        )
    fig.update_layout(
        barmode="group",
        title="Per-rank compute of each step's shard",
        xaxis_title="step",
        yaxis_title="ms (forward + backward)",
    )
    return fig
