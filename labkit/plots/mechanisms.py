"""Pictures of the mechanisms, drawn from what ``labkit.labs.mechanisms`` ran: who holds what
before and after a collective, the ring all-reduce step by step, what each rank keeps under
ZeRO and FSDP, a pipeline schedule filling. Each figure takes that module's results."""

from __future__ import annotations

import re
from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .pipeline import _gantt_traces

# one colour per chunk index (a chunk keeps its colour wherever it travels)
_CHUNK_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6",
                 "#9d755d")  # fmt: skip
_EMPTY = "#eeeeee"


def _chunk(label: str) -> int | None:
    """A label's chunk index ("A1+C1" -> 1, "Σ2" -> 2), None for an empty buffer ("·")."""
    digits = re.findall(r"\d+", label)
    return int(digits[-1]) if digits else None


def _grid(labels: Sequence[Sequence[str]], width: int) -> go.Heatmap:
    """Ranks as rows (rank 0 on top), one cell per chunk slot, coloured by chunk index."""
    n_colors = len(_CHUNK_COLORS)
    z, text = [], []
    for row in labels:
        cells = [_chunk(c) for c in row] + [None] * (width - len(row))
        z.append([-1 if c is None else c % n_colors for c in cells])
        text.append(list(row) + [""] * (width - len(row)))
    scale = [(0.0, _EMPTY), (1 / (n_colors + 1), _EMPTY)]
    for i, colour in enumerate(_CHUNK_COLORS):
        scale += [((i + 1) / (n_colors + 1), colour), ((i + 2) / (n_colors + 1), colour)]
    return go.Heatmap(
        z=z,
        text=text,
        texttemplate="%{text}",
        textfont=dict(size=13, color="white"),
        x=[f"slot {i}" for i in range(width)],
        y=[f"rank {r}" for r in range(len(labels))],
        zmin=-1,
        zmax=n_colors,
        colorscale=scale,
        showscale=False,
        xgap=3,
        ygap=3,
        hovertemplate="%{y}, %{x}: %{text}<extra></extra>",
    )


def collective(c) -> go.Figure:
    """One collective (``labs.mechanisms.collective``): each rank's chunks before and after.
    A letter is the rank that owned a chunk (A = rank 0), the digit the chunk; "Σ1" is chunk 1
    summed over every rank, "·" an empty buffer."""
    width = max(len(row) for row in (*c.before, *c.after))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("before", "after"), horizontal_spacing=0.08)
    fig.add_trace(_grid(c.before, width), row=1, col=1)
    fig.add_trace(_grid(c.after, width), row=1, col=2)
    fig.update_yaxes(autorange="reversed")
    title = f"{c.op} on {c.world_size} ranks (ran on gloo)"
    if c.note:
        title += f"<br><sup>{c.note}</sup>"
    fig.update_layout(title=title, height=140 + 48 * c.world_size, margin=dict(t=110))
    return fig


def _ring_frame(step, n: int) -> list:
    """One frame of the ring: the cells coloured by how many ranks' chunks they sum (darker =
    more), and an arrow on the chunk each rank just sent to its right neighbour."""
    depth = [[0 if c == "·" else (n if c.startswith("Σ") else c.count("+") + 1) for c in row]
             for row in step.held]  # fmt: skip
    grid = go.Heatmap(
        z=depth,
        text=step.held,
        texttemplate="%{text}",
        textfont=dict(size=13),
        x=list(range(n)),
        y=list(range(n)),
        zmin=0,
        zmax=n,
        colorscale="Blues",
        showscale=False,
        xgap=3,
        ygap=3,
        hovertemplate="rank %{y}, chunk %{x}: %{text} (sums %{z} ranks)<extra></extra>",
    )
    sent = [(s, r) for r, s in enumerate(step.sent) if s is not None]
    arrows = go.Scatter(
        x=[s + 0.4 for s, _ in sent],  # at the cell's right edge, pointing right
        y=[r for _, r in sent],
        mode="markers",
        marker=dict(symbol="arrow-right", size=16, color="#e45756", line=dict(width=0)),
        customdata=[s for s, _ in sent],
        hovertemplate="rank %{y} sent chunk %{customdata} to its right neighbour<extra></extra>",
        showlegend=False,
    )
    return [grid, arrows]


