"""Process groups: set up, use, and always tear down.

``setup``/``cleanup`` are the two functions the articles teach; ``session`` is the same thing as a
context manager that picks the backend from the device, binds to loopback, applies a timeout,
hands back an immutable ``RankContext`` and destroys the group even when training raises.
Under ``torchrun`` the same ``session()`` call reads RANK/WORLD_SIZE/LOCAL_RANK from the
environment, so strategy code runs unchanged.
"""

from __future__ import annotations

import builtins
import gc
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .env import default_backend, resolve_device
from .wire import watch

# one collective each, named *_single from torch 2.14 and *_into_tensor / *_tensor before it


def all_gather_single(out, x, group=None, async_op=False):
    """``out`` = every rank's ``x`` concatenated along dim 0 (looked up per call: a wrapper a
    test or a profiler puts on ``torch.distributed`` sees it)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out, x, group=None, async_op=False):
    """``out`` = this rank's slice along dim 0 of the sum of every rank's ``x``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, x, group=group, async_op=async_op)


def _no_report(**metrics) -> None:
    pass


@dataclass(frozen=True)
class RankContext:
    """Who this process is in the group, and where its tensors live."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str | None  # None when no process group is set up (single process)
    # Sends a small dict of metrics to whoever launched this rank (the notebook's progress bars);
    # a no-op under torchrun or in a single process.
    report: Callable[..., None] = field(default=_no_report, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None and dist.is_available() and dist.is_initialized()

    @property
    def device_ids(self) -> list[int] | None:
        """What DDP's ``device_ids`` takes: this rank's GPU, or None for a CPU rank."""
        return [self.device.index] if self.device.type == "cuda" else None


def local_context(device: str = "auto", report: Callable[..., None] = _no_report) -> RankContext:
    """The context of a plain single process: rank 0 of 1, no process group."""
    kind = resolve_device(device, 1)
    dev = (
        torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")
    )
    return RankContext(0, 0, 1, dev, None, report)


def setup(
    rank: int,
    world_size: int,
    backend: str | None = None,
    *,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_s: float = 300.0,
) -> RankContext:
    """The articles' ``setup(rank, world_size)``, without the fixed port and the forced backend.

    Rendezvous is through MASTER_ADDR/MASTER_PORT (``labkit.launch(..., setup=False)`` and
    torchrun set both); pair every call with ``cleanup()``, or use ``session()`` which cannot
    forget.
    """
    os.environ["MASTER_ADDR"] = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    if master_port is not None:
        os.environ["MASTER_PORT"] = str(master_port)
    if "MASTER_PORT" not in os.environ:
        raise ValueError(
            "no MASTER_PORT: pass master_port=... (a free port), or start the ranks "
            "with labkit.launch(..., setup=False) or torchrun, which set it"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = _device_for(local_rank, "auto" if backend != "gloo" else "cpu", world_size)
    backend = backend or default_backend(device.type)
    _init(backend, device, "env://", rank=rank, world_size=world_size, timeout_s=timeout_s)
    return RankContext(rank, local_rank, world_size, device, backend)


def cleanup() -> None:
    """Destroy the default process group if there is one (safe to call twice)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def session(
    rank: int | None = None,
    world_size: int | None = None,
    *,
    device: str = "auto",
    backend: str | None = None,
    store: dist.Store | None = None,
    timeout_s: float = 300.0,
    report: Callable[..., None] = _no_report,
    barrier: bool = True,
) -> Iterator[RankContext]:
    """Set up the default process group, yield this rank's context, always destroy the group.

    With no rank/world_size, read them from the torchrun environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT). ``store`` is how ``labkit.launch`` rendezvouses
    (a TCPStore the launcher holds, so two launches can never race for one port).
    ``barrier=False`` skips the barrier after init, for a rank that never destroys the group
    before its peers are done (``labkit.launch``'s ranks are stopped by their caller).
    """
    if rank is None or world_size is None:
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except KeyError:
            raise ValueError(
                "session() needs rank and world_size, or a torchrun environment "
                "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
            ) from None
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    dev = _device_for(local_rank, device, local_world)
    backend = backend or default_backend(dev.type)
    if store is None:
        store = agent_store(world_size, timeout_s)
    init = None if store is not None else "env://"
    _init(
        backend,
        dev,
        init,
        rank=rank,
        world_size=world_size,
        timeout_s=timeout_s,
        store=store,
        barrier=barrier,
    )
    try:
        yield RankContext(rank, local_rank, world_size, dev, backend, report)
    finally:
        # DDP's reducer sits in reference cycles that keep the group's gloo work (and tensors)
        # alive until the interpreter shuts down, where freeing them aborts the process
        # ("terminate called without an active exception"; pytorch#179291).
        # Collect while Python is still fully alive, then destroy.
        gc.collect()
        cleanup()


