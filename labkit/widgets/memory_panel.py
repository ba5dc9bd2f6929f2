"""The memory calculator panel: a slider or picker per input, a stacked bar per rank that
redraws on every change (computed, nothing runs), and Run to measure the same configuration on
real ranks: counted bytes beside calculated ones, with the error per category."""

from __future__ import annotations

import threading
import time

import ipywidgets as W
import pandas as pd
import psutil

from .. import experiment
from ..config import PRECISIONS, RunConfig
from ..env import matmul_flops_per_s, resolve_device
from ..labs.compute_profile import flops_per_sample
from ..labs.memory import CATEGORIES, adam, calculator_error, memory_table, predict
from ..plots import memory as charts
from ..predict.step import compute_floor_s
from .base import BackgroundRun, mime_output

_OPTIMIZERS = {"SGD with momentum": "sgd_momentum", "Adam": "adam"}
LONG_S = 10.0  # a run whose matmuls alone take longer is announced before Run


class MemoryPanel(BackgroundRun):
    """Model width and depth, batch, precision, optimizer, strategy, world size, checkpointing
    and accumulation -> bytes per rank by category; Run measures it (table of every run)."""

    def __init__(self, base: RunConfig):
        super().__init__()
        self.base, self.finished = base, []
        style = {"description_width": "initial"}
        self.model = W.Dropdown(options=["mlp", "cnn"], value=base.model, description="model")
        self.width = W.IntSlider(
            value=base.width, min=32, max=4096, step=32, description="width", style=style
        )
        self.depth = W.IntSlider(value=base.depth, min=1, max=16, description="depth")
        self.batch = W.IntSlider(
            value=base.global_batch,
            min=8,
            max=1024,
            step=8,
            description="global batch",
            style=style,
        )
        self.precision = W.ToggleButtons(
            options=list(PRECISIONS), value=base.precision, description="precision"
        )
        self.optimizer = W.Dropdown(options=list(_OPTIMIZERS), description="optimizer")
        choices = ("ddp", "zero1", "fsdp")  # no sharding, the optimizer state, everything
        self.strategy = W.ToggleButtons(
            options=list(choices),
            value=base.strategy if base.strategy in choices else choices[0],
            description="strategy",
        )
        self.world = W.IntSlider(
            value=base.world_size, min=1, max=8, description="world size", style=style
        )
        self.checkpoint = W.Checkbox(
            value=base.activation_checkpointing, description="activation checkpointing"
        )
        self.accumulate = W.IntSlider(
            value=base.accumulate, min=1, max=8, description="accumulate", style=style
        )
        for slider in (self.width, self.depth, self.batch, self.world, self.accumulate):
            # each value recomputes the calculated bars: on release, not at every step of a drag
            # (a drag across the width slider queued dozens of recomputations)
            slider.continuous_update = False
        self.chart = W.Output()
        self.controls = W.VBox(
            [
                W.HBox(
                    [
                        W.VBox(
                            [
                                self.model,
                                self.width,
                                self.depth,
                                self.batch,
                                self.world,
                                self.accumulate,
                            ]
                        ),
                        W.VBox([self.precision, self.strategy, self.optimizer, self.checkpoint]),
                    ]
                ),
                self.chart,
            ]
        )
        self.widget = self.layout()
        for c in (
            self.model,
            self.width,
            self.depth,
            self.batch,
            self.precision,
            self.optimizer,
            self.strategy,
            self.world,
            self.checkpoint,
            self.accumulate,
        ):
            c.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    def config(self) -> RunConfig:
        return self.base.replace(
            model=self.model.value,
            width=self.width.value,
            depth=self.depth.value,
            global_batch=self.batch.value,
            precision=self.precision.value,
            strategy=self.strategy.value,
            world_size=self.world.value,
            activation_checkpointing=self.checkpoint.value,
            accumulate=self.accumulate.value,
            dataset_size=max(self.base.dataset_size, self.batch.value),
        )

    @property
    def opt(self) -> str:
        return _OPTIMIZERS[self.optimizer.value]

    def label(self, cfg: RunConfig) -> str:
        parts = [
            f"{cfg.strategy}@{cfg.world_size}",
            f"{cfg.model} {cfg.width}x{cfg.depth}",
            f"batch {cfg.global_batch}",
            cfg.precision,
            self.optimizer.value,
        ]
        parts += ["checkpointed"] if cfg.activation_checkpointing else []
        parts += [f"accumulate {cfg.accumulate}"] if cfg.accumulate > 1 else []
        return ", ".join(parts)

    def plan(self) -> str:
        cfg = self.config()  # raises ValueError with the fix
        calc = predict(cfg, self.opt)
        self.chart.outputs = (
            mime_output(charts.calculated(calc, f"Calculated: {self.label(cfg)}")),
        )
        mib = calc[list(CATEGORIES)].sum(axis=1).max() / 2**20
        free = psutil.virtual_memory().available / 2**20
        if 4 * mib * cfg.ranks > free:  # tensors are a fraction of a rank's footprint
            raise ValueError(
                f"{self.label(cfg)}: {mib:,.0f} MiB per rank (calculated) on "
                f"{cfg.ranks} rank(s) would not fit safely in this machine's "
                f"{free:,.0f} MiB of free memory: the bar shows the calculation; "
                f"lower width, depth or batch to measure it"
            )
        said = (
            f"{self.label(cfg)}: {mib:.2f} MiB per rank (calculated); Run measures it on "
            f"{cfg.ranks} rank(s)"
        )
        floor = self.floor_s(cfg)
        if floor >= LONG_S:
            said += (
                f"; it takes at least {floor:,.0f} s: its matmuls alone, at this machine's "
                f"measured matmul rate (lower width, depth, batch or steps for a quicker run)"
            )
        return said

    @staticmethod
    def floor_s(cfg: RunConfig) -> float:
        """The run's compute time from below (``labkit.predict.step.compute_floor_s``)."""
        kind = resolve_device(cfg.device, cfg.ranks)
        rate = matmul_flops_per_s(kind if kind == "cpu" else "cuda")
        return compute_floor_s(
            cfg, *flops_per_sample(cfg), rate, devices=1 if kind == "cpu" else cfg.ranks
        )

    def execute(self, cancel: threading.Event):
        cfg = self.config()
        self._bars = self.progress_bars([f"rank {r}" for r in range(cfg.ranks)], cfg.steps)
        t0 = time.perf_counter()
        res = experiment.run(
            cfg,
            cancel=cancel,
            optimizer_fn=adam if self.opt == "adam" else None,
            on_progress=lambda r, m: self._progress(r, m),
        )
        err = calculator_error(res.records, cfg, self.opt)
        self.took_s = time.perf_counter() - t0
        self.finished.append((self.label(cfg), cfg, res.records, err))
        return self.finished[-1]

    def last_records(self) -> pd.DataFrame | None:
        return self.finished[-1][2] if self.finished else None

    @property
    def table(self) -> pd.DataFrame:
        """Every measured run: counted MiB per category (largest rank) and the worst error."""
        rows = []
        for label, _, records, err in self.finished:
            counted = err.pivot(index="rank", columns="category", values="counted").max()
            rows.append(
                {
                    "run": label,
                    **{f"{c}_mib": counted[c] / 2**20 for c in CATEGORIES},
                    "high_water_mib": records["peak_mem_bytes"].max() / 2**20,
                    "max_abs_error": err["error"].abs().max(),
                }
            )
        return pd.DataFrame(rows)

    def render(self, result) -> list:
        label, cfg, records, err = result
        calc = predict(cfg, self.opt)
        per = err.assign(error=err["error"].map("{:+.1%}".format))
        return [
            self.table,
            charts.calculated(calc, f"Calculated, with the counted total: {label}", err),
            per,
            charts.by_rank(memory_table(records), f"Counted: {label}"),
        ]

    def done_message(self, result) -> str:
        label, cfg, _, err = result
        return (
            f"done: {label}: calculator within {err['error'].abs().max():.1%} of the counted "
            f"bytes in every category ({len(self.finished)} run(s) in the table); took "
            f"{self.took_s:.1f} s, of which the matmuls take at least {self.floor_s(cfg):.1f} s"
        )

    def _progress(self, rank: int, metrics: dict) -> None:
        bar, text = self._bars[rank]
        bar.max, bar.value = metrics["total"], metrics["step"]
        text.value = f"step {metrics['step']}/{metrics['total']}"


def memory_panel(base: RunConfig | None = None, *, run_now: bool = False) -> MemoryPanel:
    """Build the calculator panel (``base`` presets the controls); ``run_now=True`` measures
    the preset once before returning."""
    panel = MemoryPanel(
        base or RunConfig(strategy="fsdp", steps=3, warmup=1, width=128, depth=3, global_batch=32)
    )
    if run_now:
        panel.run_or_raise()
    return panel