def _ring_title(step, n: int, total: int) -> str:
    if step.phase == "start":
        return f"ring all-reduce on {n} ranks: each starts with its own {n} chunks"
    action = "adds the one from its left" if step.phase == "reduce-scatter" else "keeps it"
    k = step.elements_sent[0]
    return (
        f"{step.phase} step {step.step + 1} of {n - 1}: each rank sends one chunk right and "
        f"{action}<br><sup>each rank has sent {k} of {total} chunks "
        f"({k}/{n} of its data; in all 2(n-1)/n = {total}/{n})</sup>"
    )


def ring(steps: Sequence) -> go.Figure:
    """The ring all-reduce (``labs.mechanisms.ring``) step by step: a slider (and Play) moves
    through the steps; each cell shows which ranks' chunks it sums, darker as more do; the red
    arrow marks the chunk each rank sent in that step."""
    n = len(steps[0].held)
    total = 2 * (n - 1)
    names = [f"{s.phase} {s.step + 1}" if s.phase != "start" else "start" for s in steps]
    frames = [
        go.Frame(
            data=_ring_frame(s, n),
            name=name,
            layout=go.Layout(title_text=_ring_title(s, n, total)),
        )
        for s, name in zip(steps, names)
    ]
    fig = go.Figure(data=frames[0].data, frames=frames)
    fig.update_layout(
        title=_ring_title(steps[0], n, total),
        xaxis=dict(tickvals=list(range(n)), ticktext=[f"chunk {i}" for i in range(n)]),
        yaxis=dict(
            autorange="reversed", tickvals=list(range(n)), ticktext=[f"rank {r}" for r in range(n)]
        ),
        height=200 + 48 * n,
        margin=dict(t=110),
        updatemenus=[_play_button(900)],
        sliders=[_slider(names)],
    )
    return fig


def _play_button(ms: int) -> dict:
    return dict(
        type="buttons",
        showactive=False,
        x=0.0,
        y=-0.12,
        xanchor="left",
        buttons=[
            dict(
                label="Play",
                method="animate",
                args=[None, dict(frame=dict(duration=ms, redraw=True), fromcurrent=True)],
            )
        ],
    )


def _slider(names: Sequence[str]) -> dict:
    return dict(
        active=0,
        x=0.1,
        len=0.9,
        y=-0.05,
        currentvalue=dict(prefix="after: "),
        steps=[
            dict(
                label=name,
                method="animate",
                args=[[name], dict(mode="immediate", frame=dict(duration=0, redraw=True))],
            )
            for name in names
        ],
    )


def _share_text(share: float) -> str:
    if share >= 1.0:
        return "all"
    if share <= 0.0:
        return "—"
    return f"{share:.0%}"


def shards(table: pd.DataFrame) -> go.Figure:
    """What each rank keeps (``labs.mechanisms.shards``): per kind (parameters, gradients,
    optimizer state), one cell per (rank, tensor), darker as the rank keeps more of it."""
    kinds = list(dict.fromkeys(table["kind"]))
    tensors = list(dict.fromkeys(table["tensor"]))
    ranks = sorted(table["rank"].unique())
    fig = make_subplots(
        rows=1, cols=len(kinds), subplot_titles=kinds, horizontal_spacing=0.04, shared_yaxes=True
    )
    for i, kind in enumerate(kinds, start=1):
        part = table[table["kind"] == kind].pivot(index="rank", columns="tensor", values="share")
        part = part.loc[ranks, tensors]
        fig.add_trace(
            go.Heatmap(
                z=part.values,
                text=[[_share_text(v) for v in row] for row in part.values],
                texttemplate="%{text}",
                x=tensors,
                y=[f"rank {r}" for r in ranks],
                zmin=0,
                zmax=1,
                colorscale="Greens",
                showscale=False,
                xgap=2,
                ygap=2,
                hovertemplate="%{y} keeps %{text} of %{x}<extra></extra>",
            ),
            row=1,
            col=i,
        )
    fig.update_yaxes(autorange="reversed")
    kept = table.groupby("rank")["held"].sum() / table.groupby("rank")["total"].sum()
    strategy = table.attrs.get("strategy", "")
    stage = table.attrs.get("zero_stage")
    per_rank = ", ".join(f"rank {r} {kept[r]:.0%}" for r in ranks)
    fig.update_layout(
        title=f"{strategy} (ZeRO stage {stage}) on {len(ranks)} ranks: what each rank keeps"
        f"<br><sup>of all model state: {per_rank}</sup>",
        height=170 + 40 * len(ranks),
        margin=dict(t=110),
    )
    return fig


