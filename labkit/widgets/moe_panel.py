"""The mixture-of-experts panel: experts, top-k, capacity factor, router skew, the auxiliary
loss's coefficient and the steps; Run trains labkit's transformer with expert parallelism (``ep``)
on real ranks, then draws each expert's and each rank's share of the tokens over the steps, the
drops, and what the all-to-alls carried beside the formula."""

from __future__ import annotations

import threading

import ipywidgets as W
import pandas as pd

from .. import experiment
from ..config import RunConfig
from ..labs import experts as lab
from ..plots import experts as charts
from .base import BackgroundRun


class MoEPanel(BackgroundRun):
    """Experts E, top-k, capacity factor, router skew, aux loss, steps; each Run adds a row to the
    table (the busiest expert over an even share, assignments dropped, the aux loss)."""

    def __init__(self, base: RunConfig):
        super().__init__()
        self.base, self.finished = base, []
        style = {"description_width": "initial"}
        n = base.world_size
        self.experts = W.Dropdown(
            options=[e for e in (2, 4, 8) if e % n == 0],
            value=base.experts,
            description="experts E",
            style=style,
        )
        self.top_k = W.ToggleButtons(options=[1, 2], value=base.top_k, description="top-k")
        self.capacity = W.FloatSlider(
            value=base.capacity_factor,
            min=0.5,
            max=3.0,
            step=0.25,
            description="capacity factor",
            style=style,
        )
        self.skew = W.FloatSlider(
            value=base.router_skew,
            min=0.0,
            max=6.0,
            step=0.5,
            description="router skew (expert 0)",
            style=style,
        )
        self.aux = W.Dropdown(
            options=[0.0, 0.01, 0.1, 1.0],
            value=base.aux_loss,
            description="aux loss coefficient",
            style=style,
        )
        self.steps = W.IntSlider(  # longer runs: the router settling, the aux loss at work
            value=base.steps, min=1, max=500, description="steps", style=style
        )
        self.controls = W.VBox(
            [W.HBox([W.VBox([self.experts, self.top_k]), W.VBox([self.capacity, self.skew])]),
             W.HBox([self.aux, self.steps])]
        )  # fmt: skip
        self.widget = self.layout()
        for c in (self.experts, self.top_k, self.capacity, self.skew, self.aux, self.steps):
            c.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    def config(self) -> RunConfig:
        return self.base.replace(
            experts=self.experts.value,
            top_k=self.top_k.value,
            capacity_factor=self.capacity.value,
            router_skew=self.skew.value,
            aux_loss=self.aux.value,
            steps=self.steps.value,
        )

    def label(self, cfg: RunConfig) -> str:
        return (
            f"E={cfg.experts} top-{cfg.top_k} cf={cfg.capacity_factor:g} "
            f"skew={cfg.router_skew:g} aux={cfg.aux_loss:g}"
        )

    def plan(self) -> str:
        cfg = self.config()  # raises ValueError with the fix
        return (
            f"{self.label(cfg)}: {cfg.experts // cfg.world_size} experts on each of "
            f"{cfg.world_size} ranks, {cfg.steps} steps"
        )

    def execute(self, cancel: threading.Event):
        cfg = self.config()
        progress = self.rank_progress(cfg.ranks, cfg.steps, self.label(cfg))
        res = experiment.run(cfg, on_progress=progress, cancel=cancel)
        res.records["run"] = self.label(cfg)
        self.finished.append((cfg, res.records))
        return self.finished[-1]

    def last_records(self) -> pd.DataFrame | None:
        return self.finished[-1][1] if self.finished else None

    @property
    def table(self) -> pd.DataFrame:
        """Every run so far, over its last 5 steps: the busiest expert's share over an even one,
        the share of assignments dropped, the aux loss; the loss at the end; per step, the
        all-to-alls' bytes sent by all ranks (``labkit.wire``) and the formula's."""
        rows = []
        for cfg, records in self.finished:
            imb = lab.imbalance(records)
            tail = imb[imb["step"] >= imb["step"].max() - 4]  # the last 5 steps
            b = lab.all_to_all_bytes(records, cfg)
            rows.append(
                {
                    "run": self.label(cfg),
                    "busiest_vs_even": tail["max_over_mean"].mean(),
                    "dropped_fraction": tail["drop_fraction"].mean(),
                    "aux_loss": tail["aux_loss"].mean(),
                    "loss": records.groupby("step")["loss"].first().iloc[-1],
                    "a2a_sent_bytes": b["counted_sent_bytes"].sum() / b["step"].nunique(),
                    "formula_bytes": b["formula_bytes"].sum() / b["step"].nunique(),
                }
            )
        return pd.DataFrame(rows)

    def render(self, result) -> list:
        cfg, records = result
        return [
            self.table,
            charts.load(lab.expert_load(records), by="expert"),
            charts.load(lab.rank_load(records), by="rank"),
            charts.imbalance(lab.imbalance(records)),
        ]

    def done_message(self, result) -> str:
        row = self.table.iloc[-1]
        return (
            f"done: {row['run']}: the busiest expert took {row['busiest_vs_even']:.1f}x an even "
            f"share and {row['dropped_fraction']:.0%} of the assignments were dropped over the "
            f"last 5 steps ({len(self.finished)} run(s) in the table)"
        )


def moe_panel(base: RunConfig | None = None, *, run_now: bool = False) -> MoEPanel:
    """Build the panel (``base``: an ``ep`` run of labkit's transformer with experts; its knobs
    preset the controls). ``run_now=True`` runs the preset once before returning."""
    panel = MoEPanel(
        base
        or RunConfig(
            strategy="ep",
            world_size=2,
            model="transformer",
            experts=4,
            width=64,
            depth=2,
            global_batch=32,
            dataset_size=1024,
            steps=12,
            warmup=1,
        )
    )
    if run_now:
        panel.run_or_raise()
    return panel
