"""A pipeline panel: stages, micro-batches, schedule and implementation, Run/Stop, live progress,
then the measured timeline beside the schedule theory predicts.

Like ``widgets.RunPanel`` (whose controls are about world sizes and strategy grids, not P and M),
Run works in a background thread so Stop can cancel, and ``pipeline_panel(run_now=True)`` runs
the default configuration once so an unattended notebook still draws its chart.
"""
from __future__ import annotations

import html
import threading

import ipywidgets as W

from . import experiment, timeline
from .config import PIPELINE_STRATEGIES, RunConfig
from .launch import LaunchCancelled
from .widgets import BackgroundRun


class PipelinePanel(BackgroundRun):
    """Sliders for P and M, a schedule and impl picker, Run/Stop, and a Gantt chart."""

    def __init__(self, base: RunConfig, max_stages: int = 4):
        self.base = base
        self.result: experiment.RunResult | None = None
        self.figure = None
        self.error: BaseException | None = None
        self._cancel = threading.Event()
        style = {"description_width": "initial"}
        self.stages = W.IntSlider(value=base.stages, min=1, max=max_stages, description="stages P",
                                  style=style)
        self.microbatches = W.Dropdown(options=[1, 2, 4, 8, 16], value=base.microbatches,
                                       description="micro-batches M", style=style)
        self.schedule = W.Dropdown(options=list(PIPELINE_STRATEGIES), value=base.strategy,
                                   description="schedule")
        self.impl = W.ToggleButtons(options=["scratch", "torch"], value=base.pipeline_impl,
                                    description="impl")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True)
        self.status, self.bars, self.out = W.HTML(), W.VBox(), W.Output()
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self._cancel.set())
        controls = W.HBox([W.VBox([self.stages, self.microbatches]),
                           W.VBox([self.schedule, self.impl]),
                           W.VBox([self.run_button, self.stop_button])])
        self.widget = W.VBox([controls, self.status, self.bars, self.out])

    def _ipython_display_(self):
        from IPython.display import display
        display(self.widget)

    def config(self) -> RunConfig:
        P = self.stages.value
        return self.base.replace(strategy=self.schedule.value, world_size=P, stages=P,
                                 microbatches=self.microbatches.value,
                                 pipeline_impl=self.impl.value)

    def run(self):
        """Run the current settings in this thread; returns the RunResult (None if stopped)."""
        self._cancel.clear()
        self.error = None
        self.run_button.disabled, self.stop_button.disabled = True, False
        try:
            cfg = self.config()
            self.bars.children = [W.IntProgress(value=0, max=cfg.warmup + cfg.steps,
                                                description=f"stage {r}") for r in range(cfg.ranks)]
            self.status.value = f"running <b>{cfg.strategy}</b> P={cfg.stages} M={cfg.microbatches}"
            self.result = experiment.run(cfg, on_progress=self._progress, cancel=self._cancel)
            self.figure = self._figure(cfg)
            self.status.value = (f"done: median bubble {self.bubble():.2f}, theory "
                                 f"{timeline.theory_bubble(cfg.stages, self._m(cfg)):.2f}")
            self.out.clear_output(wait=True)
            with self.out:
                from IPython.display import display
                display(self.figure)
            return self.result
        except LaunchCancelled:
            self.status.value = "<b>stopped</b>: every rank was terminated"
        except Exception as exc:
            self.error = exc
            self.status.value = f"<b style='color:#b00'>error</b>: {html.escape(str(exc))}"
        finally:
            self.run_button.disabled, self.stop_button.disabled = False, True
        return None

    def bubble(self) -> float:
        """Median over steps of the stages' mean idle share in the last run."""
        df = self.result.records
        return float(df.groupby("step")["bubble_fraction"].mean().median())

    def _progress(self, rank: int, metrics: dict) -> None:
        self.bars.children[rank].value = metrics["step"]

    def _figure(self, cfg: RunConfig):
        events = last_step_events(self.result.records)
        return timeline.gantt_vs_theory(events, self.result.records["schedule"].iloc[0],
                                        cfg.stages, self._m(cfg))

    @staticmethod
    def _m(cfg: RunConfig) -> int:
        return 1 if cfg.strategy == "model_parallel" else cfg.microbatches


def last_step_events(records) -> list[dict]:
    """Every stage's events of the last measured step, on the shared clock."""
    last = records[records["step"] == records["step"].max()]
    return [e for evs in last["events"] for e in evs]


def pipeline_panel(base: RunConfig | None = None, *, run_now: bool = True,
                   max_stages: int = 4) -> PipelinePanel:
    """Build the panel; with ``run_now`` it runs the default settings once before returning."""
    panel = PipelinePanel(base or RunConfig(strategy="pipeline_1f1b"), max_stages)
    if run_now:
        panel.run()
        if panel.error is not None:
            raise panel.error
    return panel