def pipeline_order(events: Sequence[dict], schedule: str) -> go.Figure:
    """A schedule's order filling the pipe (``labs.mechanisms.pipeline_order``), in unit time:
    a slider (and Play) adds one time unit at a time; white is the bubble."""
    end = max(e["end"] for e in events)
    stages = 1 + max(e["stage"] for e in events)
    times = sorted({e["end"] for e in events})
    frames = [
        go.Frame(
            data=_gantt_traces([e for e in events if e["end"] <= t]),
            name=f"{t:g}",
        )
        for t in times
    ]
    fig = go.Figure(data=frames[-1].data, frames=frames)
    fig.update_layout(
        title=f"{schedule}: {stages} stages, forward 1 unit, backward 2 (numbers: micro-batch)",
        barmode="overlay",
        xaxis=dict(title="time (units)", range=[0, end]),
        yaxis=dict(
            autorange="reversed",
            categoryorder="array",
            categoryarray=[f"stage {s}" for s in range(stages)],
        ),  # fmt: skip
        height=200 + 45 * stages,
        updatemenus=[_play_button(300)],
        sliders=[_slider([f.name for f in frames]) | dict(active=len(frames) - 1)],
        uniformtext_minsize=9,
        uniformtext_mode="hide",
    )
    return fig


_RANK_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6",
                "#9d755d")  # fmt: skip


def tensor_cut(table: pd.DataFrame, block: str = "1") -> go.Figure:
    """Megatron's cut of one transformer block (``labs.mechanisms.shards("tp_dtensor")``): each
    weight drawn as the matrix A of ``Y = X A`` (inputs down, outputs across: torch's weight
    transposed), coloured by the rank that holds each slice. Column-parallel layers split the
    outputs (``S(0)`` of torch's weight), row-parallel ones the inputs (``S(1)``); ``f`` and
    ``g`` mark where the all-reduces go."""
    params = table[(table["kind"] == "parameters") & table["tensor"].str.endswith(".weight")]
    layers = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    ranks = sorted(params["rank"].unique())
    fig = go.Figure()
    weights = params[params["tensor"].isin([f"{block}.{name}.weight" for name in layers])]
    longest = max(max(shape) * len(ranks) for shape in weights["local_shape"])
    scale = 2.5 / longest  # the longest side of any matrix (an upper bound): 2.5 units
    x, gap, shapes, notes, tallest = 0.0, 0.8, [], [], 0.0
    for name in layers:
        rows = params[params["tensor"] == f"{block}.{name}.weight"].set_index("rank").loc[ranks]
        placement = rows["placement"].iloc[0]
        out_f = (
            sum(s[0] for s in rows["local_shape"])
            if placement == "S(0)"
            else (rows["local_shape"].iloc[0][0])
        )
        in_f = (
            sum(s[1] for s in rows["local_shape"])
            if placement == "S(1)"
            else (rows["local_shape"].iloc[0][1])
        )
        w, h = out_f * scale, in_f * scale  # A: in_f rows (down), out_f columns
        tallest = max(tallest, h)
        at = 0.0
        for r, shape in zip(ranks, rows["local_shape"]):
            colour = _RANK_COLORS[r % len(_RANK_COLORS)]
            if placement == "S(0)":  # outputs split: a band of A's columns
                x0, x1, y0, y1 = x + at * w / out_f, x + (at + shape[0]) * w / out_f, -h, 0.0
                at += shape[0]
            elif placement == "S(1)":  # inputs split: a band of A's rows
                x0, x1, y0, y1 = x, x + w, -(at + shape[1]) * h / in_f, -at * h / in_f
                at += shape[1]
            else:
                x0, x1, y0, y1 = x, x + w, -h, 0.0
            shapes.append(
                dict(
                    type="rect",
                    x0=x0,
                    x1=x1,
                    y0=y0,
                    y1=y1,
                    fillcolor=colour,
                    opacity=0.85,
                    line=dict(color="white", width=2),
                )  # fmt: skip
            )
        kind = {"S(0)": "column-parallel", "S(1)": "row-parallel"}.get(placement, "replicated")
        notes.append(
            dict(x=x + w / 2, y=0.1, yanchor="bottom", showarrow=False,
                 text=f"<b>{name}</b><br>{kind}<br>{in_f} in × {out_f} out, weight {placement}")
        )  # fmt: skip
        if placement == "S(0)":  # f before a column-parallel layer
            notes.append(dict(x=x - 0.3 * gap, y=-0.2, showarrow=False, font=dict(size=18),
                              text="<b>f</b>"))  # fmt: skip
        if placement == "S(1)":  # g after a row-parallel layer
            notes.append(dict(x=x + w + 0.3 * gap, y=-0.2, showarrow=False, font=dict(size=18),
                              text="<b>g</b>"))  # fmt: skip
        x += w + gap
    for r in ranks:  # a legend: one entry per rank
        colour = _RANK_COLORS[r % len(_RANK_COLORS)]
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=f"rank {r}",
                                 marker=dict(size=12, symbol="square", color=colour)))  # fmt: skip
    fig.update_layout(
        title=f"tensor parallelism over {len(ranks)} ranks: block {block}, who holds which slice"
        "<br><sup>f: identity forward, all-reduce backward. g: all-reduce forward, identity "
        "backward. Between f and g each rank works on its own slice, without a message.</sup>",
        shapes=shapes,
        annotations=notes,
        xaxis=dict(visible=False, range=[-gap, x]),
        yaxis=dict(visible=False, scaleanchor="x", range=[-tallest - 0.1, 0.9]),
        height=int(180 + 800 * (tallest + 1.0) / (x + gap)),  # about the drawing's aspect
        margin=dict(t=110),
        plot_bgcolor="white",
    )
    return fig


