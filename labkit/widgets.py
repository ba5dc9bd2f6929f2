"""ipywidgets panels that build RunConfigs, launch them and chart the result.

A panel runs in a background thread when you click Run, so Stop can cancel it (a busy cell would
hold the click until it finished). ``run_panel(..., run_now=True)`` also runs the default
configuration once, synchronously, so a notebook executed unattended still draws its charts.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence

import ipywidgets as W
import pandas as pd

from . import experiment, plots
from .config import STRATEGY_RANKS, RunConfig
from .env import oversubscription, probe
from .launch import LaunchCancelled


def world_sizes_upto(n: int) -> list[int]:
    """1, powers of two below n, and n: enough points for a scaling curve, few enough to be quick."""
    return sorted({1, n, *[2**k for k in range(1, n.bit_length()) if 2**k <= n]})


class BackgroundRun:
    """``start()`` runs ``self.run`` in a thread (what a Run button does, so Stop stays
    clickable); ``wait()`` joins it, for unattended notebooks."""

    _thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self.run, daemon=True)
            self._thread.start()
        return self._thread

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


class RunPanel(BackgroundRun):
    """World-size slider, strategy picker, batch and steps, Run/Stop, live per-rank progress."""

    def __init__(self, base: RunConfig, strategies: Sequence[str], selected: Sequence[str],
                 max_world_size: int | None = None,
                 charts: Callable[[pd.DataFrame, pd.DataFrame], list] | None = None):
        env = probe()
        honest = env.max_world_size
        top = max_world_size or (honest if env.device == "cuda" else max(2, 2 * honest))
        self.base, self.charts = base, charts or _default_charts
        self.records: pd.DataFrame | None = None
        self.table: pd.DataFrame | None = None
        self.error: BaseException | None = None
        self._cancel = threading.Event()

        style = {"description_width": "initial"}
        self.world = W.IntSlider(value=min(base.world_size, top), min=1, max=top,
                                 description="max world size", style=style)
        self.strategies = W.SelectMultiple(options=list(strategies), value=tuple(selected),
                                           rows=min(6, len(strategies)), description="strategies")
        self.batch = W.IntText(value=base.global_batch, description="global batch", style=style)
        self.steps = W.IntSlider(value=base.steps, min=5, max=200, step=5, description="steps")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True)
        self.status = W.HTML()
        self.bars = W.VBox()
        self.out = W.Output()
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self._cancel.set())
        self.world.observe(lambda _: self._warn(env.device), names="value")
        self._warn(env.device)
        controls = W.HBox([W.VBox([self.world, self.batch, self.steps]), self.strategies,
                           W.VBox([self.run_button, self.stop_button])])
        self.widget = W.VBox([controls, self.status, self.bars, self.out])

    def _ipython_display_(self):            # `panel` as a cell's last line shows the widget
        from IPython.display import display
        display(self.widget)

    def configs(self) -> list[RunConfig]:
        base = self.base.replace(global_batch=self.batch.value, steps=self.steps.value)
        return experiment.grid(base, self.strategies.value, world_sizes_upto(self.world.value))

    def run(self) -> pd.DataFrame | None:
        """Run the current selection in this thread; returns the records (None if stopped)."""
        self._cancel.clear()
        self.error = None
        self.run_button.disabled, self.stop_button.disabled = True, False
        try:
            configs = self.configs()            # bad input: say so in the panel, lose nothing
            self.records = experiment.compare(configs, on_progress=self._progress,
                                              cancel=self._cancel)
            self.table = experiment.summarize(self.records)
            self.status.value = f"done: {len(configs)} runs, {len(self.records)} records"
            self._draw()
            return self.records
        except LaunchCancelled:
            self.status.value = "<b>stopped</b>: every rank was terminated"
        except Exception as exc:                # shown in the panel; also kept for the caller
            self.error = exc
            self.status.value = f"<b style='color:#b00'>error</b>: {_escape(exc)}"
        finally:
            self.run_button.disabled, self.stop_button.disabled = False, True
        return None

    def _progress(self, cfg: RunConfig, rank: int, metrics: dict) -> None:
        key = f"{cfg.strategy}@{cfg.world_size}"
        if getattr(self, "_key", None) != key:
            self._key = key
            self.bars.children = [
                W.IntProgress(value=0, max=metrics["total"], description=f"rank {r}",
                              layout={"width": "60%"}) for r in range(cfg.ranks)]
            self.status.value = f"running <b>{key}</b> on {cfg.ranks} process(es)"
        bar = self.bars.children[rank]
        bar.value = metrics["step"]
        bar.description = f"rank {rank}: {metrics['loss']:.3f}"

    def _draw(self) -> None:
        self.out.clear_output(wait=True)
        with self.out:
            from IPython.display import display
            display(self.table)
            for fig in self.charts(self.records, self.table):
                display(fig)                # into the panel's own Output, on Run

    def _warn(self, device: str) -> None:
        msg = oversubscription(self.world.value) if device == "cpu" else None
        self.status.value = f"<span style='color:#b00'>{_escape(msg)}</span>" if msg else ""


def _default_charts(records: pd.DataFrame, table: pd.DataFrame) -> list:
    return [plots.throughput(table), plots.breakdown(records)]


def _escape(obj) -> str:
    import html
    return html.escape(str(obj))


def run_panel(base: RunConfig | None = None, strategies: Sequence[str] | None = None,
              selected: Sequence[str] = ("single", "ddp"), *, run_now: bool = True,
              max_world_size: int | None = None, charts=None) -> RunPanel:
    """Build a panel; with ``run_now`` it runs the default selection once before returning."""
    panel = RunPanel(base or RunConfig(), strategies or list(STRATEGY_RANKS), selected,
                     max_world_size, charts)
    if run_now:
        panel.run()
        if panel.error is not None:
            raise panel.error
    return panel
