"""Run a function on N rank processes from a notebook or a script, and get the results back.

``launch(fn, world_size=2)`` calls ``fn(ctx, *args)`` on every rank with the process group set up
and returns the return values in rank order. What it guarantees, and how:

* Spawn-safe but fast. Ranks are forked from a *forkserver*: a fresh interpreter started once
  (never a fork of the kernel, which may hold CUDA state or threads) that imported torch up front.
  The first launch pays for that import (~1.5 s); later launches fork in well under 0.2 s.
* Notebook functions work: ``fn`` and its arguments travel by value (cloudpickle), so a function
  defined in a cell needs no module.
* No port races: the launcher holds the rendezvous TCPStore itself on a port the OS picks.
* One error, quickly: a rank that raises sends its traceback before tearing down; the caller
  stops every rank and raises ``RankError`` naming it. A rank that dies silently (a segfault,
  ``os._exit``, a C++ abort) is seen through its process sentinel at once, and its error carries
  the tail of what it wrote to stderr: each rank's stderr goes to a file that the caller copies
  to its own stderr when the launch ends.
* Scripts need no ``__main__`` guard: the ranks never re-import the caller's main module
  (functions travel by value), so a top-level ``launch(...)`` in a script, or a script read from
  standard input, runs once.
* Bounded: past ``timeout_s`` the ranks still running dump their Python stacks (faulthandler),
  are stopped, and ``LaunchTimeout`` carries those stacks, so a hang says where it hung.
* Nothing outlives the call: every exit path (return, error, timeout, Ctrl-C, a Jupyter
  interrupt, a ``cancel`` event) terminates, kills and joins the ranks (on a return, with every
  result in hand, the ranks are killed at once and joined on a background thread: their exits
  take ~15 ms that the caller need not wait for); and should the caller itself die, each rank
  watches a lifeline pipe and exits when it closes.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from multiprocessing.connection import wait
from typing import Any

import cloudpickle

from . import _prewarm
from .env import cpu_cores, resolve_device, usable_cores

__all__ = ["launch", "LaunchError", "RankError", "LaunchTimeout", "LaunchCancelled"]

_STOP_GRACE_S = 2.0
_ROOT_CAUSE_WAIT_S = 0.5
_STACKS_WAIT_S = 2.0  # the most a timeout waits for the ranks' stacks
_STACKS_POLL_S = 0.01


class LaunchError(RuntimeError):
    """A launch did not return a result from every rank."""


class RankError(LaunchError):
    """A rank raised or died; ``rank`` names it, ``traceback`` carries its traceback text and
    ``stderr_tail`` the last lines it wrote to stderr when it died without a traceback."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        traceback_text: str,
        exitcode: int | None = None,
        stderr_tail: str = "",
    ):
        self.rank, self.world_size, self.traceback, self.exitcode = (
            rank,
            world_size,
            traceback_text,
            exitcode,
        )
        self.stderr_tail = stderr_tail
        said = f"\n--- rank {rank}'s stderr ended with:\n{stderr_tail}" if stderr_tail else ""
        super().__init__(f"rank {rank} of {world_size} failed:\n{traceback_text.rstrip()}{said}")


class LaunchTimeout(LaunchError, TimeoutError):
    """Ranks were still running after ``timeout_s``; ``stacks`` maps rank -> where it was."""

    def __init__(self, timeout_s: float, stacks: dict[int, str]):
        self.timeout_s, self.stacks = timeout_s, stacks
        self.rank = min(stacks) if stacks else None
        where = "\n".join(
            f"--- rank {r} was at:\n{s.rstrip() or '(no stack captured)'}"
            for r, s in sorted(stacks.items())
        )
        super().__init__(
            f"ranks {sorted(stacks)} still running after {timeout_s:g} s (timeout_s); "
            f"stopped them. A rank waiting in a collective that a peer never joins hangs until "
            f"this timeout.\n{where}"
        )


class LaunchCancelled(LaunchError):
    """The caller's ``cancel`` event was set (a Stop button); every rank was stopped."""


def own_cores(world_size: int, threads: int) -> list[list[int]] | None:
    """Cores for each rank, ``threads`` of them each, from those this process may use; None
    (the OS places the ranks) when they do not fit, for one rank, where the platform cannot
    pin, or with ``LABKIT_PIN=0`` (what pinning changed on 2 cores: ``benchmarks/README.md``,
    load_balance.py)."""
    if world_size < 2 or os.environ.get("LABKIT_PIN") == "0":
        return None
    cores = usable_cores()
    if cores is None or world_size * threads > len(cores):
        return None
    return [cores[r * threads : (r + 1) * threads] for r in range(world_size)]


