"""The pipeline panel: stages, micro-batches, schedule (GPipe to DualPipeV), virtual stages,
implementation and steps, Run/Stop, live per-stage progress, then the last step's timeline
measured, replayed and by the closed form."""

from __future__ import annotations

import threading

import ipywidgets as W

from .. import experiment
from ..config import PIPELINE_IMPLS, RunConfig
from ..pipeline_schedules import chunks_per_rank, implementation, spec
from ..plots import pipeline as pipeline_charts
from ..records import step_bubbles
from ..registry import PIPELINES, STRATEGIES
from .base import BackgroundRun


class PipelinePanel(BackgroundRun):
    """Sliders for P, M and steps, a schedule and impl picker, Run/Stop, and a Gantt chart."""

    def __init__(self, base: RunConfig, max_stages: int = 4, factories: dict | None = None):
        super().__init__()
        self.base = base
        self.factories = factories or {}  # model_fn, data_fn, loss_fn, optimizer_fn
        self.result: experiment.RunResult | None = None
        self.figure = None
        style = {"description_width": "initial"}
        self.stages = W.IntSlider(
            value=base.stages, min=1, max=max_stages, description="stages P", style=style
        )
        self.microbatches = W.Dropdown(
            options=[1, 2, 4, 8, 16],
            value=base.microbatches,
            description="micro-batches M",
            style=style,
            layout={"width": "220px"},
        )
        self.steps = W.IntSlider(value=base.steps, min=2, max=100, description="steps", style=style)
        self.schedule = W.Dropdown(
            options=list(PIPELINES),
            value=base.strategy,
            description="schedule",
            style=style,
            layout={"width": "260px"},
        )
        self.impl = W.ToggleButtons(
            options=list(PIPELINE_IMPLS), value=base.pipeline_impl, style={"button_width": "80px"}
        )
        self.virtual = W.IntSlider(
            value=chunks_per_rank(STRATEGIES[base.strategy].schedule, base.virtual_stages),
            min=1,
            max=4,
            description="virtual stages v",
            style=style,
        )
        self.controls = W.HBox(
            [
                W.VBox([self.stages, self.microbatches, self.steps]),
                W.VBox([self.schedule, self.virtual, W.HBox([W.Label("impl"), self.impl])]),
            ]
        )
        self.widget = self.layout()
        for control in (self.stages, self.microbatches, self.steps, self.impl, self.virtual):
            control.observe(lambda _: self._check_controls(), names="value")
        self.schedule.observe(self._schedule_picked, names="value")
        self._check_controls()

    def config(self) -> RunConfig:
        P, schedule = self.stages.value, STRATEGIES[self.schedule.value].schedule
        naive = schedule == "model_parallel"
        takes_v = "virtual_stages" in STRATEGIES[self.schedule.value].knobs
        return self.base.replace(
            strategy=self.schedule.value,
            world_size=P,
            stages=P,
            microbatches=1 if naive else self.microbatches.value,
            steps=self.steps.value,
            pipeline_impl=self.impl.value,
            virtual_stages=self.virtual.value if takes_v else None,
        )

    def plan(self) -> str:
        cfg = self.config()  # raises ValueError with the fix
        schedule = STRATEGIES[cfg.strategy].schedule
        v = chunks_per_rank(schedule, cfg.virtual_stages)
        impl = implementation(schedule, cfg.pipeline_impl)
        return f"{cfg.strategy} P={cfg.stages} M={cfg.microbatches} v={v} ({impl})"

    def _schedule_picked(self, change) -> None:
        """A schedule with a fixed number of chunks per rank shows it; one that takes any shows
        its default."""
        self.virtual.value = chunks_per_rank(STRATEGIES[change["new"]].schedule)
        self._check_controls()

    def _check_controls(self) -> None:
        s = STRATEGIES[self.schedule.value]
        naive = s.schedule == "model_parallel"
        self.microbatches.disabled = naive  # the naive split runs one micro-batch
        self.impl.disabled = naive
        # v: a knob of the interleaved schedules; fixed (2) for the V-shaped ones
        self.virtual.disabled = "virtual_stages" not in s.knobs or bool(spec(s.schedule).virtual)
        self.check_controls()

    def execute(self, cancel: threading.Event) -> experiment.RunResult:
        cfg = self.config()
        rows = self.progress_bars([f"stage {r}" for r in range(cfg.ranks)], cfg.steps)

        def progress(rank: int, metrics: dict) -> None:
            bar, text = rows[rank]
            bar.value = metrics["step"]
            text.value = f"step {metrics['step']}/{metrics['total']}"

        self.result = experiment.run(cfg, on_progress=progress, cancel=cancel, **self.factories)
        return self.result

    def render(self, result: experiment.RunResult) -> list:
        cfg = result.cfg
        self.figure = pipeline_charts.gantt_vs_theory(
            last_step_events(result.records),
            result.records["schedule"].iloc[0],
            cfg.stages,
            int(result.records["microbatches"].iloc[0]),
        )
        notes = "".join(
            f"<p style='color:#555'>{n}</p>" for n in result.notes if "latency-bound" in n
        )
        return [notes, self.figure] if notes else [self.figure]

    def last_records(self):
        return self.result.records if self.result is not None else None

    def bubble(self) -> float:
        """Median over steps of the stages' mean idle share in the last run."""
        return float(step_bubbles(self.result.records).median())

    def done_message(self, result: experiment.RunResult) -> str:
        df = result.records
        replayed = step_bubbles(df, column="bubble_replay").median()
        steps = df["step"].nunique()
        return (
            f"done: {self.plan()}: bubble, median of {steps} steps: measured "
            f"{self.bubble():.2f}, replayed {replayed:.2f}, closed form "
            f"{df['bubble_theory'].iloc[0]:.2f} (the chart shows the last step alone)"
        )


def last_step_events(records) -> list[dict]:
    """Every stage's events of the last measured step, on the shared clock."""
    last = records[records["step"] == records["step"].max()]
    return [e for evs in last["events"] for e in evs]


def pipeline_panel(
    base: RunConfig | None = None, *, run_now: bool = False, max_stages: int = 4, **factories
) -> PipelinePanel:
    """Build the panel. Display it, then ``panel.run()`` runs the default settings once in the
    cell; ``run_now=True`` runs them before returning instead. ``model_fn`` etc.: your own
    pieces (``labkit.factories``)."""
    panel = PipelinePanel(base or RunConfig(strategy="pipeline_1f1b"), max_stages, factories)
    if run_now:
        panel.run_or_raise()
    return panel
