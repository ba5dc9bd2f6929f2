"""The data-parallel panel: a world-size slider, a strategy picker, batch and steps, Run/Stop,
live per-rank progress, then the comparison table and its charts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import ipywidgets as W
import pandas as pd

from .. import experiment, plots, report
from ..config import RunConfig
from ..env import oversubscription, probe
from ..records import LiveLoss, config_label, summarize
from ..registry import STRATEGIES
from .base import BackgroundRun


def world_sizes_upto(n: int) -> list[int]:
    """1, powers of two below n, and n: enough points for a scaling curve, few enough to be
    quick."""
    return sorted({1, n, *[2**k for k in range(1, n.bit_length()) if 2**k <= n]})


class RunPanel(BackgroundRun):
    """World-size slider, strategy picker, batch and steps, Run/Stop, live per-rank progress."""

    def __init__(
        self,
        base: RunConfig,
        strategies: Sequence[str],
        selected: Sequence[str],
        max_world_size: int | None = None,
        charts: Callable[[pd.DataFrame, pd.DataFrame], list] | None = None,
        factories: dict | None = None,
    ):
        super().__init__()
        self.factories = factories or {}  # model_fn, data_fn, loss_fn, optimizer_fn
        env = probe()
        self.device = env.device
        top = max_world_size or (
            env.max_world_size if env.device == "cuda" else max(2, 2 * env.max_world_size)
        )
        self.base, self.charts = base, charts or _default_charts
        self.records: pd.DataFrame | None = None
        self.table: pd.DataFrame | None = None
        self.finished: list[pd.DataFrame] = []  # records of each run done so far
        style = {"description_width": "initial"}
        self.world = W.IntSlider(
            value=min(base.world_size, top),
            min=1,
            max=top,
            description="max world size",
            style=style,
        )
        self.strategies = W.SelectMultiple(
            options=list(strategies),
            value=tuple(selected),
            rows=min(6, len(strategies)),
            description="strategies",
        )
        self.batch = W.IntText(
            value=base.global_batch,
            description="global batch",
            style=style,
            layout={"width": "200px"},
        )
        self.steps = W.IntSlider(value=base.steps, min=5, max=200, step=5, description="steps")
        self.controls = W.HBox([W.VBox([self.world, self.batch, self.steps]), self.strategies])
        self.widget = self.layout()
        for control in (self.world, self.strategies, self.batch, self.steps):
            control.observe(lambda _: self._check_controls(), names="value")
        self._check_controls()

    def configs(self) -> list[RunConfig]:
        base = self.base.replace(global_batch=self.batch.value, steps=self.steps.value)
        return experiment.grid(base, self.strategies.value, world_sizes_upto(self.world.value))

    def plan(self) -> str:
        configs = self.configs()  # raises ValueError with the fix
        if not configs:
            raise ValueError("no strategy selected: pick at least one")
        return ", ".join(config_label(c) for c in configs)

    def _check_controls(self) -> None:
        warn = oversubscription(self.world.value) if self.device == "cpu" else None
        self.check_controls(f"<br><span style='color:#b00'>{warn}</span>" if warn else "")

    def execute(self, cancel: threading.Event) -> pd.DataFrame:
        self.finished = []
        configs = self.configs()
        self._live: dict = {}
        records = experiment.compare(
            configs,
            on_progress=self._progress,
            cancel=cancel,
            on_result=lambda r: self.finished.append(r.records),
            **self.factories,
        )
        self.records, self.table = records, summarize(records)
        return records

    def partial(self) -> pd.DataFrame | None:
        if not self.finished:
            return None
        self.records = pd.concat(self.finished, ignore_index=True)
        self.table = summarize(self.records)
        return self.records

    def last_records(self) -> pd.DataFrame | None:
        return self.records

    def render(self, records: pd.DataFrame) -> list:
        table = summarize(records)
        note = report.busy_note(table)
        out = [report.people_table(table)]
        if note:
            out.append(f"<p style='color:#b00'>{note}</p>")
        return out + list(self.charts(records, table))

    def done_message(self, records: pd.DataFrame) -> str:
        runs = records.groupby(["strategy", "world_size", "threads"]).ngroups
        return f"done: {runs} runs, {len(records)} records (median step, slowest rank)"

    def _progress(self, cfg: RunConfig, rank: int, metrics: dict) -> None:
        if self._live.get("cfg") is not cfg:
            labels = [f"rank {r}" for r in range(cfg.ranks)]
            self._live = {
                "cfg": cfg,
                "bars": self.progress_bars(labels, metrics["total"]),
                "loss": LiveLoss(cfg.ranks),
            }
            self.status.value = f"running <b>{config_label(cfg)}</b> on {cfg.ranks} process(es)"
        bar, text = self._live["bars"][rank]
        bar.value = metrics["step"]
        text.value = f"step {metrics['step']}/{metrics['total']}"
        latest = self._live["loss"].update(rank, metrics)
        if latest is not None:
            self.status.value = (
                f"running <b>{config_label(cfg)}</b>: step "
                f"{latest[0]}, loss {latest[1]:.4f} (global batch)"
            )


def _default_charts(records: pd.DataFrame, table: pd.DataFrame) -> list:
    return [plots.throughput(table), plots.breakdown(records)]


def run_panel(
    base: RunConfig | None = None,
    strategies: Sequence[str] | None = None,
    selected: Sequence[str] = ("single", "ddp"),
    *,
    run_now: bool = False,
    max_world_size: int | None = None,
    charts=None,
    **factories,
) -> RunPanel:
    """Build the panel. Display it, then ``panel.run()`` runs the default selection once in the
    cell (its bars move as it goes); ``run_now=True`` runs it before returning instead.
    ``model_fn``, ``data_fn``, ``loss_fn``, ``optimizer_fn``: your own pieces
    (``labkit.factories``)."""
    panel = RunPanel(
        base or RunConfig(),
        strategies or list(STRATEGIES),
        selected,
        max_world_size,
        charts,
        factories,
    )
    if run_now:
        panel.run_or_raise()
    return panel