def launch(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout_s: float | None = None,
    device: str = "auto",
    backend: str | None = None,
    setup: bool = True,
    threads: int | None = None,
    on_progress: Callable[[int, dict], None] | None = None,
    cancel: threading.Event | None = None,
) -> list:
    """Call ``fn(ctx, *args, **kwargs)`` on ``world_size`` rank processes; return results in rank
    order.

    ``ctx`` is a ``labkit.dist.RankContext``. With ``setup=False`` no process group is created:
    the rank finds MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in its environment and calls
    ``labkit.dist.setup(ctx.rank, ctx.world_size)`` / ``cleanup()`` itself, as the articles do.
    ``ctx.report(**metrics)`` on a rank calls ``on_progress(rank, metrics)`` here, in the caller.
    ``device``: "auto" (one GPU per rank if there are enough, else CPU), "cpu" or "cuda".
    ``threads``: torch threads per rank; default cores // world_size so ranks don't thrash.
    When the ranks' threads fit the cores, each rank is pinned to cores of its own
    (``own_cores``): a rank the OS moves between cores, or that shares one with another rank's
    threads for a moment, computes less evenly, and every synchronous step waits for the
    slowest. ``LABKIT_PIN=0`` in the environment leaves placement to the OS.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a whole number >= 1, got {world_size!r}")
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive or None, got {timeout_s!r}")
    kind = resolve_device(device, world_size)
    payload = _pack(fn, args, kwargs or {})
    threads = threads or max(1, cpu_cores() // world_size)
    ctx = _prewarm.context()
    _prewarm.ensure_running(ctx)

    import torch.distributed as dist  # the parent holds the rendezvous store for this launch

    store = None
    env = dict(os.environ)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo" if sys.platform.startswith("linux") else "lo0")
    if setup:
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_td(timeout_s)
        )
        spec_store = ("127.0.0.1", store.port)
    else:
        spec_store = None
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
        )
    spec = {
        "world_size": world_size,
        "device": kind,
        "backend": backend,
        "threads": threads,
        "cores": own_cores(world_size, threads),
        "store": spec_store,
        "env": env,
        "timeout_s": timeout_s or 1800.0,
    }

    life_r, life_w = ctx.Pipe(duplex=False)
    procs, conns, dumps, errs, done = [], {}, {}, {}, False
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            dumps[rank], errs[rank] = (_temp_path(f"labkit-rank{rank}-{what}-") for what in "ds")
            p = ctx.Process(
                target=_rank_main,
                name=f"labkit-rank{rank}",
                daemon=True,
                args=(payload, rank, spec, writer, life_r, dumps[rank], errs[rank]),
            )
            with _main_hidden():
                p.start()
            writer.close()  # the parent keeps only the read end: EOF means gone
            procs.append(p)
            conns[reader] = rank
        results = _collect(procs, conns, timeout_s, on_progress, cancel, dumps, errs)
        done = True
        return results
    finally:
        life_w.close()  # every rank's lifeline reads EOF
        if done:  # every result is in: nothing left to lose
            _kill_and_reap(procs)
        else:
            _stop(procs)
        for c in conns:
            c.close()
        _forward_stderr(errs)
        for path in (*dumps.values(), *errs.values()):
            _unlink(path)
        if store is not None:
            del store


def _collect(procs, conns, timeout_s, on_progress, cancel, dumps, errs) -> list:
    world_size = len(procs)
    results: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    open_conns = dict(conns)
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}

    def handle(conn, rank) -> None:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            open_conns.pop(conn, None)
            return
        if kind == "progress":
            if on_progress is not None:
                on_progress(rank, payload)
        elif kind == "result":
            results[rank] = cloudpickle.loads(payload)
        elif kind == "error":
            raise _root_cause(rank, payload, procs, sentinels, results, errs)

    while len(results) < world_size:
        if cancel is not None and cancel.is_set():
            raise LaunchCancelled(f"cancelled; stopped all {world_size} ranks")
        wait_s = 0.1 if cancel is not None else 1.0
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = [r for r in range(world_size) if r not in results]
                raise LaunchTimeout(timeout_s, _dump_stacks(procs, running, dumps))
            wait_s = min(wait_s, remaining)
        ready = wait(list(open_conns) + list(sentinels), timeout=wait_s)
        for obj in ready:  # messages first: a rank may write, then exit
            if obj in open_conns:
                handle(obj, open_conns[obj])
        for obj in ready:
            rank = sentinels.get(obj)
            if rank is None:
                continue
            del sentinels[obj]
            for conn, r in list(open_conns.items()):  # drain what it sent before dying
                if r == rank:
                    while conn in open_conns and conn.poll():
                        handle(conn, rank)
            if rank not in results:
                code = procs[rank].exitcode
                raise RankError(
                    rank,
                    world_size,
                    f"process exited with code {code} before returning a result "
                    f"({_describe_exit(code)})",
                    exitcode=code,
                    stderr_tail=_tail(errs[rank]),
                )
    return [results[r] for r in range(world_size)]


@contextmanager
def _main_hidden():
    """multiprocessing re-imports the caller's main module in every new process (from its
    ``__file__``, or by name under ``python -m``). Ranks do not need it: functions travel by
    value (``_pack``). Importing it again ran a script's top-level ``launch`` once more in every
    rank (each rank then failed, asking for an ``if __name__ == '__main__':`` guard) and failed
    outright for a script read from standard input (``'<stdin>'`` is not a file). So the main
    module shows no file and no name while the processes start."""
    main = sys.modules.get("__main__")
    names = vars(main) if main is not None else {}
    saved = {k: names[k] for k in ("__file__", "__spec__") if k in names}
    names.pop("__file__", None)
    if "__spec__" in names:
        names["__spec__"] = None
    try:
        yield
    finally:
        names.update(saved)


def _root_cause(rank, text, procs, sentinels, results, errs) -> RankError:
    """The error to raise when ``rank`` reported ``text``. A peer that died outside Python (a
    segfault, SIGKILL, os._exit) sends nothing, and the first message to arrive is then the
    survivor's "connection closed by peer"; so give the others a moment to exit, and name a rank
    that died silently as the cause."""
    world_size = len(procs)
    deadline = time.monotonic() + _ROOT_CAUSE_WAIT_S
    while time.monotonic() < deadline:
        silent = [
            r
            for r in sentinels.values()
            if r != rank and r not in results and procs[r].exitcode not in (None, 0, 1)
        ]
        if silent:
            r = silent[0]
            code = procs[r].exitcode
            return RankError(
                r,
                world_size,
                f"process exited with code {code} without reporting "
                f"({_describe_exit(code)}); then rank {rank} failed:\n{text}",
                exitcode=code,
                stderr_tail=_tail(errs[r]),
            )
        alive = [s for s, r in sentinels.items() if r != rank and procs[r].exitcode is None]
        if not alive:
            break
        wait(alive, timeout=max(0.0, deadline - time.monotonic()))
    return RankError(rank, world_size, text)


def _rank_main(
    payload: bytes, rank: int, spec: dict, conn, lifeline, dump_path: str, stderr_path: str
) -> None:
    # Everything this process writes to stderr from here on, Python or C++ (an abort's message,
    # a warning), goes to a file: the caller copies it out at the end and quotes its tail in the
    # error of a rank that died without a traceback.
    sys.stderr.flush()
    err = os.open(stderr_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(err, 2)
    os.close(err)
    # Jupyter's interrupt signals the kernel's whole process group; the caller owns stopping.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_lifeline, args=(lifeline,), daemon=True).start()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=open(dump_path, "w"), all_threads=False)
    gc.enable()  # on already, unless the server's preload broke off
    os.environ.clear()  # the forkserver's environment is from when it started
    os.environ.update(spec["env"])
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))

    import torch

    from . import dist as ldist

    torch.set_num_threads(spec["threads"])
    if spec["cores"]:
        os.sched_setaffinity(0, spec["cores"][rank])

    def report(**metrics) -> None:
        conn.send(("progress", metrics))

    sent_error = False
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        if spec["store"] is None:
            dev = torch.device("cuda", rank) if spec["device"] == "cuda" else torch.device("cpu")
            if dev.type == "cuda":
                torch.cuda.set_device(rank)
            ctx = ldist.RankContext(rank, rank, spec["world_size"], dev, None, report)
            try:
                result = fn(ctx, *args, **kwargs)
            finally:
                ldist.cleanup()  # in case the lesson forgot its own cleanup()
        else:
            import torch.distributed as dist

            host, port = spec["store"]
            store = dist.TCPStore(host, port, is_master=False, timeout=_td(spec["timeout_s"]))
            # No barrier after init and no teardown: once it has sent its result, a rank waits
            # to be stopped by the caller (which does so as soon as every rank's result is in),
            # so it can never destroy the group under a peer that is still connecting, and the
            # teardown (gc.collect + destroy, ~0.1 s) stays off the caller's critical path.
            with ldist.session(
                rank,
                spec["world_size"],
                device=spec["device"],
                backend=spec["backend"],
                store=store,
                barrier=False,
                timeout_s=spec["timeout_s"],
                report=report,
            ) as ctx:
                try:
                    result = fn(ctx, *args, **kwargs)
                    _send_result(conn, rank, result)
                except BaseException:
                    # Report before the group is torn down, so this rank, not a peer that then
                    # loses its connection, is the one the caller hears about first.
                    conn.send(("error", traceback.format_exc()))
                    sent_error = True
                    raise
                threading.Event().wait()  # until the caller stops us (or the lifeline ends)
        _send_result(conn, rank, result)
    except BaseException:
        if not sent_error:
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _send_result(conn, rank: int, result) -> None:
    try:
        data = cloudpickle.dumps(result)
    except Exception as exc:
        raise TypeError(
            f"rank {rank} returned a {type(result).__name__} that cannot be sent "
            f"back to the caller ({exc}); return plain data (numbers, dicts, "
            f"tensors, DataFrames)"
        ) from exc
    conn.send(("result", data))


def _watch_lifeline(lifeline) -> None:
    try:
        lifeline.recv()
    except (EOFError, OSError):
        pass
    os._exit(3)  # the caller is gone or done: never linger


def _pack(fn, args, kwargs) -> bytes:
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {type(fn).__name__}")
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception:
        pass
    for what, obj in [
        (f"the function {getattr(fn, '__name__', fn)!r}", fn),
        *((f"argument {i}", a) for i, a in enumerate(args)),
        *((f"keyword argument {k!r}", v) for k, v in kwargs.items()),
    ]:
        try:
            cloudpickle.dumps(obj)
        except Exception as exc:
            raise TypeError(
                f"{what} cannot be sent to the rank processes ({type(exc).__name__}: {exc}). "
                f"Ranks are separate processes: pass plain data (numbers, strings, tensors, a "
                f"RunConfig) and build things like open files, locks, sockets or generators "
                f"inside the function."
            ) from exc
    raise TypeError("the function and its arguments cannot be sent to the rank processes")


def _dump_stacks(procs, ranks, dumps) -> dict[int, str]:
    """Where each of ``ranks`` is: SIGUSR1 makes faulthandler write the rank's stack into its
    dump file from inside the signal handler, so a rank stuck in C code answers too. Wait until
    every asked rank's dump is written (not empty, and no longer growing), the rank is gone, or
    ``_STACKS_WAIT_S`` has passed."""
    asked = []
    for r in ranks:
        if procs[r].is_alive() and hasattr(signal, "SIGUSR1"):
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
                asked.append(r)
            except ProcessLookupError:
                pass
    sizes: dict[int, int] = {}
    deadline = time.monotonic() + _STACKS_WAIT_S
    while asked and time.monotonic() < deadline:
        time.sleep(_STACKS_POLL_S)
        for r in list(asked):
            size = os.path.getsize(dumps[r]) if os.path.exists(dumps[r]) else 0
            if (size and size == sizes.get(r)) or not procs[r].is_alive():
                asked.remove(r)
            sizes[r] = size
    stacks = {}
    for r in ranks:
        try:
            with open(dumps[r]) as f:
                stacks[r] = f.read()
        except OSError:
            stacks[r] = ""
    return stacks


def _kill_and_reap(procs) -> None:
    """SIGKILL every rank now and wait for their exits on a background thread: a rank forked
    from the preloaded forkserver takes ~15 ms to unmap its memory, which the caller, holding
    every result, need not wait for."""
    for p in procs:
        if p.exitcode is None:
            p.kill()
    threading.Thread(
        target=lambda: [p.join() for p in procs], name="labkit-reaper", daemon=True
    ).start()


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 1:
        return "it failed before it could report"
    return "it called os._exit or crashed outside Python" if code else "no result was sent"


def free_port() -> int:
    """A loopback port nobody holds now (a fixed 29500 collides between notebooks)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _temp_path(prefix: str) -> str:
    with tempfile.NamedTemporaryFile("w", prefix=prefix, suffix=".txt", delete=False) as f:
        return f.name


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


def _forward_stderr(errs: dict[int, str]) -> None:
    """What each rank wrote to stderr, on the caller's stderr (file descriptor 2, where the
    ranks' own stderr pointed before: a terminal, or the log of a Jupyter server), each line
    marked with its rank."""
    for rank, path in sorted(errs.items()):
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError:
            continue
        if text.strip():
            lines = text.decode(errors="replace").rstrip().splitlines()
            marked = "".join(f"[rank {rank}] {line}\n" for line in lines)
            try:
                sys.stderr.flush()
                os.write(2, marked.encode())
            except OSError:
                pass


def _td(seconds: float | None):
    from datetime import timedelta

    return timedelta(seconds=seconds or 1800.0)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
