"""Start the rank factory early: the forkserver that ``labkit.launch`` forks ranks from.

The forkserver is a fresh interpreter that imports torch once, so that every later
launch forks ranks in milliseconds. In a Jupyter kernel, ``import labkit`` starts it before it
imports torch itself, so the server's import runs beside the kernel's on another core and the
first launch finds it ready. This module imports nothing heavy, on purpose.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import sys

# What the forkserver imports before it forks any rank, in order: this module first (through
# labkit/__init__, which imports it before anything heavy), so the collector is off before torch
# comes in; the last one freezes the heap it built. torch._dynamo is what the first torch.optim
# optimizer imports (with sympy): imported after the fork, every rank of every run would pay
# for it.
PRELOAD = [
    "labkit._prewarm",
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "cloudpickle",
    "labkit",
    "labkit.launch",
    "labkit.strategies.ddp",
    "labkit.strategies.ddp_naive",
    "labkit.strategies.dataparallel",
    "labkit.strategies.single",
    "labkit.strategies.model_parallel",
    "labkit.strategies.pipeline",
    "labkit._forkserver_init",
]
# Set by the process that started the forkserver. Everything it starts (the forkserver, ranks,
# a torchrun job launched from the notebook) inherits it and so never starts one of its own.
_OWNER = "LABKIT_FORKSERVER_OWNER"
# Set only while the forkserver is being started, so only the server sees it.
_PRELOADING = "LABKIT_FORKSERVER_PRELOADING"

# In the forkserver, while it preloads: the imports create ~10^6 objects and the collections
# they trigger free none of them, yet cost a good share of the preload (benchmarks/README.md,
# "Behind the code"). _forkserver_init, the last import, freezes the heap and turns collection
# back on.
if os.environ.pop(_PRELOADING, None) == "1" and "multiprocessing.forkserver" in sys.modules:
    gc.disable()


def context():
    """The multiprocessing context ranks start from: a preloaded forkserver, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server first starts
        return ctx
    return mp.get_context("spawn")


def start() -> bool:
    """Start the forkserver now (idempotent); False where this process must not own one."""
    owner = os.environ.get(_OWNER)
    if owner not in (None, str(os.getpid())) or "RANK" in os.environ:
        return False  # a forkserver, a rank, or a torchrun worker
    if "forkserver" not in mp.get_all_start_methods():
        return False
    os.environ[_OWNER] = str(os.getpid())
    ensure_running(context())
    return True


def ensure_running(ctx) -> None:
    """Start ``ctx``'s forkserver unless it runs (returns at once; it preloads meanwhile),
    telling it to preload with the garbage collector off."""
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    os.environ[_PRELOADING] = "1"
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(_PRELOADING, None)


def start_in_kernel() -> bool:
    """``start()`` inside a Jupyter kernel (or with LABKIT_PREWARM=1); elsewhere, a script, the
    CLI or pytest starts the forkserver on its first launch."""
    if _in_kernel() or os.environ.get("LABKIT_PREWARM") == "1":
        return start()
    return False


def _in_kernel() -> bool:
    """This process is a running Jupyter kernel, not one that merely imported ipykernel (pytest
    does, through nbval's plugin)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None
