"""Panels of the tensor-parallel lab.

``LayoutPanel``: data, tensor and pipeline degrees as sliders (the world size is their product),
the model and sequence parallelism, Run/Stop; every run is one row of a table (kept apart, never
pooled) with its median step and the bytes a rank sent per step, counted on the wire.

``AdvisorPanel``: a published model size (or your own), GPUs, GPUs per node and device; the
advisor's layouts best first, with memory and step bars. Pure arithmetic: it redraws on every
change, no Run needed.
"""

from __future__ import annotations

import html
import threading

import ipywidgets as W
import pandas as pd

from .. import experiment, report
from ..config import RunConfig
from ..plots import tensor_parallel as charts
from ..records import summarize
from .base import BackgroundRun, mime_output


def layout_strategy(dp: int, tp: int, stages: int) -> str:
    """The labkit strategy that runs ``dp`` x ``tp`` x ``stages`` ranks."""
    if tp > 1 and stages > 1:
        raise ValueError(
            "tensor and pipeline parallelism together (3-D) is not a labkit strategy: "
            "set tp to 1 or stages to 1"
        )
    if tp > 1:
        return "dp_tp" if dp > 1 else "tp"
    if stages > 1:
        return "dp_pp" if dp > 1 else "pipeline_1f1b"
    return "ddp" if dp > 1 else "single"


class LayoutPanel(BackgroundRun):
    """dp, tp and stages sliders, model and sequence-parallel pickers, steps, Run/Stop."""

    def __init__(self, base: RunConfig, max_degree: int = 4):
        super().__init__()
        self.base = base
        self.runs: list[dict] = []  # one row per finished run, in the order they ran
        self.result: experiment.RunResult | None = None
        self.figure = None
        style = {"description_width": "initial"}

        def slider(name: str, value: int, top: int) -> W.IntSlider:
            return W.IntSlider(value=value, min=1, max=top, description=name, style=style)

        self.dp = slider("data dp", 1, max_degree)
        self.tp = slider("tensor tp", 2, max_degree)
        self.stages = slider("pipeline stages", 1, 2)
        self.model = W.ToggleButtons(
            options=["transformer", "mlp"], value=base.model if base.model != "mlp" else "mlp"
        )
        self.sp = W.Checkbox(value=False, description="sequence parallel", indent=False)
        self.steps = W.IntSlider(value=base.steps, min=2, max=200, description="steps", style=style)
        self.controls = W.HBox(
            [
                W.VBox([self.dp, self.tp, self.stages]),
                W.VBox([W.HBox([W.Label("model"), self.model]), self.sp, self.steps]),
            ]
        )
        self.widget = self.layout()
        for control in (self.dp, self.tp, self.stages, self.model, self.sp, self.steps):
            control.observe(lambda _: self._check_controls(), names="value")
        self._check_controls()

    def config(self) -> RunConfig:
        dp, tp, stages = self.dp.value, self.tp.value, self.stages.value
        strategy = layout_strategy(dp, tp, stages)
        return self.base.replace(
            strategy=strategy,
            world_size=dp * tp * stages,
            tp=tp if tp > 1 else None,
            stages=stages,
            sequence_parallel=self.sp.value if tp > 1 else False,
            model=self.model.value,
            steps=self.steps.value,
        )

    def plan(self) -> str:
        cfg = self.config()  # raises ValueError with the fix
        return (
            f"{cfg.strategy}: dp {self.dp.value} x tp {self.tp.value} x stages "
            f"{self.stages.value} = {cfg.world_size} rank(s), {cfg.model}"
            f"{' + sequence parallel' if cfg.sequence_parallel else ''}"
        )

    def _check_controls(self) -> None:
        self.sp.disabled = self.tp.value == 1 or self.model.value != "transformer"
        if self.sp.disabled:
            self.sp.value = False
        self.check_controls()  # with the oversubscription warning above the cores

    def execute(self, cancel: threading.Event) -> experiment.RunResult:
        cfg = self.config()
        progress = self.rank_progress(cfg.ranks, cfg.steps, self.plan())
        result = experiment.run(cfg, on_progress=progress, cancel=cancel)
        self.runs.append(self.row(result))
        self.result = result
        return result

    def last_records(self) -> pd.DataFrame | None:
        return self.result.records if self.result is not None else None

    def row(self, result: experiment.RunResult) -> dict:
        """One run's row: its layout, median step and bytes per rank per step (largest rank)."""
        cfg, df = result.cfg, result.records
        summary = summarize(df).iloc[0]
        per_step = df.groupby("rank")["comm_bytes"].median()
        return {
            "run": len(self.runs) + 1,
            "layout": f"dp{self.dp.value} tp{self.tp.value} pp{self.stages.value}",
            "strategy": cfg.strategy,
            "model": cfg.model + (" + SP" if cfg.sequence_parallel else ""),
            "ranks": cfg.world_size,
            "step_ms": float(summary["step_ms"]),
            "bytes_sent_per_rank_step": float(per_step.max()),
            "param_bytes_per_rank": (  # the memory meter runs in the data/tensor loop only
                float(df["mem_params_bytes"].max()) if "mem_params_bytes" in df else None
            ),
            "loss": float(summary["loss"]),
            "oversubscribed": bool(df["oversubscribed"].iloc[0]),
        }

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(self.runs)

    def render(self, result: experiment.RunResult) -> list:
        table = self.table()
        self.figure = charts.layout_runs(table)
        return [table, self.figure]

    def done_message(self, result: experiment.RunResult) -> str:
        last = self.runs[-1]
        note = " (oversubscribed: timings shared the cores)" if last["oversubscribed"] else ""
        return (
            f"done: run {last['run']}, {self.plan()}: median step {last['step_ms']:.1f} ms, "
            f"{report.human_bytes(last['bytes_sent_per_rank_step'])} sent per rank per "
            f"step{note}; "
            f"{len(self.runs)} run(s) in the table, one row each"
        )


