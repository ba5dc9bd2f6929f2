"""Will it fit, and what will it send? One rank of a job of any size, its real strategy code run
on tensors without storage (``core``), beside the calculator and the layout advisor
(``beside``), and the published figures it reproduces (``published``). Notebook 16."""

from .core import (
    LLAMA_7B,
    LLAMA_70B,
    DryRun,
    MasterAdam,
    RankRun,
    TokenSequences,
    Transformer,
    dryrun,
    layout_config,
    ranks_that_differ,
    real,
    strategy_for_layout,
)

__all__ = [
    "LLAMA_7B",
    "LLAMA_70B",
    "DryRun",
    "MasterAdam",
    "RankRun",
    "TokenSequences",
    "Transformer",
    "dryrun",
    "layout_config",
    "ranks_that_differ",
    "real",
    "strategy_for_layout",
]
