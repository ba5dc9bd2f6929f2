"""The sync/async panel: pick modes, set a straggler (rank 1 computes N times slower), the
averaging period H and the staleness-aware lr, press Run; every run so far goes into one
to-target table, loss against wall time and bytes, and the staleness histogram."""

from __future__ import annotations

import threading

import ipywidgets as W
import pandas as pd

from .. import experiment, registry
from ..config import RunConfig
from ..labs import sync_async
from ..plots import sync_async as charts
from ..records import config_label, kept_apart
from ..registry import SYNC_ASYNC
from .base import BackgroundRun


class SyncPanel(BackgroundRun):
    """Modes, straggler, period H, staleness lr, steps; each Run adds its runs to the table."""

    def __init__(self, base: RunConfig, modes=SYNC_ASYNC, factories: dict | None = None):
        super().__init__()
        self.base, self.factories = base, factories or {}
        self.finished: list[pd.DataFrame] = []
        style = {"description_width": "initial"}
        self.modes = W.SelectMultiple(
            options=list(SYNC_ASYNC), value=tuple(modes), description="modes", rows=5, style=style
        )
        self.straggler = W.FloatSlider(
            value=1.0,
            min=1.0,
            max=4.0,
            step=0.5,
            style=style,
            description="rank 1 slowdown",
            readout_format=".1f",
        )
        self.period = W.IntSlider(
            value=base.period, min=1, max=16, description="period H", style=style
        )
        self.staleness_lr = W.Checkbox(value=base.staleness_lr, description="staleness-aware lr")
        self.steps = W.IntSlider(value=base.steps, min=10, max=200, step=10, description="steps")
        self.controls = W.HBox(
            [self.modes, W.VBox([self.straggler, self.period, self.staleness_lr, self.steps])]
        )
        self.widget = self.layout()
        for control in (self.modes, self.straggler, self.period, self.staleness_lr, self.steps):
            control.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    def configs(self) -> list[RunConfig]:
        if not self.modes.value:
            raise ValueError("pick at least one mode")
        base = self.base.replace(
            period=self.period.value, staleness_lr=self.staleness_lr.value, steps=self.steps.value
        )
        return sync_async.sweep(base, self.modes.value, straggler=self.straggler.value)

    def plan(self) -> str:
        return ", ".join(config_label(c) for c in self.configs())

    def execute(self, cancel: threading.Event) -> pd.DataFrame:
        configs = self.configs()
        labels = self._labels = [config_label(c) for c in configs]
        self._bars = dict(zip(labels, self.progress_bars(labels, self.steps.value)))
        experiment.compare(
            configs,
            on_progress=self._progress,
            cancel=cancel,
            on_result=lambda res: self.finished.append(res.records),
            **self.factories,
        )
        return self.records

    @property
    def records(self) -> pd.DataFrame | None:
        return kept_apart(self.finished) if self.finished else None

    def partial(self) -> pd.DataFrame | None:
        return self.records

    def last_records(self) -> pd.DataFrame | None:
        return self.finished[-1] if self.finished else None

    def table(self, records: pd.DataFrame) -> tuple[pd.DataFrame, float]:
        target = sync_async.default_target(records)
        return sync_async.to_target(records, target), target

    def render(self, records: pd.DataFrame) -> list:
        table, target = self.table(records)
        curves = sync_async.updates(records)
        out = [
            f"<b>to a loss of {target:.3f}</b> (smoothed; the same target for every run so far)",
            sync_async.people_table(table),
            charts.loss_curves(curves, "time_s", target),
            charts.loss_curves(curves, "bytes", target),
        ]
        stale = sync_async.staleness(records)
        if len(stale):
            out.append(charts.staleness_histogram(stale))
        if table["busy"].any():
            out.insert(
                2,
                "<p style='color:#b00'>the machine was busy during runs marked busy: "
                "their times measure other programs too</p>",
            )
        return out

    def done_message(self, records: pd.DataFrame) -> str:
        table, target = self.table(records)
        fastest = table.dropna(subset=["seconds_to_target"])
        best = (
            ""
            if fastest.empty
            else (
                f"; fastest to {target:.3f}: "
                f"{fastest.loc[fastest['seconds_to_target'].idxmin(), 'run']}"
            )
        )
        return f"done: {', '.join(self._labels)}; {len(table)} run(s) in the table{best}"

    def _progress(self, cfg: RunConfig, rank: int, metrics: dict) -> None:
        if rank != 0:  # rank 0: steps, or the parameter server's updates
            return
        bar, text = self._bars[config_label(cfg)]
        step, loss = metrics["step"], f"loss {metrics['loss']:.3f}"
        strategy = registry.get(cfg.strategy)
        if strategy.server:  # rank 0 is the server: it counts every worker's update
            total = metrics["total"]
            text.value = f"server: {step}/{total} updates ({cfg.world_size - 1} workers), {loss}"
        elif strategy.kind == "asynchronous":  # the run ends at world_size x steps updates in all
            total = cfg.steps  # rank 0's share of them; a faster rank makes more than its share
            text.value = (
                f"rank 0: {step} updates (its share {total} of {cfg.world_size * total}), {loss}"
            )
        else:
            total = cfg.steps
            text.value = f"step {step}/{total}, {loss}"
        bar.max, bar.value = total, min(step, total)


def sync_panel(
    base: RunConfig | None = None, modes=SYNC_ASYNC, *, run_now: bool = False, **factories
) -> SyncPanel:
    """Build the panel (``base``: the task every mode trains; async_ps gets one more rank, its
    server). ``run_now=True`` runs the preset once before returning."""
    panel = SyncPanel(base or RunConfig(steps=40, width=256, depth=2), modes, factories)
    if run_now:
        panel.run_or_raise()
    return panel
