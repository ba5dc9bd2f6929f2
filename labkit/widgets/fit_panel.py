"""The "will it fit" panel (notebook 16): a model by its shape, a cluster and a layout; Run dry-runs
the real strategy code for the ranks that differ (``labkit.labs.dryrun``) and draws each rank's
memory by category as a stacked bar against the device's memory, the calculator's bar beside it,
and the collectives of one step as a table. A layout that cannot exist (degrees that do not
divide the GPUs or the heads, a ZeRO stage no strategy offers) is refused before anything runs.
"""

from __future__ import annotations

import threading

import ipywidgets as W

from ..labs import dryrun as D
from ..labs.dryrun import beside as B
from ..launch import LaunchCancelled
from ..plots import dryrun as charts
from ..predict.layout import RESERVE
from .base import BackgroundRun

GB = 1e9
SHAPES = {
    "0.37B (24 x 1024)": D.Transformer(24, 1024, 16, 1024, 32000),
    "1.3B (24 x 2048)": D.Transformer(24, 2048, 16, 2048, 32000),
    "7B (LLaMA shape)": D.LLAMA_7B,
    "7.5B (ZeRO paper)": D.Transformer(36, 4096, 32, 2048, 51200),
    "70B (LLaMA shape)": D.LLAMA_70B,
}
MEMORY_GB = (12, 16, 24, 40, 80, 141)


