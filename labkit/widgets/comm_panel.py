"""The communication panel: DDP's knobs (bucket size, compression hook, gradient accumulation,
world size), Run/Stop, live per-rank progress; every run joins a table and a chart of step
time, exposed communication and bytes per sample, with the predictor's step beside each."""

from __future__ import annotations

import threading

import ipywidgets as W
import pandas as pd

from .. import experiment
from ..config import RunConfig
from ..env import oversubscription, probe
from ..labs.comm import knob_label, knob_rows
from ..plots import communication as charts
from .base import BackgroundRun

BUCKETS = {
    "DDP default (25 MB, first 1 MiB)": None,
    "1 MB": 1.0,
    "5 MB": 5.0,
    "25 MB": 25.0,
    "100 MB": 100.0,
}


class CommPanel(BackgroundRun):
    """Knobs of one DDP run; Run adds it to the comparison (Clear starts over)."""

    def __init__(
        self,
        base: RunConfig,
        profile=None,
        network=None,
        factories: dict | None = None,
        max_world_size: int | None = None,
    ):
        super().__init__()
        self.base, self.profile, self.network = base, profile, network
        self.factories = factories or {}
        env = probe()
        self.device = env.device
        top = max_world_size or (
            env.max_world_size if env.device == "cuda" else max(2, 2 * env.max_world_size)
        )
        self.results: list = []  # every finished run, in order
        style = {"description_width": "initial"}
        self.world = W.IntSlider(
            value=min(base.world_size, top),
            min=2,
            max=max(2, top),
            description="world size",
            style=style,
        )
        self.bucket = W.Dropdown(options=list(BUCKETS), description="bucket", style=style)
        self.hook = W.Dropdown(
            options=["none", "fp16", "bf16", "powersgd"],
            value=base.comm_hook,
            description="comm hook",
            style=style,
        )
        self.rank = W.Dropdown(
            options=[1, 2, 4],
            value=base.powersgd_rank,
            description="PowerSGD rank",
            style=style,
            disabled=True,
        )
        self.accumulate = W.IntSlider(
            value=base.accumulate, min=1, max=8, description="accumulate", style=style
        )
        self.sync_every = W.Checkbox(
            value=base.sync_every_microstep, description="sync every micro-batch (no no_sync)"
        )
        self.steps = W.IntSlider(value=base.steps, min=5, max=100, step=5, description="steps")
        self.clear_button = W.Button(description="Clear", icon="trash")
        self.clear_button.on_click(lambda _: self.clear())
        self.controls = W.HBox(
            [
                W.VBox([self.world, self.bucket, self.hook, self.rank]),
                W.VBox([self.accumulate, self.sync_every, self.steps, self.clear_button]),
            ]
        )
        self.widget = self.layout()
        for control in (
            self.world,
            self.bucket,
            self.hook,
            self.rank,
            self.accumulate,
            self.sync_every,
            self.steps,
        ):
            control.observe(lambda _: self._check_controls(), names="value")
        self._check_controls()

    def config(self) -> RunConfig:
        """The micro-batch per rank stays the base's; accumulating k of them makes the global
        batch k times larger (the memory of one micro-batch, the update of k)."""
        micro = self.base.global_batch // self.base.world_size
        return self.base.replace(
            strategy="ddp",
            world_size=self.world.value,
            steps=self.steps.value,
            global_batch=micro * self.world.value * self.accumulate.value,
            bucket_cap_mb=BUCKETS[self.bucket.value],
            comm_hook=self.hook.value,
            powersgd_rank=self.rank.value,
            accumulate=self.accumulate.value,
            sync_every_microstep=self.sync_every.value,
        )

    def plan(self) -> str:
        return knob_label(self.config())  # RunConfig raises ValueError with the fix

    def _check_controls(self) -> None:
        self.rank.disabled = self.hook.value != "powersgd"
        self.sync_every.disabled = self.accumulate.value == 1
        warn = oversubscription(self.world.value) if self.device == "cpu" else None
        self.check_controls(f"<br><span style='color:#b00'>{warn}</span>" if warn else "")

    def clear(self) -> None:
        self.results = []
        self.show()
        self._check_controls()

    def execute(self, cancel: threading.Event):
        cfg = self.config()
        progress = self.rank_progress(cfg.ranks, cfg.steps, knob_label(cfg))
        result = experiment.run(cfg, on_progress=progress, cancel=cancel, **self.factories)
        self.results.append(result)
        return self.results

    def partial(self):
        return self.results or None

    @property
    def table(self) -> pd.DataFrame:
        return knob_rows(self.results, self.profile, self.network)

    def render(self, results) -> list:
        table = knob_rows(results, self.profile, self.network)
        notes = sorted({n for r in results for n in r.notes})
        return [table] + [f"<p>{n}</p>" for n in notes] + [charts.knobs(table)]

    def done_message(self, results) -> str:
        t = knob_rows(results[-1:], self.profile, self.network).iloc[0]
        pred = (
            f"; predicted {t['predicted_step_ms']:.1f} ms ({t['error']:+.0%})"
            if "predicted_step_ms" in t and pd.notna(t["predicted_step_ms"])
            else ""
        )
        busy = " <b style='color:#b00'>(machine busy: not comparable)</b>" if t["busy"] else ""
        return (
            f"done: {t['config']}: step {t['step_ms']:.1f} ms, exposed comm "
            f"{t['comm_ms']:.1f} ms{pred}{busy}"
        )


