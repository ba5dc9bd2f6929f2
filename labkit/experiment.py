"""Run configs on rank processes and turn their records into tables.

Data flows one way: RunConfig -> ``launch`` -> per-rank records -> a tidy DataFrame (one row per
rank and step) -> ``summarize`` (one row per strategy and world size). Aggregates are always
computed from the records, never stored beside them.
"""
from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import pandas as pd
import torch

from .config import PIPELINE_STRATEGIES, STRATEGY_RANKS, RunConfig
from .env import cpu_cores, oversubscription, resolve_device
from .launch import launch
from .strategies import run_rank

Progress = Callable[[int, dict], None]


@dataclass
class RunResult:
    cfg: RunConfig
    records: pd.DataFrame
    params: dict | None               # whole-model parameters (check mode), merged over ranks
    notes: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list, repr=False)   # raw per-rank results


def run(cfg: RunConfig, *, model_fn=None, data_fn=None, on_progress: Progress | None = None,
        cancel: threading.Event | None = None) -> RunResult:
    """Launch ``cfg`` on ``cfg.ranks`` processes and collect what every rank measured."""
    kind = resolve_device(cfg.device, cfg.ranks)
    threads = cfg.threads or _threads_for(cfg, kind)
    oversub = oversubscription(cfg.ranks, threads) if kind == "cpu" else None
    notes = [oversub] if oversub else []
    results = launch(run_rank, cfg.ranks, args=(cfg,),
                     kwargs={"model_fn": model_fn, "data_fn": data_fn},
                     timeout_s=cfg.timeout_s, device=kind, backend=cfg.backend, threads=threads,
                     on_progress=on_progress, cancel=cancel)
    records = pd.DataFrame([rec for res in results for rec in res["records"]])
    records["oversubscribed"] = oversub is not None
    for res in results:
        notes += [n for n in res.get("notes", []) if n not in notes]
    params = None
    if cfg.deterministic:
        params = {}
        for res in results:               # DDP: every rank holds all; pipeline: one stage each
            params.update(res["params"] or {})
    return RunResult(cfg, records, params, notes, results)


def _threads_for(cfg: RunConfig, kind: str) -> int:
    # On CPU the ranks share the cores; a lone process (single, dp) may use all of them, which is
    # the honest baseline: that is what you would do without labkit.
    return max(1, cpu_cores() // cfg.ranks) if kind == "cpu" else 1


def grid(base: RunConfig, strategies: Sequence[str], world_sizes: Sequence[int]) -> list[RunConfig]:
    """Configs for every strategy at every world size it can use (single once, at 1; pipeline
    strategies once, at ``stages``); invalid combinations raise with the fix."""
    configs = []
    for name in strategies:
        if name not in STRATEGY_RANKS:
            raise ValueError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGY_RANKS)}")
        if name == "single":
            sizes = [1]
        elif name in PIPELINE_STRATEGIES:
            sizes = [base.stages]
        else:
            sizes = list(world_sizes)
        configs += [base.replace(strategy=name, world_size=w) for w in sizes]
    return configs


def compare(configs: Iterable[RunConfig], *, model_fn=None, data_fn=None,
            on_progress: Callable[[RunConfig, int, dict], None] | None = None,
            on_result: Callable[[RunResult], None] | None = None,
            cancel: threading.Event | None = None) -> pd.DataFrame:
    """Run each config in turn; return all records in one DataFrame (notes in ``.attrs``)."""
    frames, notes = [], {}
    for cfg in configs:
        cb = None if on_progress is None else (lambda r, m, cfg=cfg: on_progress(cfg, r, m))
        res = run(cfg, model_fn=model_fn, data_fn=data_fn, on_progress=cb, cancel=cancel)
        frames.append(res.records)
        if res.notes:
            notes[f"{cfg.strategy}@{cfg.world_size}"] = res.notes
        if on_result is not None:
            on_result(res)
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    df.attrs["notes"] = notes
    return df


