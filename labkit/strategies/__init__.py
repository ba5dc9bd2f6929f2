"""Training strategies, one module each, all with the same entry point.

``run(cfg, ctx, fns) -> {"records": [...], "params": ..., "notes": [...]}`` runs inside one rank
process (``fns``: the user's ``labkit.factories.Factories``, or labkit's own pieces);
``run_rank`` is what the launcher and torchrun call.
"""

from __future__ import annotations

import importlib

from .. import registry
from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories


def get(name: str):
    """The module implementing strategy ``name`` (``labkit.registry`` names it)."""
    return importlib.import_module(f"{__name__}.{registry.get(name).module}")


def run_rank(ctx: RankContext, cfg: RunConfig, fns: Factories | None = None) -> dict:
    """One rank of ``cfg.strategy``: what ``labkit.launch`` runs on every rank."""
    return get(cfg.strategy).run(cfg, ctx, fns or Factories())