def agent_store(world_size: int, timeout_s: float) -> dist.Store | None:
    """Under torchrun with the agent's store shared (torch's default), that store with keys of
    this attempt's own: a PrefixStore named after the agent's restart count (None elsewhere).

    The agent keeps one TCP store for the whole job and hands it to every attempt's workers.
    After a worker dies and the agent restarts the group, the new ranks publish their addresses
    under the same keys the dead ones used; a rank that reads a peer's key before the peer has
    rewritten it connects to a closed port (gloo: "connectFullMesh failed ... Connection
    refused"; how often: benchmarks/README.md, "Behind the code"). On
    one node every worker of an attempt has the same restart count; across nodes the counts can
    differ (only the failed node's agent counts the restart), so ``refuse_shared_store_restarts``
    stops that case."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    raw = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
    )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"labkit/{run_id}/restart{restart}", raw)


def refuse_shared_store_restarts() -> None:
    """Several torchrun nodes, restarts allowed and the agent's store shared: a restart would
    give the nodes' workers different keys (see ``agent_store``), so say what to set instead."""
    env = os.environ
    if (
        env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
        and int(env.get("GROUP_WORLD_SIZE", "1")) > 1
    ):
        raise ValueError(
            "several nodes with --max-restarts need a store per rendezvous round: start "
            "torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
        )


