"""labkit: see distributed PyTorch training run, from a notebook or a terminal.

import labkit
labkit.env_probe()                                   # what this machine has
labkit.launch(fn, world_size=2)                      # fn(ctx) on 2 rank processes
res = labkit.run(labkit.RunConfig(strategy="ddp"))   # one strategy, measured
"""

from . import _prewarm

_prewarm.start_in_kernel()  # before torch is imported here: see labkit/_prewarm.py

from .config import RunConfig  # noqa: E402
from .dist import RankContext, cleanup, print0, reduce_scalar, rprint, session, setup  # noqa: E402
from .env import probe as env_probe  # noqa: E402
from .launch import LaunchCancelled, LaunchError, LaunchTimeout, RankError, launch  # noqa: E402

__version__ = "0.1.0"

# pandas/plotly-backed parts load on first use, so rank processes (which import labkit) stay lean.
_LAZY = {
    "run": "experiment",
    "compare": "experiment",
    "grid": "experiment",
    "summarize": "records",
    "check": "labs.equivalence",
    "dryrun": "labs.dryrun",  # one rank of a job of any size, on tensors without storage
    # one panel per lab
    "run_panel": "widgets",
    "pipeline_panel": "widgets",
    "comm_panel": "widgets",
    "balance_panel": "widgets",
    "memory_panel": "widgets",
    "sync_panel": "widgets",
    "elastic_panel": "widgets",
    "sched_panel": "widgets",
    "moe_panel": "widgets",
    "cp_panel": "widgets",
    "fit_panel": "widgets",
}
_SUBMODULES = (
    "registry",
    "experiment",
    "records",
    "report",
    "trace",
    "plots",
    "predict",
    "labs",
    "widgets",
    "shares",
    "rank",
    "flags",
)


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")


__all__ = [
    "RunConfig",
    "RankContext",
    "session",
    "setup",
    "cleanup",
    "print0",
    "rprint",
    "reduce_scalar",
    "env_probe",
    "launch",
    "LaunchError",
    "RankError",
    "LaunchTimeout",
    "LaunchCancelled",
    *_LAZY,
]
