"""The elastic panel: Run starts a torchrun job with one node; while it trains, buttons add a
node, remove one, or kill a worker, and the chart of world size, loss and throughput redraws
about once a second. When the job ends: the table of every change (steps lost, re-form time)."""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as W

from ..config import RunConfig
from ..labs.elastic import ElasticJob, changes
from ..launch import LaunchCancelled
from ..plots.elastic import elastic_timeline
from .base import BackgroundRun

STOP_GRACE_S = 0.5  # SIGTERM, then SIGKILL what is left: a Stop answers within a second


class ElasticPanel(BackgroundRun):
    """Steps, checkpoint interval and the most nodes; Add node / Remove node / Kill a worker
    act on the running job."""

    warns_oversubscription = False  # torchrun agents: its ranks come and go while it runs

    def __init__(self, base: RunConfig, max_nodes: int = 2, redraw_s: float = 1.0):
        super().__init__()
        self.base, self.redraw_s, self.job = base.replace(strategy="ddp"), redraw_s, None
        style = {"description_width": "initial"}
        self.steps = W.IntSlider(
            value=base.steps, min=20, max=5000, step=20, description="steps", style=style
        )
        self.every = W.IntSlider(
            value=max(1, base.checkpoint_every or 10),
            min=1,
            max=200,
            description="checkpoint every",
            style=style,
        )
        self.nodes = W.IntSlider(
            value=max_nodes, min=1, max=4, description="most nodes", style=style
        )
        self.add_button = W.Button(description="Add a node", icon="plus", disabled=True)
        self.remove_button = W.Button(description="Remove a node", icon="minus", disabled=True)
        self.kill_button = W.Button(description="Kill a worker", icon="bolt", disabled=True)
        self._error_world: int | None = None  # world size when an action's error was shown
        self.add_button.on_click(lambda _: self._act("add"))
        self.remove_button.on_click(lambda _: self._act("remove"))
        self.kill_button.on_click(lambda _: self._act("kill"))
        self.controls = W.VBox(
            [
                W.HBox([self.steps, self.every, self.nodes]),
                W.HBox([self.add_button, self.remove_button, self.kill_button]),
            ]
        )
        self.widget = self.layout()
        for control in (self.steps, self.every, self.nodes):
            control.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    def config(self) -> RunConfig:
        return self.base.replace(steps=self.steps.value)

    def plan(self) -> str:
        cfg = self.config()
        ElasticJob.check(cfg, f"1:{self.nodes.value}", 1)  # raises ValueError with the fix
        return (
            f"ddp on torchrun, nnodes 1:{self.nodes.value}, {cfg.steps} steps of global "
            f"batch {cfg.global_batch}, a checkpoint every {self.every.value} steps"
        )

    def execute(self, cancel: threading.Event) -> ElasticJob:
        job = self.job = ElasticJob(
            self.config(),
            nnodes=f"1:{self.nodes.value}",
            max_restarts=10,
            checkpoint_every=self.every.value,
        )
        ((bar, text),) = self.progress_bars(["steps"], self.steps.value)
        self._buttons(True)
        try:
            job.add_agent()
            last = 0.0
            while not job.done():
                if cancel.is_set():
                    raise LaunchCancelled("stopped")
                if time.time() - last > self.redraw_s:
                    steps = job.steps()
                    if len(steps):
                        row = steps.iloc[-1]
                        world = int(row["world_size"])
                        if self._error_world is not None and world != self._error_world:
                            # the job moved on: an action's error no longer describes it
                            self._error_world = None
                            self.status.value = f"running: world size now {world}"
                        bar.value = int(row["step"])
                        text.value = (
                            f"step {int(row['step'])}, world size "
                            f"{int(row['world_size'])}, attempt {int(row['attempt'])}"
                        )
                        self.show(elastic_timeline(steps, job.events, job.t0))
                    last = time.time()
                time.sleep(0.1)
            job.wait(10)  # raises ElasticError with the reason if it failed
            return job
        finally:
            self._buttons(False)
            # a Stop need not wait for torchrun's own shutdown: the checkpoints are on disk
            # (written whole, then renamed), so what is still running after STOP_GRACE_S is killed
            job.close(grace_s=STOP_GRACE_S if cancel.is_set() else 5.0)

    def render(self, job: ElasticJob) -> list:
        steps = job.steps()
        table = changes(job.events, steps, job.t0)
        return ([table] if len(table) else []) + [elastic_timeline(steps, job.events, job.t0)]

    def partial(self) -> ElasticJob | None:
        """After Stop: the job so far (its timeline outlives its processes)."""
        return self.job if self.job is not None and len(self.job.steps()) else None

    def done_message(self, job: ElasticJob) -> str:
        steps = job.steps()
        sizes = " -> ".join(
            str(int(w)) for w in steps["world_size"][steps["world_size"].diff() != 0]
        )
        return (
            f"done: {int(steps['step'].max())} steps, world size {sizes}, "
            f"{steps['attempt'].max() + 1} attempt(s)"
        )

    def _buttons(self, running: bool) -> None:
        for b in (self.add_button, self.remove_button, self.kill_button):
            b.disabled = not running
        self.kill_button.button_style = "danger" if running else ""  # red only when it acts

    def _act(self, what: str) -> None:
        job = self.job
        if job is None or job.done():
            return
        try:
            if what == "add":
                job.add_agent()
            elif what == "remove":
                if len([a for a in job.agents if a.alive]) < 2:
                    raise ValueError(
                        "only one node is running: removing it would end the job (use Stop)"
                    )
                job.remove_agent()
            else:
                job.kill_worker()
        except (ValueError, RuntimeError) as exc:
            self.status.value = f"<span style='color:#b00'>{html.escape(str(exc))}</span>"
            steps = job.steps()
            self._error_world = int(steps["world_size"].iloc[-1]) if len(steps) else 0


def elastic_panel(
    base: RunConfig | None = None, *, run_now: bool = False, max_nodes: int = 2
) -> ElasticPanel:
    """Build the panel (``base``: the model and batch; its steps and checkpoint_every preset
    the sliders). ``run_now=True`` runs the preset once, without changes, before returning."""
    panel = ElasticPanel(
        base
        or RunConfig(
            strategy="ddp",
            steps=2000,
            warmup=0,
            width=64,
            depth=2,
            global_batch=32,
            dataset_size=512,
            pace_s=0.05,
        ),
        max_nodes=max_nodes,
    )
    if run_now:
        panel.run_or_raise()
    return panel
