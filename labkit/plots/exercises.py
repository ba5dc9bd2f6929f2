"""Pictures of a learner's own run beside the grader's verdict (``labkit.exercises``): when
their bucket all-reduces started against backward, their pipeline stage's sends, receives and
computes, and what their ZeRO-1 step kept and sent per rank. Each takes what the grader
recorded on the ranks, nothing modelled."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .pipeline import gantt

_GREY, _COMM, _LATE = "#bab0ac", "#54a24b", "#e45756"


def bucket_timeline(steps: Sequence[dict], step: int) -> go.Figure:
    """One step per rank, in ms from the start of its backward: backward, then ``finish()``,
    and each all-reduce from when it was issued to when it completed (green if it started
    during backward, red if after)."""
    fig = go.Figure()
    legend = set()

    def bar(y, start, end, name, color, text="", width=0.5, offset=0.0):
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[y],
                base=[1e3 * start],
                x=[max(1e3 * (end - start), 1e-3)],
                name=name,
                legendgroup=name,
                showlegend=name not in legend,
                marker_color=color,
                width=width,
                offset=offset,
                text=[text],
                textposition="inside",
                hovertemplate=f"{name} {text}<br>%{{base:.2f}} ms, %{{x:.2f}} ms<extra></extra>",
            )
        )
        legend.add(name)

    for r, st in enumerate(steps):
        y = f"rank {r}"
        bar(y, 0.0, st["backward"], "backward", "#4C78A8", width=0.35, offset=-0.4)
        bar(y, st["backward"], st["finish"], "finish()", _GREY, width=0.35, offset=-0.4)
        reduces = [c for c in st["calls"] if c["op"] == "allreduce"]
        for c in reduces:
            during = c["issued"] < st["backward"]
            done = c["done"] if c["done"] is not None else st["finish"]
            name = "all-reduce started in backward" if during else "all-reduce started after"
            bar(y, c["issued"], done, name, _COMM if during else _LATE, f"{c['numel']}",
                width=0.35, offset=0.02)  # fmt: skip
    fig.update_layout(
        title=f"Your all-reduces against backward (step {step}; the numbers: elements sent)",
        barmode="overlay",
        xaxis_title="ms from the start of backward",
        yaxis={"autorange": "reversed", "type": "category"},
        height=140 + 70 * len(steps),
        legend={"orientation": "h", "y": -0.3},
    )
    return fig


def pipeline_timeline(events: Sequence[dict], messages: Sequence[dict], title: str) -> go.Figure:
    """Each stage's forwards and backwards as they ran (``labkit.plots.pipeline.gantt``), with
    the time it sat waiting in a receive (grey) and a mark where it sent (▶ to the next stage,
    ◀ back to the previous one)."""
    fig = gantt(events, title=title)
    waits = [m for m in messages if m["kind"] == "recv"]
    if waits:
        fig.add_trace(
            go.Bar(
                orientation="h",
                name="waiting in recv",
                y=[f"stage {m['stage']}" for m in waits],
                base=[m["start"] for m in waits],
                x=[m["end"] - m["start"] for m in waits],
                marker_color=_GREY,
                opacity=0.6,
                hovertemplate="%{y} waited for stage %{text}<extra></extra>",
                text=[str(m["peer"]) for m in waits],
                textposition="none",
            )
        )
    sends = [m for m in messages if m["kind"] == "send"]
    if sends:
        fig.add_trace(
            go.Scatter(
                name="send",
                mode="markers",
                y=[f"stage {m['stage']}" for m in sends],
                x=[m["start"] for m in sends],
                marker={
                    "symbol": [
                        "triangle-right" if m["peer"] > m["stage"] else "triangle-left"
                        for m in sends
                    ],
                    "size": 11,
                    "color": "black",
                },
                hovertemplate="%{y} sent at %{x:.4f} s<extra></extra>",
            )
        )
    fig.update_layout(xaxis_title="seconds from the first stage's start")
    return fig


def zero1_bytes(ranks: Sequence[dict], param_bytes: int) -> go.Figure:
    """Left: optimizer state each rank kept, against an unsharded optimizer's. Right: bytes
    each rank sent in one step (counted on the process group), against the all-gather of the
    parameters ZeRO-1 costs, (n-1)/n of them per rank."""
    n = len(ranks)
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("momentum kept (bytes)", "sent per step (bytes)"),
    )
    names = [f"rank {r}" for r in range(n)]
    fig.add_trace(
        go.Bar(x=names, y=[res["state_bytes"] for res in ranks], name="yours",
               marker_color="#4C78A8"),
        row=1,
        col=1,
    )  # fmt: skip
    fig.add_trace(
        go.Scatter(x=names, y=[param_bytes] * n, name="unsharded: every parameter's momentum",
                   mode="lines+markers", line={"dash": "dash", "color": _GREY}),
        row=1,
        col=1,
    )  # fmt: skip
    fig.add_trace(
        go.Bar(x=names, y=[res["sent_per_step"] for res in ranks], name="sent (counted)",
               marker_color=_COMM),
        row=1,
        col=2,
    )  # fmt: skip
    fig.add_trace(
        go.Scatter(x=names, y=[param_bytes * (n - 1) / n] * n,
                   name="all-gather of the parameters: (n-1)/n of them",
                   mode="lines+markers", line={"dash": "dash", "color": "black"}),
        row=1,
        col=2,
    )  # fmt: skip
    fig.update_layout(
        title=f"Your ZeRO-1 step on {n} ranks: what each rank kept, what each sent",
        height=360,
        legend={"orientation": "h", "y": -0.2},
    )
    return fig
