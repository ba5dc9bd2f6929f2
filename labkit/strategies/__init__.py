"""Training strategies, one module each, all with the same entry point.

``run(cfg, ctx, fns) -> {"records": [...], "params": ..., "notes": [...]}`` runs inside one rank
process (``fns``: the user's ``labkit.factories.Factories``, or labkit's own pieces);
``run_rank`` is what the launcher and torchrun call.
"""

from __future__ import annotations

import importlib

from ..config import STRATEGY_RANKS, RunConfig
from ..dist import RankContext
from ..factories import Factories

# strategy name -> module in this package
_MODULES = {
    "single": "single",
    "dp": "dp",
    "ddp": "ddp",
    "ddp_naive": "ddp_naive",
    "model_parallel": "model_parallel",
    "pipeline_gpipe": "pipeline",
    "pipeline_1f1b": "pipeline",
    "zero1": "zero1",
    "fsdp": "fsdp",
    "local_sgd": "local_sgd",
    "diloco": "diloco",
    "async_ps": "async_ps",
    "hogwild": "hogwild",
}
assert set(_MODULES) == set(STRATEGY_RANKS)


def get(name: str):
    """The module implementing strategy ``name``."""
    if name not in _MODULES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(_MODULES)}")
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")


def run_rank(ctx: RankContext, cfg: RunConfig, fns: Factories | None = None) -> dict:
    """One rank of ``cfg.strategy``: what ``labkit.launch`` runs on every rank."""
    return get(cfg.strategy).run(cfg, ctx, fns or Factories())
