"""Figures of the long-sequences lab (``labkit.labs.long_sequences``, notebook 14): the ring's
steps drawn from the schedule the code runs, each rank's attention work with and without
zig-zag, what grows with the sequence, bytes and memory per rank beside their predictions."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

# one colour per rank (as the registry's charts do per strategy)
_RANK_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6",
                "#9d755d")  # fmt: skip
_SKIPPED, _LATER = "#f2f2f2", "#ffffff"
_KIND_MARK = {"full": "", "diagonal": " ◣", "skipped": ""}


def _frame(steps: pd.DataFrame, upto: int, chunks: int, n: int) -> list:
    """The chunk grid after step ``upto``: a cell per (query chunk, key chunk), coloured by the
    rank that computed it (its step written in), grey where causality skips it, white until
    its step comes."""
    z = [[None] * chunks for _ in range(chunks)]
    text = [[""] * chunks for _ in range(chunks)]
    for row in steps.itertuples():
        q, k = row.q_chunk, row.k_chunk
        if row.kind == "skipped":
            z[q][k], text[q][k] = -1, "·"
        elif row.step <= upto:
            z[q][k] = row.rank
            text[q][k] = f"r{row.rank} s{row.step}{_KIND_MARK[row.kind]}"
    scale = [(0.0, _SKIPPED), (1 / (n + 1), _SKIPPED)]
    for r in range(n):
        colour = _RANK_COLORS[r % len(_RANK_COLORS)]
        scale += [((r + 1) / (n + 1), colour), ((r + 2) / (n + 1), colour)]
    return [
        go.Heatmap(
            z=z,
            zmin=-1,
            zmax=n,
            text=text,
            texttemplate="%{text}",
            colorscale=scale,
            showscale=False,
            xgap=2,
            ygap=2,
            hovertemplate="query chunk %{y}, key chunk %{x}: %{text}<extra></extra>",
        )
    ]


def _holds(steps: pd.DataFrame, s: int) -> str:
    at = steps[steps["step"] == s].drop_duplicates("rank").sort_values("rank")
    return ", ".join(f"r{r} holds K,V of r{k}" for r, k in zip(at["rank"], at["kv_from"]))


def ring_steps(steps: pd.DataFrame, layout: str) -> go.Figure:
    """The ring, step by step (``long_sequences.ring_steps``): the sequence's attention matrix
    cut into chunks (query chunks down, key chunks across); at step s each rank computes its
    queries against the keys and values it holds then, and a slider (and Play) adds one step
    at a time. A cell says which rank computed it and at which step (◣: the diagonal tile,
    masked inside); grey: skipped, every key after every query."""
    n = int(steps["rank"].max()) + 1
    chunks = int(max(steps["q_chunk"].max(), steps["k_chunk"].max())) + 1
    total = int(steps["step"].max()) + 1
    names = [f"step {s}" for s in range(total)]
    frames = [
        go.Frame(
            data=_frame(steps, s, chunks, n),
            name=name,
            layout=go.Layout(title_text=f"{layout}, {name}: {_holds(steps, s)}"),
        )
        for s, name in enumerate(names)
    ]
    fig = go.Figure(data=frames[0].data, frames=frames)
    ticks = dict(tickvals=list(range(chunks)), ticktext=[f"c{i}" for i in range(chunks)])
    fig.update_layout(
        title=f"{layout}, step 0: {_holds(steps, 0)}",
        title_font_size=13,
        xaxis=dict(title="key chunk", side="top", **ticks),
        yaxis=dict(title="query chunk", autorange="reversed", **ticks),
        height=220 + 42 * chunks,
        width=260 + 48 * chunks,
        margin=dict(t=110, b=90),
        updatemenus=[_play(900)],
        sliders=[_slider(names)],
    )
    return fig


def _play(ms: int) -> dict:
    args = [None, dict(frame=dict(duration=ms, redraw=True), fromcurrent=True)]
    button = dict(label="Play", method="animate", args=args)
    return dict(type="buttons", showactive=False, x=0.0, y=-0.14, xanchor="left", buttons=[button])


def _slider(names) -> dict:
    steps = [
        dict(
            label=name,
            method="animate",
            args=[[name], dict(mode="immediate", frame=dict(duration=0, redraw=True))],
        )
        for name in names
    ]
    return dict(
        active=0, x=0.12, len=0.88, y=-0.06, currentvalue=dict(prefix="after "), steps=steps
    )


def work(tables: dict[str, pd.DataFrame], measured: dict[str, pd.DataFrame] | None = None):
    """Each rank's attention work per layout (``long_sequences.work``: FLOPs counted from the
    schedule, in (s/2N)^2 tiles), and where given, the compute seconds each rank measured
    (``long_sequences.per_rank``) on a second axis: the slowest rank gates every step."""
    fig = go.Figure()
    for i, (layout, df) in enumerate(tables.items()):
        fig.add_bar(
            x=[f"rank {r}" for r in df["rank"]],
            y=df["flops_forward"],
            name=f"{layout}: counted",
            marker_color=_RANK_COLORS[i],
            offsetgroup=layout,
        )
    for i, (layout, df) in enumerate((measured or {}).items()):
        fig.add_scatter(
            x=[f"rank {r}" for r in df["rank"]],
            y=df["compute_s"],
            name=f"{layout}: measured compute s",
            mode="markers+lines",
            marker=dict(color=_RANK_COLORS[i], size=11, symbol="diamond"),
            yaxis="y2",
        )
    fig.update_layout(
        title="attention work per rank: counted from the schedule, and measured",
        barmode="group",
        yaxis=dict(title=f"forward work ({next(iter(tables.values())).attrs.get('units', '')})"),
        yaxis2=dict(title="compute seconds", overlaying="y", side="right", rangemode="tozero"),
        legend=dict(orientation="h", y=-0.2),
        height=380,
    )
    return fig


def growth(table: pd.DataFrame) -> go.Figure:
    """One layer's activations for one sequence by the calculator
    (``long_sequences.attention_growth``): the per-token part and the attention scores', which
    grows with s^2."""
    fig = go.Figure()
    x = [f"{s:,}" for s in table["seq"]]
    fig.add_bar(x=x, y=table["per_token_GB"], name="per token: 34 s b h", marker_color="#4c78a8")
    fig.add_bar(x=x, y=table["scores_GB"], name="scores: 5 a s² b", marker_color="#e45756")
    fig.update_layout(
        title="one layer's activations, one sequence (GB, log scale)",
        barmode="group",
        xaxis_title="sequence length s",
        yaxis=dict(type="log", title="GB"),
        height=360,
    )
    return fig


def per_rank_bars(table: pd.DataFrame, value: str, predicted: str, title: str) -> go.Figure:
    """A measured column per rank (bars) beside its prediction (a marker), e.g. activation
    bytes against single's / N, or bytes sent against the formula."""
    label = [f"N={n} r{r}" for n, r in zip(table["n"], table["rank"])]
    fig = go.Figure()
    fig.add_bar(x=label, y=table[value], name="measured", marker_color="#4c78a8")
    fig.add_scatter(
        x=label,
        y=table[predicted],
        name="predicted",
        mode="markers",
        marker=dict(symbol="line-ew-open", size=28, line=dict(width=3, color="#e45756")),
    )
    fig.update_layout(title=title, height=340, legend=dict(orientation="h", y=-0.25))
    return fig
