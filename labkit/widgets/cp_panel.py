"""The context-parallel panel: sequence length, cp degree N, ring or Ulysses, zig-zag or not,
repeats; Run/Stop; live per-rank progress; then one attention layer's forward and backward
measured on N ranks (``labkit.labs.long_sequences.measure``): each rank's attention work
counted from the ring's schedule beside the compute seconds it measured, and the bytes it sent
beside the formula, every run so far in one table."""

from __future__ import annotations

import threading

import ipywidgets as W
import pandas as pd

from ..labs import long_sequences as ls
from ..plots import long_sequences as charts
from .base import BackgroundRun

SEQ_LENS = (256, 512, 1024, 2048, 4096)
DEGREES = (1, 2, 4)


class CPPanel(BackgroundRun):
    """Controls for one attention layer split over N ranks; each Run adds a row per rank."""

    def __init__(self, seq_len: int = 1024, n: int = 2, method: str = "ring", zigzag: bool = True):
        super().__init__()
        style = {"description_width": "initial"}
        self.seq_len = W.Dropdown(
            options=list(SEQ_LENS), value=seq_len, description="sequence s", style=style
        )
        self.n = W.ToggleButtons(
            options=list(DEGREES), value=n, description="cp degree N", style=style
        )
        self.method = W.ToggleButtons(
            options=list(ls.METHODS), value=method, description="attention", style=style
        )
        self.zigzag = W.Checkbox(value=zigzag, description="zig-zag placement", indent=False)
        self.repeats = W.IntSlider(value=2, min=1, max=10, description="repeats", style=style)
        self.controls = W.VBox(
            [W.HBox([self.seq_len, self.repeats]), self.n, self.method, self.zigzag]
        )
        self.shape = dict(batch=1, heads=8, head_dim=32)  # h = 256
        self.runs: list[pd.DataFrame] = []  # per-rank medians of every run, in order
        self.widget = self.layout()
        for control in (self.seq_len, self.n, self.method, self.zigzag, self.repeats):
            control.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    @property
    def layout_name(self) -> str:
        return "zigzag" if self.zigzag.value else "contiguous"

    def plan(self) -> str:
        n, s = self.n.value, self.seq_len.value
        pieces = n * (2 if self.zigzag.value else 1)
        if s % pieces:
            raise ValueError(f"s = {s} does not cut into {pieces} equal chunks: pick another s")
        if self.method.value == "ulysses" and self.shape["heads"] % n:
            raise ValueError(f"Ulysses gives each rank whole heads: {self.shape['heads']} over {n}")
        return (
            f"{self.method.value} attention, {self.layout_name}, s = {s} over N = {n} rank(s), "
            f"{self.repeats.value} repeat(s)"
        )

    def planned_ranks(self) -> int | None:
        return self.n.value

    def execute(self, cancel: threading.Event) -> pd.DataFrame:
        n = self.n.value
        bars = self.progress_bars([f"rank {r}" for r in range(n)], 1 + self.repeats.value)

        def progress(rank: int, metrics: dict) -> None:
            bar, text = bars[rank]
            bar.max, bar.value = metrics["total"], metrics["step"]
            text.value = f"pass {metrics['step']}/{metrics['total']} (the first warms up)"

        measured = ls.measure(
            n,
            self.layout_name,
            self.method.value,
            seq_len=self.seq_len.value,
            repeats=self.repeats.value,
            on_progress=progress,
            cancel=cancel,
            **self.shape,
        )
        self.last = measured
        rows = ls.per_rank(measured)
        want = ls.bytes_formula(
            self.method.value,
            n,
            batch=self.shape["batch"],
            seq_len=self.seq_len.value,
            hidden=self.shape["heads"] * self.shape["head_dim"],
        )
        rows.insert(
            0, "run", f"{self.method.value} {self.layout_name} s={self.seq_len.value} N={n}"
        )
        rows["formula_bytes_forward"] = want["forward"]
        rows["formula_bytes_backward"] = want["backward"]
        self.runs.append(rows)
        return pd.concat(self.runs, ignore_index=True)

    def render(self, table: pd.DataFrame) -> list:
        latest = self.runs[-1]
        counted = ls.work(self.n.value, self.layout_name, seq_len=self.seq_len.value, **self.shape)
        measured = {self.layout_name: latest} if self.method.value == "ring" else None
        figure = charts.work({self.layout_name: counted}, measured)
        shown = table.drop(columns=["flops_forward"]).rename(
            columns={"compute_s": "ring_compute_s"}
        )
        return [figure, shown]

    def done_message(self, table: pd.DataFrame) -> str:
        latest = self.runs[-1]
        slowest = latest["forward_s"].add(latest["backward_s"]).max()
        sent = latest["bytes_forward"].iloc[0] + latest["bytes_backward"].iloc[0]
        want = latest["formula_bytes_forward"].iloc[0] + latest["formula_bytes_backward"].iloc[0]
        return (
            f"done: {latest['run'].iloc[0]}: slowest rank {slowest:.3f} s forward + backward; "
            f"rank 0 sent {sent:,.0f} bytes, the formula {want:,.0f} ({len(self.runs)} run(s) "
            f"in the table)"
        )


def cp_panel(
    seq_len: int = 1024, n: int = 2, method: str = "ring", zigzag: bool = True, *, run_now=False
) -> CPPanel:
    """Build the panel; ``run_now=True`` runs its settings once before returning."""
    panel = CPPanel(seq_len, n, method, zigzag)
    if run_now:
        panel.run_or_raise()
    return panel
