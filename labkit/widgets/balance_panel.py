"""The load-balancing panel: a slowdown slider per rank, a policy picker, data skew and steps,
Run/Stop, live per-rank progress (with each rank's share of the batch), then the table of every
run so far and the charts of who computed, who waited, and how the shares moved."""

from __future__ import annotations

import threading

import ipywidgets as W
import pandas as pd

from .. import experiment, report
from ..config import REBALANCE, RunConfig
from ..plots import balance as charts
from ..records import config_label, kept_apart, summarize
from .base import BackgroundRun


class BalancePanel(BackgroundRun):
    """Per-rank slowdown sliders, policy, skew, steps; each Run adds a row to the table."""

    def __init__(self, base: RunConfig, factories: dict | None = None):
        super().__init__()
        self.base, self.factories = base.replace(strategy="ddp_naive"), factories or {}
        self.finished: list[pd.DataFrame] = []  # records of every run, in order
        style = {"description_width": "initial"}
        given = {r: f for r, f, _ in base.slowdown}
        self.slow = [
            W.FloatSlider(
                value=given.get(r, 1.0),
                min=1.0,
                max=4.0,
                step=0.25,
                description=f"rank {r} slowdown",
                style=style,
                readout_format=".2f",
            )
            for r in range(base.world_size)
        ]
        self.policy = W.ToggleButtons(
            options=list(REBALANCE), value=base.rebalance, description="policy", style=style
        )
        self.skew = W.FloatSlider(
            value=base.skew, min=0.0, max=2.0, step=0.25, description="data skew", style=style
        )
        self.steps = W.IntSlider(value=base.steps, min=5, max=60, step=5, description="steps")
        self.controls = W.VBox(
            [W.HBox([W.VBox(self.slow), W.VBox([self.skew, self.steps])]), self.policy]
        )
        self.widget = self.layout()
        for control in (*self.slow, self.policy, self.skew, self.steps):
            control.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    def config(self) -> RunConfig:
        slow = tuple((r, s.value, None) for r, s in enumerate(self.slow) if s.value > 1)
        return self.base.replace(
            slowdown=slow, rebalance=self.policy.value, skew=self.skew.value, steps=self.steps.value
        )

    def plan(self) -> str:
        return config_label(self.config())  # raises ValueError with the fix

    def execute(self, cancel: threading.Event) -> pd.DataFrame:
        cfg = self.config()
        self._bars = self.progress_bars([f"rank {r}" for r in range(cfg.ranks)], cfg.steps)
        res = experiment.run(
            cfg, on_progress=lambda r, m: self._progress(cfg, r, m), cancel=cancel, **self.factories
        )
        self.finished.append(res.records)
        return self.records

    @property
    def records(self) -> pd.DataFrame | None:
        return kept_apart(self.finished) if self.finished else None

    @property
    def table(self) -> pd.DataFrame | None:
        return summarize(self.records) if self.finished else None

    def partial(self) -> pd.DataFrame | None:
        return self.records

    def last_records(self) -> pd.DataFrame | None:
        return self.finished[-1] if self.finished else None

    def render(self, records: pd.DataFrame) -> list:
        table = summarize(records)
        note = report.busy_note(table)
        latest = self.finished[-1]
        return (
            [report.people_table(table)]
            + ([f"<p style='color:#b00'>{note}</p>"] if note else [])
            + [
                charts.rank_timeline(latest),
                charts.rank_utilisation(records),
                charts.shares_over_time(records),
            ]
        )

    def done_message(self, records: pd.DataFrame) -> str:
        row = summarize(self.finished[-1]).iloc[0]
        return (
            f"done: {row['run']}: {row['throughput_fraction']:.0%} of the ideal throughput, "
            f"ranks waited {row['wait_share']:.0%} of the time ({len(self.finished)} run(s) "
            f"in the table)"
        )

    def _progress(self, cfg: RunConfig, rank: int, metrics: dict) -> None:
        bar, text = self._bars[rank]
        bar.max, bar.value = metrics["total"], metrics["step"]
        share = metrics.get("samples", 0) / cfg.global_batch
        text.value = f"step {metrics['step']}/{metrics['total']}, share {share:.0%}"


def balance_panel(
    base: RunConfig | None = None, *, run_now: bool = False, **factories
) -> BalancePanel:
    """Build the panel (``base``: a ddp_naive config; its slowdown, policy and skew preset the
    controls). ``run_now=True`` runs the preset once before returning."""
    panel = BalancePanel(base or RunConfig(strategy="ddp_naive", slowdown="1:2"), factories)
    if run_now:
        panel.run_or_raise()
    return panel