_PHASE_COLORS = {"data": "#bab0ac", "forward": "#4c78a8", "backward": "#72b7b2", "wait": "#dddddd",
                 "comm": "#e45756", "sync_overhead": "#ff9da6", "optimizer": "#54a24b",
                 "other": "#eeeeee"}  # fmt: skip


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def _span(lane: str, row, **style) -> go.Bar:
    """One interval of ``labs.mechanisms.ddp_buckets`` as a horizontal bar, in ms."""
    width = 1e3 * (row.end - row.start)
    return go.Bar(y=[lane], x=[width], base=[1e3 * row.start], orientation="h", **style)


def ddp_buckets(table: pd.DataFrame) -> go.Figure:
    """One DDP step per rank (``labs.mechanisms.ddp_buckets``): the phases the probe timed, and
    under them each bucket's all-reduce in flight, labelled with its size; buckets in flight at
    once take a lane each."""
    fig = go.Figure()
    lanes, shown = [], set()
    for rank, g in table.groupby("rank"):
        lanes.append(f"rank {rank}")
        for row in g[g["lane"] == "compute"].itertuples():
            color = _PHASE_COLORS.get(row.name, "#999999")
            hover = f"{row.name}: %{{x:.2f}} ms<extra>rank {rank}</extra>"
            fig.add_trace(
                _span(f"rank {rank}", row, marker_color=color, name=row.name,
                      legendgroup=row.name, showlegend=row.name not in shown,
                      hovertemplate=hover)
            )  # fmt: skip
            shown.add(row.name)
        ends: list[float] = []  # per all-reduce lane, where its last bucket ended
        for row in g[g["lane"] == "all-reduce"].sort_values("start").itertuples():
            k = next((i for i, end in enumerate(ends) if end <= row.start), len(ends))
            ends[k : k + 1] = [row.end]
            lane = f"rank {rank} all-reduce" + (f" ({k + 1})" if k else "")
            if lane not in lanes:
                lanes.append(lane)
            hover = f"{_size(row.bytes)}: %{{x:.2f}} ms in flight<extra></extra>"
            fig.add_trace(
                _span(lane, row, marker_color="#f58518", text=[_size(row.bytes)],
                      textposition="inside", name="a bucket's all-reduce", legendgroup="bucket",
                      showlegend="bucket" not in shown, hovertemplate=hover)
            )  # fmt: skip
            shown.add("bucket")
    fig.update_layout(
        title="DDP, one step per rank: the buckets' all-reduces leave while backward runs",
        barmode="overlay",
        xaxis_title="ms from the step's start",
        yaxis=dict(autorange="reversed", categoryorder="array", categoryarray=lanes),
        height=160 + 40 * len(lanes),
        uniformtext_minsize=8,
        uniformtext_mode="hide",
    )
    return fig
