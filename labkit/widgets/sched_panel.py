"""The scheduling panel: arrival rate (as offered load), cluster size, priority mix, policies and
trace length; Run simulates every chosen policy on one generated trace and draws the metrics
table, the JCT distributions, mean/p95 JCT per policy and the Gantt of the first policy."""

from __future__ import annotations

import html
import threading

import ipywidgets as W
import pandas as pd

from ..labs.sched import sim, traces
from ..labs.sched.policies import POLICIES
from ..launch import LaunchCancelled
from ..plots import scheduling as charts
from .base import BackgroundRun


class SchedPanel(BackgroundRun):
    """Sliders for the trace and cluster, a multi-select of policies; each Run re-simulates."""

    stopped_what = "the simulation was abandoned (no processes: it runs in this kernel)"

    def __init__(
        self,
        jobs: int = 300,
        load: float = 1.0,
        nodes: int = 4,
        gpus_per_node: int = 8,
        high_priority: float = 0.2,
        policies=("fifo", "las", "elastic"),
        seed: int = 0,
    ):
        super().__init__()
        style = {"description_width": "initial"}
        self.load = W.FloatSlider(
            value=load,
            min=0.2,
            max=1.6,
            step=0.1,
            style=style,
            description="arrival rate (offered load)",
        )
        self.nodes = W.IntSlider(value=nodes, min=1, max=32, description="nodes", style=style)
        self.gpus = W.Dropdown(
            options=[1, 2, 4, 8], value=gpus_per_node, description="GPUs per node", style=style
        )
        self.high = W.FloatSlider(
            value=high_priority,
            min=0.0,
            max=1.0,
            step=0.05,
            style=style,
            description="high-priority share",
        )
        self.jobs = W.IntSlider(
            value=jobs, min=20, max=3000, step=20, description="jobs", style=style
        )
        self.policies = W.SelectMultiple(
            options=list(POLICIES),
            value=tuple(policies),
            description="policies",
            rows=len(POLICIES),
            style=style,
        )
        self.seed = seed
        self.controls = W.HBox(
            [W.VBox([self.load, self.nodes, self.gpus, self.high, self.jobs]), self.policies]
        )
        self.table: pd.DataFrame | None = None
        self.runs: dict = {}
        self._finished: tuple[list, dict] = ([], {})
        self.widget = self.layout()
        for c in (self.load, self.nodes, self.gpus, self.high, self.jobs, self.policies):
            c.observe(lambda _: self.check_controls(), names="value")
        self.check_controls()

    def cluster(self) -> sim.Cluster:
        return sim.Cluster(self.nodes.value, self.gpus.value)

    def plan(self) -> str:
        if not self.policies.value:
            raise ValueError("pick at least one policy")
        c = self.cluster()
        if c.gpus < 8:
            raise ValueError(
                f"the Philly mix has 8-GPU jobs: a cluster of {c.gpus} GPUs cannot "
                f"run them; add nodes or GPUs per node"
            )
        return (
            f"{self.jobs.value} jobs at {self.load.value:.0%} offered load, "
            f"{self.high.value:.0%} high priority, on {c} ({c.gpus} GPUs): "
            f"{', '.join(self.policies.value)}"
        )

    def execute(self, cancel: threading.Event):
        c = self.cluster()
        jobs = traces.generate(
            self.jobs.value,
            rate_per_hour=traces.rate_for_load(self.load.value, c.gpus),
            seed=self.seed,
            high_priority=self.high.value,
            curves=("good", "poor"),
        )
        rows, runs = self._finished = [], {}  # kept as they finish: a Stop keeps them
        policies = list(self.policies.value)
        bars = self.progress_bars(policies, len(jobs))  # a bar per policy: its jobs finished

        for (bar, text), p in zip(bars, policies):

            def progress(finished: int, total: int, bar=bar, text=text) -> None:
                bar.value, text.value = finished, f"{finished:,}/{total:,} jobs finished"

            if cancel.is_set():  # between policies (a fast one may never ask)
                raise LaunchCancelled("stopped")
            try:
                runs[p] = sim.simulate(jobs, c, p, on_progress=progress, should_stop=cancel.is_set)
            except sim.SimulationStopped as exc:
                raise LaunchCancelled(str(exc)) from None
            rows.append(runs[p].metrics())
        self.table, self.runs = pd.DataFrame(rows), runs
        return self.table

    def partial(self) -> pd.DataFrame | None:
        rows, runs = self._finished
        if not rows:
            return None
        self.table, self.runs = pd.DataFrame(rows), dict(runs)
        return self.table

    def render(self, table: pd.DataFrame) -> list:
        shown = table[
            [
                "policy",
                "mean_jct_s",
                "p95_jct_s",
                "p99_jct_s",
                "mean_queue_s",
                "utilisation",
                "mean_rho",
                "max_rho",
                "gpu_hours",
                "restarts_per_job",
                "mean_jct_high_s",
                "mean_jct_low_s",
            ]
        ].copy()
        for col in [c for c in shown if c.endswith("_s")]:
            shown[col[:-2] + "_h"] = shown.pop(col) / 3600
        first = next(iter(self.runs))
        return [
            f"<b>{html.escape(self.plan())}</b>",
            shown,
            charts.jct_cdf(self.runs),
            charts.policy_bars(table),
            charts.gantt(self.runs[first], max_jobs=30),
        ]

    def done_message(self, table: pd.DataFrame) -> str:
        best = table.sort_values("mean_jct_s").iloc[0]
        return (
            f"done: {len(table)} policies on {self.cluster()}; lowest mean JCT: "
            f"{best['policy']} ({best['mean_jct_s'] / 3600:.1f} h)"
        )


def sched_panel(*, run_now: bool = False, **settings) -> SchedPanel:
    """Build the panel (``settings`` preset the controls); ``run_now=True`` simulates once."""
    panel = SchedPanel(**settings)
    if run_now:
        panel.run_or_raise()
    return panel