def comm_panel(
    base: RunConfig | None = None,
    *,
    profile=None,
    network=None,
    max_world_size: int | None = None,
    **factories,
) -> CommPanel:
    """Build the panel; display it, then ``panel.run()`` runs the current knobs once."""
    return CommPanel(base or RunConfig(), profile, network, factories, max_world_size)


class WhatIfPanel:
    """Pick devices and interconnects, slide the world size up to 1024: the predicted scaling
    redraws at once (a prediction, not a run: nothing is launched)."""

    def __init__(self, profile, network=None, strategy: str = "ddp", **knobs):
        from ..predict.whatif import DEVICES, INTERCONNECTS

        self.profile, self.network, self.strategy, self.knobs = profile, network, strategy, knobs
        nets = (["this machine (measured)"] if network is not None else []) + list(INTERCONNECTS)
        style = {"description_width": "initial"}
        self.devices = W.SelectMultiple(
            options=list(DEVICES),
            value=tuple(DEVICES)[:1],
            description="device",
            rows=2,
            style=style,
        )
        self.interconnects = W.SelectMultiple(
            options=nets,
            value=tuple(nets[:3]),
            rows=len(nets),
            description="interconnect",
            style=style,
        )
        self.world = W.SelectionSlider(
            options=[2**k for k in range(1, 11)],
            value=1024,
            description="up to world size",
            style=style,
        )
        self.metric = W.Dropdown(
            options=[
                ("scaling efficiency", "efficiency"),
                ("step time (ms)", "step_ms"),
                ("samples / s", "samples_per_s"),
            ],
            description="show",
            style=style,
        )
        self.out, self.status = W.Output(), W.HTML()
        for control in (self.devices, self.interconnects, self.world, self.metric):
            control.observe(lambda _: self.redraw(), names="value")
        self.widget = W.VBox(
            [
                W.HBox([self.devices, self.interconnects, W.VBox([self.world, self.metric])]),
                self.status,
                self.out,
            ]
        )
        self.rows: pd.DataFrame | None = None
        self.redraw()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def redraw(self) -> None:
        from ..predict.whatif import scenario_rows
        from .base import mime_output

        sizes = [1] + [2**k for k in range(1, self.world.value.bit_length())]
        try:
            self.rows = pd.DataFrame(
                scenario_rows(
                    self.profile,
                    self.network,
                    list(self.devices.value),
                    list(self.interconnects.value),
                    sizes,
                    self.strategy,
                    **self.knobs,
                )
            )
        except ValueError as exc:
            self.status.value = f"<span style='color:#b00'>{exc}</span>"
            return
        if self.rows.empty:
            self.status.value = "pick at least one device and one interconnect"
            self.out.outputs = ()
            return
        self.status.value = (
            f"predicted {self.strategy}, {self.profile.batch} samples per rank "
            f"(weak scaling), from {self.profile.source}"
        )
        self.out.outputs = (mime_output(charts.whatif(self.rows, self.metric.value)),)
