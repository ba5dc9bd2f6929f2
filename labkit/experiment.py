"""Run configs on rank processes: one run, several in turn, or a grid of them.

Data flows one way: RunConfig -> ``launch`` -> every rank runs its strategy -> per-rank records
(``labkit.records.from_ranks``) -> tables and charts (``labkit.records``, ``labkit.plots``).
Whether a strategy computes what single-device training computes is ``labkit.labs.equivalence``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pandas as pd

from . import registry
from .config import RunConfig
from .env import oversubscription, resolve_device, threads_per_rank
from .factories import Factories, validate
from .launch import launch
from .records import config_label, from_ranks
from .strategies import run_rank

Progress = Callable[[int, dict], None]


@dataclass
class RunResult:
    cfg: RunConfig
    records: pd.DataFrame
    params: dict | None  # whole-model parameters (check mode), merged over ranks
    notes: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list, repr=False)  # raw per-rank results


def run(
    cfg: RunConfig,
    *,
    model_fn=None,
    data_fn=None,
    loss_fn=None,
    optimizer_fn=None,
    on_progress: Progress | None = None,
    cancel: threading.Event | None = None,
) -> RunResult:
    """Launch ``cfg`` on ``cfg.ranks`` processes and collect what every rank measured.

    Your own ``model_fn``/``data_fn``/``loss_fn``/``optimizer_fn`` (see ``labkit.factories``)
    are checked here, before any rank starts."""
    fns = Factories(model_fn, data_fn, loss_fn, optimizer_fn)
    validate(cfg, fns)
    kind = resolve_device(cfg.device, cfg.ranks)
    # On CPU the ranks share the cores; a lone process (single, dataparallel) may use all of them,
    # which is the honest baseline: that is what you would do without labkit.
    threads = cfg.threads or threads_per_rank(cfg.ranks, kind)
    results = launch(
        run_rank,
        cfg.ranks,
        args=(cfg, fns),
        timeout_s=cfg.timeout_s,
        device=kind,
        backend=cfg.backend,
        threads=threads,
        on_progress=on_progress,
        cancel=cancel,
    )
    oversub = oversubscription(cfg.ranks, threads) if kind == "cpu" else None
    records = from_ranks(cfg, results, oversub)
    params = None
    if cfg.deterministic:
        params = {}
        for res in results:  # DDP: every rank holds all; pipeline: one stage each
            params.update(res["params"] or {})
    return RunResult(cfg, records, params, records.attrs.pop("notes"), results)


def grid(base: RunConfig, strategies: Sequence[str], world_sizes: Sequence[int]) -> list[RunConfig]:
    """Configs for every strategy at every world size it can use (single once, at 1; pipeline
    strategies once, at ``stages``); invalid combinations raise with the fix.

    On CPU, ``single`` is also run on one rank's share of the cores for each rank share the
    grid uses (e.g. 1 thread beside ddp@2 on 2 cores): the parallel-efficiency reference, next
    to single on all cores (what you would get without distributing)."""
    configs = []
    for name in strategies:
        kind = registry.get(name).kind
        if kind == "reference":
            sizes = [1]
        elif kind == "pipeline":
            sizes = [base.stages]
        else:
            sizes = list(world_sizes)
        configs += [
            (_reference(base) if kind == "reference" else base.replace(strategy=name, world_size=w))
            for w in sizes
        ]
    ref = registry.REFERENCE
    if ref in strategies and resolve_device(base.device, 1) == "cpu" and base.threads is None:
        whole = threads_per_rank(1, "cpu")
        shares = sorted({threads_per_rank(c.ranks, "cpu") for c in configs} - {whole})
        at = next(i for i, c in enumerate(configs) if c.strategy == ref) + 1
        configs[at:at] = [configs[at - 1].replace(threads=t) for t in shares]
    return configs


def _reference(base: RunConfig) -> RunConfig:
    """Single-device training on ``base``'s model and batch, the reference the other runs are
    read against: every knob single does not take (slowed or balanced ranks, a DDP hook, a
    tensor or pipeline split, ...) back to its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    others = set().union(*(s.knobs for s in registry.STRATEGIES.values()))
    foreign = others - registry.get(registry.REFERENCE).knobs
    return base.replace(
        strategy=registry.REFERENCE, world_size=1, **{k: defaults[k] for k in foreign}
    )


def compare(
    configs: Iterable[RunConfig],
    *,
    model_fn=None,
    data_fn=None,
    loss_fn=None,
    optimizer_fn=None,
    on_progress: Callable[[RunConfig, int, dict], None] | None = None,
    on_result: Callable[[RunResult], None] | None = None,
    cancel: threading.Event | None = None,
) -> pd.DataFrame:
    """Run each config in turn; return all records in one DataFrame (notes in ``.attrs``)."""
    results = []
    for cfg in configs:
        cb = None if on_progress is None else (lambda r, m, cfg=cfg: on_progress(cfg, r, m))
        res = run(
            cfg,
            model_fn=model_fn,
            data_fn=data_fn,
            loss_fn=loss_fn,
            optimizer_fn=optimizer_fn,
            on_progress=cb,
            cancel=cancel,
        )
        results.append(res)
        if on_result is not None:
            on_result(res)
    return combine(results)


def combine(results: Sequence[RunResult]) -> pd.DataFrame:
    """Several runs' records in one DataFrame, each run's notes in ``.attrs["notes"]``."""
    df = pd.concat([r.records for r in results], ignore_index=True) if results else pd.DataFrame()
    df.attrs["notes"] = {config_label(r.cfg): r.notes for r in results if r.notes}
    return df
