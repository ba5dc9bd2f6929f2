"""Pipeline figures: one step's Gantt chart (measured, predicted, closed form), the bubble
against the number of micro-batches, activations held and stage times."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..predict.schedule import (
    ScheduleCosts,
    bubble_per_stage,
    closed_form,
    costs_from_steps,
    predict_step,
    simulate,
    theory_bubble,
)

# per kind, a rank's first model chunk and its later ones (lighter): forward, full backward, and
# the zero-bubble split's input (I) and weight (W) halves
_COLORS = {
    "F": ("#4C78A8", "#9ECAE9"),
    "B": ("#F58518", "#FFBF79"),
    "I": ("#E45756", "#FF9D98"),
    "W": ("#54A24B", "#88D27A"),
}
_NAMES = {"F": "forward", "B": "backward", "I": "backward, input (I)", "W": "backward, weights (W)"}
# micro-batch numbers at one size, and none on a bar too short to hold it (M = 16 crowded the
# bars with shrunken, overlapping digits); hovering a bar still names its micro-batch
_LABELS_THAT_FIT = dict(uniformtext_minsize=9, uniformtext_mode="hide")


def _local_chunk(events: Sequence[dict]) -> dict[tuple[int, int], int]:
    """(stage, chunk) -> the chunk's place among its rank's chunks (0: the rank's first)."""
    held: dict[int, set] = {}
    for e in events:
        held.setdefault(e["stage"], set()).add(e.get("chunk", e["stage"]))
    return {(s, c): i for s, cs in held.items() for i, c in enumerate(sorted(cs))}


def _gantt_traces(
    events: Sequence[dict], show_legend: bool = True, like: Sequence[dict] | None = None
) -> list[go.Bar]:
    """One bar per action, one trace per kind and (with several chunks per rank) per the
    chunk's place on its rank; the bar's text is its micro-batch, its hover names the chunk.
    ``like``: the events whose traces to draw (an animation's frames draw the same traces as
    the whole step, some of them still empty)."""
    like = events if like is None else like
    local = _local_chunk(like)
    places = 1 + max(local.values(), default=0)
    present = {(e["kind"], local[e["stage"], e.get("chunk", e["stage"])]) for e in like}
    traces = []
    for kind in ("F", "B", "I", "W"):
        for k in range(places):
            split = kind == "B" and any(kk == "I" for kk, _ in present)  # no full backward
            if (kind, k) not in present and (kind in ("I", "W") or k or split):
                continue
            evs = [
                e
                for e in events
                if e["kind"] == kind and local[e["stage"], e.get("chunk", e["stage"])] == k
            ]
            name = _NAMES[kind] + (f", chunk {k + 1} of the rank" if places > 1 else "")
            traces.append(
                go.Bar(
                    orientation="h",
                    name=name,
                    legendgroup=f"{kind}{k}",
                    showlegend=show_legend,
                    y=[f"stage {e['stage']}" for e in evs],
                    base=[e["start"] for e in evs],
                    x=[e["end"] - e["start"] for e in evs],
                    text=[str(e["microbatch"]) for e in evs],
                    customdata=[e.get("chunk", e["stage"]) for e in evs],
                    textposition="inside",
                    insidetextanchor="middle",
                    marker_color=_COLORS[kind][min(k, 1)],
                    hovertemplate=(
                        f"%{{y}} {kind} micro-batch %{{text}} chunk %{{customdata}}"
                        "<br>start %{base:.4f}<br>%{x:.4f}<extra></extra>"
                    ),
                )
            )
    return traces


def gantt(events: Sequence[dict], title: str = "pipeline timeline", unit: str = "s") -> go.Figure:
    """A Gantt chart of one step's events: one row per stage, micro-batch numbers on the bars."""
    fig = go.Figure(_gantt_traces(events))
    fig.update_layout(
        title=title,
        barmode="overlay",
        xaxis_title=f"time ({unit})",
        yaxis=dict(autorange="reversed"),
        height=120 + 50 * _n_stages(events),
        **_LABELS_THAT_FIT,
    )
    return fig


def gantt_vs_theory(
    events: Sequence[dict],
    schedule: str,
    stages: int,
    microbatches: int,
    predicted_costs: ScheduleCosts | None = None,
) -> go.Figure:
    """One step three ways: measured (top); in the middle the schedule simulated on
    ``predicted_costs`` (costs measured in other runs: a prediction), or without them on this
    step's own measured stage times, hand-offs and dispatch (a replay, and labelled one); and
    the closed form's ideal, equal stages with the same mean F/B times and free hand-offs."""

    def mean(kind: str, default: float) -> float:
        xs = [e["end"] - e["start"] for e in events if e["kind"] == kind]
        return statistics.mean(xs) if xs else default

    v = max(1, len({e.get("chunk", e["stage"]) for e in events}) // stages)
    f, w = mean("F", 1.0), mean("W", 0.0)
    b = mean("B", mean("I", 1.0) + w) if w else mean("B", 2.0)
    ideal = simulate(
        schedule,
        microbatches,
        ScheduleCosts.uniform(stages, f, b, virtual=v, weight_s=w or None),
    )
    replay = predicted_costs is None
    costs = costs_from_steps([events], stages) if replay else predicted_costs
    predicted = predict_step(schedule, microbatches, costs)
    measured = statistics.mean(bubble_per_stage(events).values())
    form = closed_form(schedule, stages, microbatches, v)
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        subplot_titles=(
            f"measured, one step ({schedule}, P={stages}, M={microbatches}"
            f"{f', v={v}' if v > 1 else ''}): bubble "
            f"{measured:.2f} in this step",
            (
                "replayed on this step's own measured costs (a replay, not a prediction)"
                if replay
                else "predicted from other runs' measured costs"
            )
            + f"<br>hand-off {1e3 * max(costs.handoff_s, default=0):.2f} ms, dispatch "
            f"{1e3 * max(costs.gap_s, default=0):.2f} ms: expected bubble "
            f"{predicted['bubble']:.2f}",
            f"ideal, equal chunks and free hand-offs ({form['formula']}): "
            f"{form['share']:.2f} of the step",
        ),
    )
    for row, evs in enumerate((events, predicted["events"], ideal), start=1):
        for trace in _gantt_traces(evs, show_legend=row == 1):
            fig.add_trace(trace, row=row, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="seconds from step start", row=3, col=1)
    fig.update_layout(
        barmode="overlay",
        height=260 + 120 * stages,
        margin=dict(t=60, b=40, l=70, r=20),
        **_LABELS_THAT_FIT,
    )
    return fig


def bubble_vs_microbatches(table, stages: int) -> go.Figure:
    """Measured bubble fraction against M (points per schedule) with the theory curve."""
    fig = go.Figure()
    for schedule, g in table.groupby("schedule"):
        fig.add_trace(
            go.Scatter(
                x=g["microbatches"],
                y=g["bubble_fraction"],
                name=f"{schedule} measured",
                mode="markers+lines",
            )
        )
        if "bubble_predicted" in g:
            fig.add_trace(
                go.Scatter(
                    x=g["microbatches"],
                    y=g["bubble_predicted"],
                    name=f"{schedule} predicted",
                    mode="markers",
                    marker=dict(symbol="x", size=10),
                )
            )
    ms = list(range(1, int(table["microbatches"].max()) + 1))
    fig.add_trace(
        go.Scatter(
            x=ms,
            y=[theory_bubble(stages, m) for m in ms],
            mode="lines",
            name="(P-1)/(M+P-1)",
            line=dict(dash="dash", color="black"),
        )
    )
    fig.update_layout(
        title=f"pipeline bubble at P={stages}",
        xaxis_title="micro-batches M",
        yaxis_title="idle share of the step",
        yaxis_range=[0, 1],
    )
    return fig


def activation_memory(table, column: str = "activations_peak") -> go.Figure:
    """Activations held per stage (micro-batches or bytes), one bar group per schedule."""
    fig = go.Figure()
    for schedule, g in table.groupby("schedule"):
        fig.add_trace(go.Bar(x=[f"stage {s}" for s in g["stage"]], y=g[column], name=str(schedule)))
    label = "micro-batches held" if column == "activations_peak" else "bytes held"
    fig.update_layout(
        title=f"activation memory per stage ({column})", barmode="group", yaxis_title=label
    )
    return fig


def stage_times(before: Sequence[float], after: Sequence[float]) -> go.Figure:
    """Per-stage cost before and after balancing: the slowest stage sets the pipeline's pace."""
    fig = go.Figure(
        [
            go.Bar(
                x=[f"stage {i}" for i in range(len(before))], y=before, name="equal layer counts"
            ),
            go.Bar(x=[f"stage {i}" for i in range(len(after))], y=after, name="balanced by cost"),
        ]
    )
    fig.update_layout(title="per-stage compute per step", barmode="group", yaxis_title="seconds")
    return fig


def _n_stages(events: Iterable[dict]) -> int:
    return len({e["stage"] for e in events}) or 1


def order_in_time(order: dict, title: str | None = None, frames: int = 12) -> go.Figure:
    """A schedule's own order (``labkit.labs.pipeline_bubble.schedule_order``) laid out in unit
    time, with a slider (and Play) that moves time on in up to ``frames`` steps: the pipe
    filling, each rank's chunks by shade, the zero-bubble split's W filling the gaps; white is
    the bubble."""
    events = order["events"]
    end = max(e["end"] for e in events)
    P = order["stages"]
    ends = sorted({e["end"] for e in events})
    times = [ends[round(i * (len(ends) - 1) / max(1, frames - 1))] for i in range(frames)]
    times = sorted(set(times))
    frames = [
        go.Frame(
            data=_gantt_traces([e for e in events if e["end"] <= t], like=events), name=f"{t:g}"
        )
        for t in times
    ]
    fig = go.Figure(data=frames[-1].data, frames=frames)
    v = order["virtual"]
    fig.update_layout(
        title=title
        or f"{order['strategy']}: P={P}, M={order['microbatches']}, v={v} (forward 1 unit, "
        f"I and W 1 each; numbers: micro-batch)",
        barmode="overlay",
        xaxis=dict(title="time (units)", range=[0, end]),
        yaxis=dict(
            autorange="reversed",
            categoryorder="array",
            categoryarray=[f"stage {s}" for s in range(P)],
        ),
        height=230 + 45 * P,
        updatemenus=[
            dict(
                type="buttons",
                showactive=False,
                x=0.0,
                y=-0.15,
                xanchor="left",
                buttons=[
                    dict(
                        label="Play",
                        method="animate",
                        args=[None, dict(frame=dict(duration=250, redraw=True), fromcurrent=True)],
                    )
                ],
            )
        ],
        sliders=[
            dict(
                active=len(frames) - 1,
                x=0.1,
                len=0.9,
                y=-0.08,
                currentvalue=dict(prefix="time: "),
                steps=[
                    dict(
                        label=f.name,
                        method="animate",
                        args=[[f.name], dict(mode="immediate", frame=dict(duration=0))],
                    )
                    for f in frames
                ],
            )
        ],
        **_LABELS_THAT_FIT,
    )
    return fig


def schedules_bubble(table) -> go.Figure:
    """Per schedule (and v) at each M it predicted: the bubble measured, predicted from other
    runs and by the closed form, each as idle / step."""
    rows = table[table["role"] == "predicted"]
    label = [
        f"{s} v={v} M={m}"
        for s, v, m in zip(rows["schedule"], rows["virtual_stages"], rows["microbatches"])
    ]
    fig = go.Figure(
        [
            go.Bar(x=label, y=rows["bubble_fraction"], name="measured"),
            go.Bar(x=label, y=rows["bubble_predicted"], name="predicted from other runs"),
            go.Bar(x=label, y=rows["theory"], name="closed form (equal chunks, free hand-offs)"),
        ]
    )
    fig.update_layout(
        title="bubble per schedule: idle share of the step",
        barmode="group",
        yaxis_title="idle / step",
        yaxis_range=[0, 1],
    )
    return fig


def activation_vs_in_flight(table) -> go.Figure:
    """Per schedule and stage, the activation bytes held at the peak, measured by the memory
    meter and predicted (in-flight count from the schedule's order x each chunk's bytes)."""
    label = [f"{s} stage {k}" for s, k in zip(table["strategy"], table["stage"])]
    fig = go.Figure(
        [
            go.Bar(x=label, y=table["bytes_measured"], name="measured (memory meter)"),
            go.Bar(x=label, y=table["bytes_predicted"], name="predicted: in flight x bytes"),
        ]
    )
    fig.update_layout(
        title="activation bytes held at the peak, per stage", barmode="group", yaxis_title="bytes"
    )
    return fig