def summarize(records: pd.DataFrame) -> pd.DataFrame:
    """One row per (strategy, world_size): medians over steps of the slowest rank's step.

    step_ms: median over steps of the max over ranks (the slowest rank gates every step);
    samples_per_s: global batch / that step time; comm_share: exposed communication over
    step time; speedup: samples_per_s over single's; efficiency: speedup / world_size.
    """
    if records.empty:
        return pd.DataFrame()
    per_step = (records.groupby(["strategy", "world_size", "step"], sort=False)
                .agg(step_s=("step_s", "max"), comm_s=("comm_s", "max"),
                     global_batch=("global_batch", "first"), loss=("loss", "last"),
                     peak=("peak_mem_bytes", "max"))
                .reset_index())
    rows = []
    for (strategy, world_size), g in per_step.groupby(["strategy", "world_size"], sort=False):
        step_s = g["step_s"].median()
        rows.append({"strategy": strategy, "world_size": int(world_size),
                     "step_ms": 1e3 * step_s,
                     "samples_per_s": g["global_batch"].iloc[0] / step_s,
                     "comm_share": float((g["comm_s"] / g["step_s"]).median()),
                     "final_loss": float(g["loss"].iloc[-1]),
                     "peak_mem_mb": g["peak"].max() / 2**20})
    table = pd.DataFrame(rows)
    single = table.loc[table["strategy"] == "single", "samples_per_s"]
    base = single.iloc[0] if len(single) else math.nan
    table["speedup"] = table["samples_per_s"] / base
    table["efficiency"] = table["speedup"] / table["world_size"]
    if "bubble_fraction" in records:       # pipelines: idle share, median over steps and stages
        bubble = records.groupby(["strategy", "world_size"], sort=False)["bubble_fraction"].median()
        table["bubble_fraction"] = [bubble.get((s, w), math.nan)
                                    for s, w in zip(table["strategy"], table["world_size"])]
    if "oversubscribed" in records:
        flag = records.groupby(["strategy", "world_size"], sort=False)["oversubscribed"].any()
        table["oversubscribed"] = [bool(flag.get((s, w), False))
                                   for s, w in zip(table["strategy"], table["world_size"])]
    return table


def phase_breakdown(records: pd.DataFrame) -> pd.DataFrame:
    """Mean seconds per phase for each (strategy, world_size), averaged over ranks and steps."""
    cols = ["data_s", "forward_s", "backward_s", "comm_s", "optimizer_s", "step_s"]
    return records.groupby(["strategy", "world_size"], sort=False)[cols].mean().reset_index()


def check(base: RunConfig, strategies: Sequence[str], world_size: int = 2, *, steps: int = 5,
          tol: float = 1e-5, model_fn=None, data_fn=None) -> pd.DataFrame:
    """Train each strategy ``steps`` steps from the same weights on the same global batches and
    compare its final parameters with single-device training: max |difference| per strategy."""
    cfg = base.replace(steps=steps, warmup=0, deterministic=True)
    ref = run(cfg.replace(strategy="single", world_size=1), model_fn=model_fn,
              data_fn=data_fn).params
    rows = []
    for name in strategies:
        if name == "single":
            continue
        ws = cfg.stages if name in PIPELINE_STRATEGIES else world_size
        got = run(cfg.replace(strategy=name, world_size=ws), model_fn=model_fn,
                  data_fn=data_fn).params
        if set(got) != set(ref):
            raise AssertionError(f"{name} returned parameters {sorted(set(got) ^ set(ref))} that "
                                 f"single does not have (or lacks them)")
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        rows.append({"strategy": name, "world_size": ws, "steps": steps,
                     "max_abs_diff": diff, "tol": tol, "ok": diff <= tol})
    return pd.DataFrame(rows)


# ---- save / load -------------------------------------------------------------------------------

def save_records(records: pd.DataFrame, path: str, **meta) -> None:
    """Write records as JSON: {"meta": {...}, "records": [ {...}, ... ]}."""
    payload = {"meta": {**meta, "notes": records.attrs.get("notes", {}),
                        "torch": torch.__version__},
               "records": json.loads(records.to_json(orient="records"))}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)


def load_records(path: str) -> pd.DataFrame:
    with open(path) as f:
        payload = json.load(f)
    df = pd.DataFrame(payload["records"])
    df.attrs["notes"] = payload.get("meta", {}).get("notes", {})
    return df
