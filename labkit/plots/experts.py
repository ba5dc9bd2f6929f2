"""Figures of the mixture-of-experts lab (``labkit.labs.experts``): one real dispatch, before and
after the all-to-all; the router's load per expert against its capacity; the load per expert
and per rank over training; what the all-to-alls carried beside the formula."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

EXPERT_COLOURS = (
    "#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#9d755d",
)  # fmt: skip
DROPPED = "#d0d0d0"


def expert_colour(e: int) -> str:
    return EXPERT_COLOURS[e % len(EXPERT_COLOURS)]


def dispatch(d) -> go.Figure:
    """``labkit.labs.experts.dispatch``'s run drawn: on the left each rank's tokens, coloured by
    the expert its router chose (grey: dropped by the capacity); on the right what each rank's
    experts computed after the all-to-all, each row labelled with the rank and token it came
    from."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("before: each rank's tokens and their experts", "after the all-to-all"),
        horizontal_spacing=0.16,
    )
    n = d.world_size
    per = d.experts // n
    for _, t in d.trips.iterrows():
        x = t["token"] + t["choice"] * (d.trips["token"].max() + 1.4)
        fig.add_trace(
            go.Scatter(
                x=[x],
                y=[f"rank {t['rank']}"],
                mode="markers+text",
                marker=dict(
                    size=26,
                    symbol="square",
                    color=expert_colour(t["expert"]) if t["kept"] else DROPPED,
                ),
                text=[f"e{t['expert']}" if t["kept"] else "✗"],
                textfont=dict(color="white" if t["kept"] else "#444", size=10),
                hovertext=f"rank {t['rank']} token {t['token']} -> expert {t['expert']} "
                f"(on rank {t['owner']}){'' if t['kept'] else ': dropped'}",
                hoverinfo="text",
                showlegend=False,
            ),
            row=1,
            col=1,
        )
    for owner in range(n):
        slot = 0
        for e in range(owner * per, (owner + 1) * per):
            rows = d.arrived[d.arrived["expert"] == e]
            for _, a in rows.iterrows():
                fig.add_trace(
                    go.Scatter(
                        x=[slot],
                        y=[f"rank {owner}: e{owner * per}-e{(owner + 1) * per - 1}"],
                        mode="markers+text",
                        marker=dict(size=26, symbol="square", color=expert_colour(e)),
                        text=[f"{a['rank']}.{a['token']}"],
                        textfont=dict(color="white", size=9),
                        hovertext=f"expert {e} computed rank {a['rank']}'s token {a['token']}",
                        hoverinfo="text",
                        showlegend=False,
                    ),
                    row=1,
                    col=2,
                )
                slot += 1
            slot += 0.6
    for e in range(d.experts):  # the legend: one entry per expert
        fig.add_trace(
            go.Scatter(
                x=[None],
                y=[None],
                mode="markers",
                marker=dict(size=12, symbol="square", color=expert_colour(e)),
                name=f"expert {e} (rank {e // per})",
            )
        )
    fig.update_xaxes(showticklabels=False, showgrid=False, zeroline=False)
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(
        height=150 + 60 * n,
        title=f"One dispatch: {d.experts} experts on {n} ranks, top-{d.top_k}, capacity "
        f"{d.capacity} per expert and rank (label r.t: rank r's token t)",
        margin=dict(l=10, r=10, t=70, b=10),
    )
    return fig


def capacity(d) -> go.Figure:
    """Per expert and source rank: the assignments its router made, kept and dropped, against
    the capacity each rank's group gives it."""
    every = pd.MultiIndex.from_product(
        [range(d.world_size), range(d.experts)], names=["rank", "expert"]
    )  # an expert nobody chose shows as an empty bar
    t = d.trips.groupby(["rank", "expert"])["kept"].agg(kept="sum", routed="count")
    t = t.reindex(every, fill_value=0).reset_index()
    fig = go.Figure()
    x = [f"e{e} from rank {r}" for r, e in zip(t["rank"], t["expert"])]
    fig.add_trace(
        go.Bar(x=x, y=t["kept"], name="kept", marker_color=[expert_colour(e) for e in t["expert"]])
    )
    fig.add_trace(go.Bar(x=x, y=t["routed"] - t["kept"], name="dropped", marker_color=DROPPED))
    fig.add_hline(y=d.capacity, line_dash="dot", annotation_text=f"capacity {d.capacity}")
    fig.update_layout(
        barmode="stack",
        height=320,
        title="The router's choices per expert and group, against the capacity",
        yaxis_title="assignments",
    )
    return fig


def load(table: pd.DataFrame, by: str = "expert") -> go.Figure:
    """``expert_load`` (``by="expert"``: each expert's share of the assignments) or
    ``rank_load`` (``by="rank"``: each rank's share of the rows its experts computed) per step,
    one panel per run, block 0; an even load is the dotted line."""
    t = table[table["layer"] == 0]
    runs = list(dict.fromkeys(t["run"]))
    fig = make_subplots(rows=1, cols=len(runs), subplot_titles=runs, shared_yaxes=True)
    for c, run in enumerate(runs, start=1):
        g = t[t["run"] == run]
        for k in sorted(g[by].unique()):
            s = g[g[by] == k]
            fig.add_trace(
                go.Scatter(
                    x=s["step"],
                    y=s["share"],
                    mode="lines",
                    name=f"{by} {k}",
                    line=dict(color=expert_colour(int(k))),
                    showlegend=c == 1,
                ),
                row=1,
                col=c,
            )
        fig.add_hline(y=1 / g[by].nunique(), line_dash="dot", row=1, col=c)
    what = "share of assignments" if by == "expert" else "share of the rows computed"
    fig.update_yaxes(title_text=what, row=1, col=1)
    fig.update_xaxes(title_text="step")
    fig.update_layout(height=320, title=f"Load per {by} (block 0), each run")
    return fig


def imbalance(table: pd.DataFrame) -> go.Figure:
    """``imbalance``: the busiest expert over an even share, and the share of assignments
    dropped, per step, one line per run."""
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("busiest expert / even share", "assignments dropped")
    )
    for i, run in enumerate(dict.fromkeys(table["run"])):
        g = table[table["run"] == run]
        colour = EXPERT_COLOURS[i % len(EXPERT_COLOURS)]
        for col, y in ((1, "max_over_mean"), (2, "drop_fraction")):
            fig.add_trace(
                go.Scatter(
                    x=g["step"],
                    y=g[y],
                    mode="lines+markers",
                    name=run,
                    line=dict(color=colour),
                    showlegend=col == 1,
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    fig.update_layout(height=330, title="A skewed router, and the auxiliary loss pulling it back")
    return fig


def bytes_per_step(table: pd.DataFrame) -> go.Figure:
    """``all_to_all_bytes`` per rank and step: what labkit.wire counted as sent beside the
    formula tokens x hidden x (N-1)/N per all-to-all."""
    x = [f"step {s} rank {r}" for s, r in zip(table["step"], table["rank"])]
    fig = go.Figure(
        [
            go.Bar(x=x, y=table["counted_sent_bytes"] / 1e3, name="counted (labkit.wire)"),
            go.Bar(x=x, y=table["formula_bytes"] / 1e3, name="formula"),
        ]
    )
    fig.update_layout(
        barmode="group",
        height=320,
        yaxis_title="kB sent per step",
        title="The all-to-alls' bytes: counted on the process group, and the formula",
    )
    return fig
