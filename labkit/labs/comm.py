"""Collective benchmark: how long all_reduce, all_gather, reduce_scatter and broadcast take on
this machine, per message size, as nccl-tests reports them (``algbw``, ``busbw``), next to this
machine's ceilings measured in the same run (loopback TCP, memcpy).

    python -m labkit comm --world-size 2 --sizes 1KiB-64MiB --json out/comm.json

Definitions (nccl-tests, doc/PERFORMANCE.md): ``algbw = S / t`` with ``S`` the message size
(the gathered output for all_gather, the scattered input for reduce_scatter); ``busbw = algbw *
factor`` with factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather and reduce_scatter, 1 for
broadcast: the bandwidth each link must carry, comparable across ops and world sizes and with
the link's own speed. A repeat starts on every rank together (a barrier), makes ``ITERS`` calls
back to back and divides, as nccl-tests does (DDP's buckets and a hand-written all-reduce per
tensor also run back to back); its time is the slowest rank's (a collective ends when the last
rank has its result). The table keeps the median over repeats and the p10/p90 spread.
"""

from __future__ import annotations

import re
import socket
import statistics
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..dist import RankContext, all_gather_single, reduce_scatter_single
from ..predict.collectives import OPS, bus_factor
from ..records import summarize
from ..report import human_bytes  # noqa: F401  (comm.human_bytes: the benchmark tables use it)

# The alpha-beta fit uses the mean time per call, not the median: a training step makes many
# calls and pays every slow one (on a shared CPU, a scheduler tick in a fraction of the calls),
# and the expectation of a sum is the sum of the means. The table shows the median and p10/p90.
FIT_ON = "mean_s"
ITERS = 5  # back-to-back calls per timed repeat (nccl-tests times a loop too)
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6}


