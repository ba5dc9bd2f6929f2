"""Rank functions the tests launch by reference (cloudpickle sends these as module + name)."""

from __future__ import annotations

import io
import os
import time
from contextlib import redirect_stdout

import torch
import torch.distributed as dist

# The caller overwrites this after import; a rank that was forked from the caller would see the
# new value, a rank from a fresh interpreter (the forkserver) sees this one.
MARK = "module default"


def whoami(ctx) -> dict:
    """Who this rank is, as the process group and the context see it."""
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t)  # proves the group really connects the ranks
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "backend": ctx.backend,
        "distributed": ctx.distributed,
        "is_main": ctx.is_main,
        "group_rank": dist.get_rank(),
        "group_size": dist.get_world_size(),
        "rank_sum": float(t.item()),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "mark": MARK,
        "env_mark": os.environ.get("LABKIT_TEST_MARK"),
        "threads": torch.get_num_threads(),
    }


def raise_on(ctx, bad_rank: int, message: str) -> int:
    """``bad_rank`` raises; the others wait in a barrier the bad rank never joins."""
    if ctx.rank == bad_rank:
        raise ValueError(message)
    dist.barrier()
    return ctx.rank


def hang_forever(ctx) -> None:
    """Sleep in Python until stopped (a hang the launcher's timeout_s must bound)."""
    while True:
        time.sleep(0.05)


def report_pid_then_block(ctx) -> None:
    """Tell the caller this rank's pid, then block: rank 0 in a barrier, the rest sleeping."""
    ctx.report(pid=os.getpid())
    if ctx.rank == 0:
        dist.barrier()  # never completes: the peers never arrive
    hang_forever(ctx)


def reductions(ctx) -> dict:
    """reduce_scalar with every op, on the value rank + 1."""
    from labkit.dist import reduce_scalar

    return {op: reduce_scalar(ctx.rank + 1, op) for op in ("sum", "mean", "max", "min")}


def printed(ctx) -> str:
    """What print0 and rprint write on this rank."""
    from labkit.dist import print0, rprint

    buf = io.StringIO()
    with redirect_stdout(buf):
        print0("from print0")
        rprint("from rprint")
    return buf.getvalue()


def seed_style(ctx) -> dict:
    """The articles' shape: setup(rank, world_size), a collective, cleanup()."""
    from labkit.dist import cleanup, setup

    before = {
        "backend": ctx.backend,
        "distributed": ctx.distributed,
        "initialized": dist.is_initialized(),
        "env": {
            k: os.environ.get(k)
            for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        },
    }
    inner = setup(ctx.rank, ctx.world_size)
    t = torch.ones(1) * (ctx.rank + 1)
    dist.all_reduce(t)
    after_setup = {
        "rank": inner.rank,
        "world_size": inner.world_size,
        "backend": inner.backend,
        "sum": float(t.item()),
    }
    cleanup()
    cleanup()  # documented as safe to call twice
    return {"before": before, "inner": after_setup, "cleaned": not dist.is_initialized()}


def _write_and_exit(text: str, code: int):
    os.write(2, text.encode())  # as a C++ abort would: straight to the file descriptor
    os._exit(code)


class DiesWhenUnpickled:
    """An argument whose unpickling, on the rank, writes to stderr and exits: a rank that dies
    before it runs the function, without a Python traceback."""

    def __init__(self, text: str, code: int = 9):
        self.text, self.code = text, code

    def __reduce__(self):
        return _write_and_exit, (self.text, self.code)