def layout_panel(base: RunConfig | None = None, *, run_now: bool = False) -> LayoutPanel:
    """Build the run panel (width 64: a step takes tens of ms on a CPU core). ``run_now=True``
    runs the default layout (tp 2 on the transformer) before returning."""
    panel = LayoutPanel(base or RunConfig(strategy="tp", model="transformer", width=64, steps=10))
    if run_now:
        panel.run_or_raise()
    return panel


class AdvisorPanel:
    """Model, cluster and device pickers; the advisor's ranked layouts, redrawn on each change."""

    def __init__(self, top: int = 8):
        from ..predict import layout

        self.layout = layout
        self.top = top
        self.frame: pd.DataFrame | None = None
        self.figure = None
        self.error: BaseException | None = None
        style = {"description_width": "initial"}
        models = {f"{r.name} (SC'21)": r for r in layout.SC21}
        self.model = W.Dropdown(
            options=list(models),
            value=list(models)[2],
            description="model",
            style=style,
            layout={"width": "280px"},
        )
        self._models = models
        self.gpus = W.IntText(value=128, description="GPUs", style=style, layout={"width": "160px"})
        self.per_node = W.Dropdown(
            options=[1, 2, 4, 8], value=8, description="GPUs per node", style=style
        )
        self.device = W.Dropdown(options=list(layout.DEVICES), description="device", style=style)
        self.batch = W.IntText(
            value=512, description="global batch", style=style, layout={"width": "200px"}
        )
        self.status, self.out = W.HTML(), W.Output()
        controls = W.HBox(
            [W.VBox([self.model, self.device]), W.VBox([self.gpus, self.per_node, self.batch])]
        )
        self.widget = W.VBox([controls, self.status, self.out])
        self.model.observe(lambda _: self._pick_model(), names="value")
        for control in (self.gpus, self.per_node, self.device, self.batch):
            control.observe(lambda _: self.update(), names="value")
        self._pick_model()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)

    def _pick_model(self) -> None:
        row = self._models[self.model.value]
        self.gpus.value, self.batch.value = row.gpus, row.global_batch  # its published setting
        self.update()

    def update(self) -> None:
        """Plan the current settings and redraw (bad input: said in the status, nothing drawn)."""
        row = self._models[self.model.value]
        try:
            plans = self.layout.plan(
                layers=row.layers,
                hidden=row.hidden,
                heads=row.heads,
                seq=row.seq,
                vocab=row.vocab,
                gpus=self.gpus.value,
                gpus_per_node=self.per_node.value,
                device=self.device.value,
                global_batch=self.batch.value,
            )
        except ValueError as exc:
            self.error = exc
            said = html.escape(str(exc))
            self.status.value = f"<span style='color:#b00'>cannot plan: {said}</span>"
            self.out.outputs = ()
            return
        self.error = None
        self.frame = self.layout.to_frame(plans[: self.top])
        best = plans[0]
        self.figure = charts.advisor_bars(self.frame)
        self.status.value = (
            f"{len(plans)} layouts; best: tp {best.tp} x pp {best.pp} x dp {best.dp}, ZeRO-"
            f"{best.zero}, {best.tflops_per_gpu:.0f} TFLOP/s per GPU predicted "
            f"(published: tp {row.tp} x pp {row.pp}, {row.tflops_per_gpu:.0f} achieved)"
        )
        self.out.outputs = (mime_output(self.frame), mime_output(self.figure))


def advisor_panel(top: int = 8) -> AdvisorPanel:
    """Build the advisor panel (it plans its default model at once)."""
    return AdvisorPanel(top)
