"""Start the rank factory early: the forkserver that ``labkit.launch`` forks ranks from.

The forkserver is a fresh interpreter that imports torch once (~2 s here), so that every later
launch forks ranks in milliseconds. In a Jupyter kernel, ``import labkit`` starts it before it
imports torch itself, so the server's import runs beside the kernel's on another core and the
first launch finds it ready. This module imports nothing heavy, on purpose.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys

# What the forkserver imports before it forks any rank; the last one freezes the heap it built.
# torch._dynamo is what the first torch.optim optimizer imports (with sympy): ~2.4 s that every
# rank of every run paid when it was imported after the fork.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle", "labkit", "labkit.launch",
           "labkit.strategies.ddp", "labkit.strategies.ddp_naive", "labkit.strategies.dp",
           "labkit.strategies.single", "labkit.strategies.model_parallel",
           "labkit.strategies.pipeline", "labkit._forkserver_init"]
# Set by the process that started the forkserver. Everything it starts (the forkserver, ranks,
# a torchrun job launched from the notebook) inherits it and so never starts one of its own.
_OWNER = "LABKIT_FORKSERVER_OWNER"


def context():
    """The multiprocessing context ranks start from: a preloaded forkserver, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)   # takes effect when the server first starts
        return ctx
    return mp.get_context("spawn")


def start() -> bool:
    """Start the forkserver now (idempotent); False where this process must not own one."""
    owner = os.environ.get(_OWNER)
    if owner not in (None, str(os.getpid())) or "RANK" in os.environ:
        return False                          # a forkserver, a rank, or a torchrun worker
    if "forkserver" not in mp.get_all_start_methods():
        return False
    os.environ[_OWNER] = str(os.getpid())
    context()
    from multiprocessing import forkserver
    forkserver.ensure_running()               # returns at once; the server preloads meanwhile
    return True


def start_in_kernel() -> bool:
    """``start()`` inside a Jupyter kernel (or with LABKIT_PREWARM=1); elsewhere, a script or
    the CLI starts the forkserver on its first launch."""
    if "ipykernel" in sys.modules or os.environ.get("LABKIT_PREWARM") == "1":
        return start()
    return False