class FitPanel(BackgroundRun):
    """Model, GPUs, GPU memory, tensor and pipeline degrees (the data degree is what is left),
    ZeRO stage, recomputation, micro-batch and micro-batches per step; Run dry-runs it."""

    warns_oversubscription = False  # nothing is launched: one process, no data
    stopped_what = "the ranks not yet run were skipped"

    def __init__(
        self, model: str = "0.37B (24 x 1024)", gpus: int = 8, memory_gb: int = 12, microbatch=8
    ):
        super().__init__()
        self.run_result: D.DryRun | None = None
        self.figure = None
        style = {"description_width": "initial"}
        small = {"width": "170px"}
        self.model = W.Dropdown(options=list(SHAPES), value=model, description="model")
        self.gpus = W.IntText(value=gpus, description="GPUs", style=style, layout=small)
        self.memory = W.Dropdown(options=MEMORY_GB, value=memory_gb, description="GB per GPU",
                                 style=style)  # fmt: skip
        self.tp = W.Dropdown(options=[1, 2, 4, 8, 16], value=1, description="tensor t",
                             style=style)  # fmt: skip
        self.pp = W.Dropdown(options=[1, 2, 4, 8, 16], value=1, description="pipeline P",
                             style=style)  # fmt: skip
        self.zero = W.ToggleButtons(options=[0, 1, 2, 3], value=3, description="ZeRO stage",
                                    style=style)  # fmt: skip
        self.recompute = W.ToggleButtons(options=["none", "full"], value="none",
                                         description="recompute", style=style)  # fmt: skip
        self.micro = W.IntText(
            value=microbatch, description="micro-batch b", style=style, layout=small
        )
        self.m = W.IntText(value=1, description="micro-batches M", style=style, layout=small)
        self.data = W.HTML()
        self.controls = W.HBox([
            W.VBox([self.model, self.gpus, self.memory, self.data]),
            W.VBox([self.tp, self.pp, self.zero]),
            W.VBox([self.recompute, self.micro, self.m]),
        ])  # fmt: skip
        self.widget = self.layout()
        for control in (self.model, self.gpus, self.memory, self.tp, self.pp, self.zero,
                        self.recompute, self.micro, self.m):  # fmt: skip
            control.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    @property
    def shape(self) -> D.Transformer:
        return SHAPES[self.model.value]

    def degrees(self) -> tuple[int, int, int]:
        """(t, P, d): the data degree is the GPUs left over, or a ValueError with the fix."""
        t, p, n = self.tp.value, self.pp.value, self.gpus.value
        if n < 1 or n % (t * p):
            raise ValueError(
                f"t {t} x P {p} = {t * p} does not divide {n} GPUs: choose GPUs that are a "
                f"multiple of {t * p}, or smaller degrees"
            )
        return t, p, n // (t * p)

    def config(self):
        t, p, d = self.degrees()
        b, m = self.micro.value, self.m.value
        if b < 1 or m < 1:
            raise ValueError("micro-batch b and micro-batches M must be at least 1")
        return D.layout_config(self.shape, tp=t, pp=p, dp=d, zero=self.zero.value, microbatch=b,
                               recompute=self.recompute.value,
                               global_batch=d * b * m)  # fmt: skip

    def plan(self) -> str:
        cfg = self.config()  # every refusal (degrees, heads, layers, ZeRO stage) is said here
        t, p, d = self.degrees()
        self.data.value = f"<small>data d = {d}</small>"
        return (
            f"{cfg.strategy}: t {t} x P {p} x d {d} = {cfg.world_size} GPUs, {self.shape}, "
            f"b {self.micro.value} x M {self.m.value}, ZeRO-{self.zero.value}, recompute "
            f"{self.recompute.value}: dry-run on the ranks that differ"
        )

    def usable(self) -> float:
        return self.memory.value * GB * (1 - RESERVE)

    def execute(self, cancel: threading.Event) -> D.DryRun:
        cfg = D.core.dry_config(self.config(), None, self.shape)
        plan = D.ranks_that_differ(cfg, D.core.factories(cfg, self.shape, "paper", None))
        rows, run = self.progress_bars([f"rank {r}: {role}" for r, role in plan], 1), None
        for (bar, _), (r, role) in zip(rows, plan):
            if cancel.is_set():
                raise LaunchCancelled("stopped between ranks")
            one = D.dryrun(cfg, shape=self.shape, recipe="paper", rank=r)
            one.ranks[0].role = role
            if run is None:
                run = one
            else:
                run.ranks += one.ranks
            bar.value = 1
        self.run_result = run
        return run

    def render(self, run: D.DryRun) -> list:
        out = []
        if run.failed:
            out.append(f"<b>could not run</b>: {run.failed[0].error}")
        table = B.beside(run) if not run.failed else None
        calculator = None
        if table is not None:
            calculator = dict(zip(table["category"], table["calculator"]))
        self.figure = charts.fit_bars(run.memory(), self.usable(), calculator)
        out.append(self.figure)
        if table is not None:
            shown = table[["category", "dry_run", "calculator", "difference", "why"]].copy()
            for col in ("dry_run", "calculator", "difference"):
                shown[col] = (shown[col] / GB).round(3)
            names = {"dry_run": "dry run GB", "calculator": "calculator GB",
                     "difference": "difference GB"}  # fmt: skip
            out.append(shown.rename(columns=names))
        out.append(charts.collectives_table(run.collectives()))
        return out

    def done_message(self, run: D.DryRun) -> str:
        if run.failed:
            return f"<b>could not run</b> without data: {run.failed[0].error}"
        worst = run.fullest()
        fits = worst.total <= self.usable()
        verdict = "<b>fits</b>" if fits else "<b style='color:#b00'>does not fit</b>"
        return (
            f"{verdict}: the fullest rank ({worst.rank}, {worst.role}) holds "
            f"{worst.total / GB:.1f} GB of {self.usable() / GB:.0f} GB usable "
            f"({self.memory.value} GB less {RESERVE:.0%}); dry run of {len(run.ranks)} rank(s) "
            f"in {sum(r.seconds for r in run.ranks):.0f} s"
        )


def fit_panel(run_now: bool = False, **defaults) -> FitPanel:
    """Build the panel (its default: a 0.37B model on 8 GPUs of 12 GB under FSDP, micro-batches
    of 8 sequences of 1,024 tokens); ``run_now`` dry-runs the default layout before returning."""
    panel = FitPanel(**defaults)
    if run_now:
        panel.run_or_raise()
    return panel