def parse_size(text: str) -> int:
    """'64KiB' -> 65536 (B, KiB, MiB, GiB, KB, MB; a bare number is bytes)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text)
    if not m:
        raise ValueError(f"cannot read size {text!r}: write e.g. 4096, 64KiB or 16MiB")
    return int(float(m.group(1)) * UNITS[m.group(2) or "B"])


def size_range(text: str, step: int = 4) -> list[int]:
    """'1KiB-64MiB' -> 1 KiB, 4 KiB, ..., 64 MiB (times ``step``); 'a,b,c' -> those sizes."""
    if "," in text or "-" not in text:
        sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    else:
        lo, hi = (parse_size(t) for t in text.split("-", 1))
        if lo > hi:
            raise ValueError(
                f"size range {text!r} runs backwards: write small-large, e.g. 1KiB-64MiB"
            )
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= step
    if not sizes or min(sizes) < 4:
        raise ValueError(f"sizes {text!r}: every size must be at least 4 bytes (one float32)")
    return sizes


def message_numel(n: int, nbytes: int) -> int:
    """float32 elements of the message sent for a requested ``nbytes`` on ``n`` ranks: a
    multiple of n (each rank's part is whole), at least n. Its bytes, not the request, are what
    the table reports (1 KiB on 3 ranks moves 1,020 B; 16 B on 8 ranks moves 32 B)."""
    return max(n, nbytes // 4 // n * n)


def _call(op: str, n: int, nbytes: int, device: torch.device):
    """A zero-argument function that runs ``op`` once on a message of ``nbytes``."""
    numel = message_numel(n, nbytes)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full)
    if op == "all_gather":  # S = the gathered output
        return lambda: all_gather_single(full, part)
    if op == "reduce_scatter":  # S = the scattered input
        return lambda: reduce_scatter_single(part, full)
    if op == "broadcast":
        return lambda: dist.broadcast(full, src=0)
    raise ValueError(f"unknown op {op!r}: choose from {', '.join(OPS)}")


def time_op(fn, device: torch.device, repeats: int, warmup: int, iters: int = 1) -> list[float]:
    """Seconds per call of ``fn`` on this rank: each repeat starts together (a barrier), then
    makes ``iters`` calls back to back (as nccl-tests does) and divides."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / iters)
    return times


def repeats_for(nbytes: int, repeats: int | None) -> int:
    """Small messages are cheap and noisy: more repeats; 64 MiB ones: a handful."""
    if repeats:
        return repeats
    return 20 if nbytes <= 2**20 else 8 if nbytes <= 16 * 2**20 else 4


def bench_rank(
    ctx: RankContext,
    ops: Sequence[str],
    sizes: Sequence[int],
    repeats: int | None = None,
    warmup: int = 3,
    ceilings: bool = True,
    iters: int = ITERS,
) -> dict:
    """Run inside every rank (``labkit.launch``): time each (op, size); rank 0 returns the table."""
    n, rows = ctx.world_size, []
    total = len(ops) * len(sizes)
    for i, (op, nbytes) in enumerate((o, s) for o in ops for s in sizes):
        times = torch.tensor(
            time_op(
                _call(op, n, nbytes, ctx.device),
                ctx.device,
                repeats_for(nbytes, repeats),
                warmup,
                iters,
            ),
            dtype=torch.float64,
        )
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a repeat lasts until its slowest rank
        ctx.report(step=i + 1, total=total, op=op, bytes=nbytes)
        moved = 4 * message_numel(n, nbytes)  # the message really sent, not the request
        rows.append(row(op, moved, n, times.tolist(), ctx.backend or "", str(ctx.device)))
    limits = {}
    if ceilings:
        dist.barrier()
        if ctx.rank == 0:  # alone: the other ranks wait in the barrier, asleep
            limits = measure_ceilings(max(sizes), ctx.device)
        dist.barrier()
    return {"rows": rows, "ceilings": limits} if ctx.rank == 0 else {}


def row(
    op: str, nbytes: int, world_size: int, times: Sequence[float], backend: str, device: str
) -> dict:
    """One table row with the nccl-tests quantities (bandwidths in GB/s, 1e9 bytes/s)."""
    q = statistics.quantiles(times, n=10) if len(times) >= 2 else [times[0]] * 9
    t = statistics.median(times)
    algbw = nbytes / t / 1e9
    return {
        "op": op,
        "bytes": nbytes,
        "world_size": world_size,
        "backend": backend,
        "device": device,
        "repeats": len(times),
        "time_s": t,
        "p10_s": q[0],
        "p90_s": q[-1],
        "mean_s": statistics.fmean(times),
        "algbw": algbw,
        "busbw": algbw * bus_factor(op, world_size),
    }


def measure_ceilings(nbytes: int, device: torch.device, repeats: int = 5) -> dict:
    """This machine's limits in GB/s: a memory copy of ``nbytes`` on ``device`` and a loopback
    TCP stream between two threads (what gloo's pairs ride on, without gloo)."""
    src = torch.ones(max(1, nbytes // 4), device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    out = {"memcpy": src.numel() * 4 / statistics.median(times[1:]) / 1e9}
    out["loopback TCP"] = loopback_tcp(min(nbytes, 64 * 2**20))
    return out


def loopback_tcp(nbytes: int, repeats: int = 5) -> float:
    """GB/s of one TCP stream over 127.0.0.1: a thread sends ``nbytes``, this one receives it."""
    payload = memoryview(bytearray(nbytes))
    sink = memoryview(bytearray(1 << 20))
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        ready = threading.Event()

        def send():
            with socket.create_connection(("127.0.0.1", port)) as c:
                for _ in range(repeats + 1):
                    ready.wait()
                    ready.clear()
                    c.sendall(payload)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        conn, _ = server.accept()
        times = []
        with conn:
            for _ in range(repeats + 1):
                got, t0 = 0, time.perf_counter()
                ready.set()
                while got < nbytes:
                    k = conn.recv_into(sink)
                    if not k:
                        raise ConnectionError("loopback sender closed early")
                    got += k
                times.append(time.perf_counter() - t0)
        sender.join(5)
    return nbytes / statistics.median(times[1:]) / 1e9


def benchmark(
    world_size: int = 2,
    ops: Sequence[str] = OPS,
    sizes: Sequence[int] | str = "1KiB-16MiB",
    *,
    repeats: int | None = None,
    warmup: int = 3,
    device: str = "auto",
    ceilings: bool = True,
    on_progress=None,
    cancel=None,
    timeout_s: float = 600,
):
    """Launch ``world_size`` ranks and measure; returns ``(table, ceilings)`` (a DataFrame, a
    dict of GB/s). The same function the CLI runs."""
    import pandas as pd

    from ..launch import launch

    if isinstance(sizes, str):
        sizes = size_range(sizes)
    bad = [op for op in ops if op not in OPS]
    if bad:
        raise ValueError(f"unknown op(s) {', '.join(bad)}: choose from {', '.join(OPS)}")
    if world_size < 2:
        raise ValueError("a collective needs at least 2 ranks: set world_size >= 2")
    results = launch(
        bench_rank,
        world_size,
        args=(list(ops), list(sizes)),
        kwargs={"repeats": repeats, "warmup": warmup, "ceilings": ceilings},
        device=device,
        timeout_s=timeout_s,
        threads=1,
        on_progress=on_progress,
        cancel=cancel,
    )
    table = pd.DataFrame(results[0]["rows"])
    return table, results[0]["ceilings"]


def fit_report(table, min_bytes: int = 64 * 1024):
    """Alpha-beta per op with its held-out error: (fits, held-out rows), both DataFrames."""
    import pandas as pd

    from ..predict.collectives import held_out_fit

    fits, held = [], []
    for (op, n), g in table.groupby(["op", "world_size"], sort=False):
        model, rows = held_out_fit(op, int(n), list(g["bytes"]), list(g[FIT_ON]), min_bytes)
        counted = [r["error"] for r in rows if r["counted"]]
        fits.append(
            {
                "op": op,
                "world_size": int(n),
                "alpha_us": model.alpha_s * 1e6,
                "beta_GBps": model.beta / 1e9,
                "heldout_median_error": statistics.median(counted) if counted else float("nan"),
                "heldout_sizes": len(counted),
            }
        )
        held += rows
    return pd.DataFrame(fits), pd.DataFrame(held)


def knob_label(cfg) -> str:
    """What sets this run apart from DDP's defaults, in a few words."""
    parts = [f"{cfg.strategy}@{cfg.world_size}"]
    if cfg.bucket_cap_mb is not None:
        parts.append(f"bucket {cfg.bucket_cap_mb:g} MB")
    if cfg.comm_hook != "none":
        parts.append(
            cfg.comm_hook + (f" r={cfg.powersgd_rank}" if cfg.comm_hook == "powersgd" else "")
        )
    if cfg.accumulate > 1:
        parts.append(
            f"accumulate {cfg.accumulate}"
            + (" (sync every)" if cfg.sync_every_microstep else " (no_sync)")
        )
    return ", ".join(parts)


def knob_rows(results, profile=None, network=None):
    """One row per run (``experiment.RunResult``): the median step (slowest rank) split into
    exposed communication and the rest, communication in flight and hidden, bytes per sample,
    the global-batch loss, and, given a profile and a network, the predicted step beside it."""
    import pandas as pd

    from ..predict.step import predict

    rows = []
    for res in results:
        t = summarize(res.records).iloc[0]
        cfg = res.cfg
        row = {
            "config": knob_label(cfg),
            "step_ms": t["step_ms"],
            "comm_ms": t["comm_ms"],
            "compute_ms": t["step_ms"] - t["comm_ms"],
            "comm_total_ms": t.get("comm_total_ms", float("nan")),
            "hidden_ms": t.get("hidden_ms", float("nan")),
            "bytes_per_sample": t.get("bytes_per_sample", 0.0),
            "loss": t["loss"],
            "cpu_share": t.get("cpu_share", float("nan")),
            "busy": bool(t.get("busy", False)),
        }
        if profile is not None and network is not None and cfg.comm_hook != "powersgd":
            p = predict(
                profile,
                network,
                cfg.strategy,
                cfg.ranks,
                cfg.global_batch,
                bucket_cap_mb=cfg.bucket_cap_mb,
                accumulate=cfg.accumulate,
                no_sync=not cfg.sync_every_microstep,
                compression=0.5 if cfg.comm_hook in ("fp16", "bf16") else 1.0,
            )
            row.update(
                predicted_step_ms=1e3 * p.step_s,
                predicted_exposed_ms=1e3 * p.exposed_s,
                predicted_hidden_ms=1e3 * p.hidden_s,
                error=(p.step_s * 1e3 - t["step_ms"]) / t["step_ms"],
            )
        rows.append(row)
    return pd.DataFrame(rows)