def _device_for(local_rank: int, device: str, local_world: int) -> torch.device:
    kind = resolve_device(device, local_world)
    if kind == "cuda":
        torch.cuda.set_device(local_rank)  # before any CUDA work: NCCL binds to this device
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _init(
    backend: str,
    device: torch.device,
    init_method: str | None,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    store=None,
    barrier: bool = True,
) -> None:
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("nccl needs GPU tensors; on CPU ranks use backend='gloo' (or None)")
    dist.init_process_group(
        backend,
        init_method=init_method,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    watch()  # count every byte this rank's group is handed (labkit.wire)
    # gloo connects its full mesh lazily; without this a rank that finishes at once can destroy
    # the group while a peer is still connecting ("connectFullMesh failed", ~1 launch in 60).
    if barrier:
        dist.barrier()


def clock_offset(ctx: RankContext, repeats: int = 8) -> float:
    """Seconds to add to this rank's ``perf_counter`` to read rank 0's.

    Processes on one machine share one monotonic clock (Linux CLOCK_MONOTONIC), so the offset
    is 0 and costs nothing. Across machines (under torchrun multi-node) each rank estimates it
    from timestamps exchanged with rank 0 (Cristian's algorithm: the reply with the shortest
    round trip, rank 0's clock taken at the midpoint), good to about half a round trip.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    if not ctx.distributed or local == ctx.world_size:
        return 0.0
    import time

    best, offset = float("inf"), 0.0
    t = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    for peer in range(1, ctx.world_size):  # one rank at a time, against rank 0
        for _ in range(repeats):
            if ctx.rank == peer:
                sent = time.perf_counter()
                dist.send(t, dst=0)
                dist.recv(t, src=0)
                back = time.perf_counter()
                if back - sent < best:
                    best, offset = back - sent, float(t.item()) - (sent + back) / 2
            elif ctx.rank == 0:
                dist.recv(t, src=peer)
                t.fill_(time.perf_counter())
                dist.send(t, dst=peer)
    return offset


# ---- rank-aware output -------------------------------------------------------------------------


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def print0(*args, **kwargs) -> None:
    """print on rank 0 only (every rank printing the same line is noise, in a random order)."""
    if _rank_and_world()[0] == 0:
        builtins.print(*args, **kwargs)


def rprint(*args, **kwargs) -> None:
    """print with a ``[rank r/w]`` prefix, for output that differs between ranks."""
    rank, world = _rank_and_world()
    builtins.print(f"[rank {rank}/{world}]", *args, **kwargs)


# ---- cross-rank reductions ---------------------------------------------------------------------

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def reduce_scalar(value: float, op: str = "mean", device: torch.device | None = None) -> float:
    """Combine one number from every rank: sum, mean, max (e.g. step time: the slowest rank
    gates the step) or min. Identity when no process group is set up."""
    if not (dist.is_available() and dist.is_initialized()):
        return float(value)
    if op not in (*_OPS, "mean"):
        raise ValueError(f"op must be one of sum, mean, max, min; got {op!r}")
    t = torch.tensor([float(value)], dtype=torch.float64, device=device or "cpu")
    dist.all_reduce(t, op=_OPS.get(op, dist.ReduceOp.SUM))
    if op == "mean":
        t /= dist.get_world_size()
    return float(t.item())


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average a tensor over ranks in place (what data parallelism does to every gradient)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def broadcast_parameters(model: torch.nn.Module, src: int = 0) -> None:
    """Every rank starts from ``src``'s parameters, whatever the model factory did (what DDP
    does at construction; the strategies that sync by hand do it themselves)."""
    for p in model.parameters():
        dist.broadcast(p.data, src=src)


def all_reduce_flat(tensors: list[torch.Tensor], group=None) -> None:
    """Sum each tensor over the ranks of ``group`` (default: all) in place, all of them in one
    message, as one DDP bucket does: one latency for the lot instead of one per tensor."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def gather_to_main(obj) -> list | None:
    """Collect one picklable object per rank on rank 0 (others get None)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def on_threads(fn: Callable, world_size: int, timeout_s: float = 30.0) -> list:
    """``fn(group)`` on ``world_size`` threads of this process, each rank ``group.rank()`` of a
    real gloo group of its own (an in-memory store between them): the collectives run exactly
    as between processes, without starting one. What the lessons draw runs this way; ranks that
    train need processes (``labkit.launch``). Returns each rank's result, in rank order; the
    first error any rank raised is raised here once every thread has stopped (a peer left
    waiting on the failed rank times out after ``timeout_s``: that error comes later)."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    store = dist.HashStore()
    results: list = [None] * world_size
    errors: list = []  # in the order they happened

    def rank(r: int) -> None:
        try:
            group = dist.ProcessGroupGloo(
                dist.PrefixStore("labkit-threads", store),
                r,
                world_size,
                timedelta(seconds=timeout_s),
            )
            results[r] = fn(group)
        except BaseException as e:  # raised in the caller's thread below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 5.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a rank thread was still running after {timeout_s + 5.0:.0f} s")
    return results


@contextmanager
def fake_rank(rank: int, world_size: int, device: str = "cpu") -> Iterator[RankContext]:
    """Be rank ``rank`` of ``world_size`` in this process on torch's "fake" process group:
    collectives return at once without sending anything, so a strategy's set-up (a device
    mesh, ``fully_shard``, a ZeRO partition) runs as it would on that rank of a job of any
    size. The group is destroyed on leaving. ``FakeStore`` lives in torch's test utilities
    (``torch.testing._internal.distributed.fake_pg``; written for torch 2.14)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already set up in this process: call labkit.cleanup() first"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield RankContext(rank, rank, world_size, torch.device(device), "fake")
    finally:
        cleanup()
