"""labkit's collective benchmark vs a bare ``dist.all_reduce`` timing loop, same sizes, same ranks.

    python benchmarks/comm_overhead.py [--sizes 4KiB-16MiB] [--rounds 6] [--quick] [--json PATH]

Inside one launch, each round times every size twice, alternating: once with labkit's
``comm.time_op`` (a barrier, then back-to-back calls, the slowest rank's time per call), once
with the loop anyone would write (``t0 = perf_counter(); all_reduce; ...`` back to back, no
barrier, rank 0's clock). Per size, the ratio labkit/bare of the medians over rounds is
reported; the last line is the median of those ratios (goal: within 10 %, i.e. 0.90-1.10).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

import labkit
from labkit.labs import comm

GOAL = 0.10


def rank(ctx, sizes: list[int], rounds: int, repeats: int, iters: int) -> dict | None:
    out = {s: {"labkit": [], "bare": []} for s in sizes}
    for _ in range(rounds):
        for nbytes in sizes:
            fn = comm._call("all_reduce", ctx.world_size, nbytes, ctx.device)
            times = torch.tensor(
                comm.time_op(fn, ctx.device, repeats, 2, iters), dtype=torch.float64
            )
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            out[nbytes]["labkit"].append(statistics.median(times.tolist()))
            t = torch.ones(max(1, nbytes // 4), device=ctx.device)  # the bare loop
            for _ in range(2):
                dist.all_reduce(t)
            bare = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                for _ in range(iters):
                    dist.all_reduce(t)
                bare.append((time.perf_counter() - t0) / iters)
            out[nbytes]["bare"].append(statistics.median(bare))
    return out if ctx.rank == 0 else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", default="4KiB-16MiB")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--iters", type=int, default=comm.ITERS)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="2 sizes, 1 round (a smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.rounds, args.repeats = "16KiB,1MiB", 1, 3
    sizes = comm.size_range(args.sizes)
    res = labkit.launch(rank, 2, args=(sizes, args.rounds, args.repeats, args.iters), threads=1)[0]
    rows = []
    for nbytes in sizes:
        lab, bare = (statistics.median(res[nbytes][k]) for k in ("labkit", "bare"))
        rows.append(
            {"bytes": nbytes, "labkit_ms": 1e3 * lab, "bare_ms": 1e3 * bare, "ratio": lab / bare}
        )
        print(
            f"{comm.human_bytes(nbytes):>9}  labkit {1e3 * lab:8.3f} ms  bare {1e3 * bare:8.3f} ms"
            f"  ratio {lab / bare:5.2f}"
        )
    ratio = statistics.median(r["ratio"] for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"rows": rows, "median_ratio": ratio, "goal": [1 - GOAL, 1 + GOAL]}, f, indent=1
            )
    print(
        f"labkit/bare all_reduce time ratio (median over sizes): {ratio:.2f} "
        f"(goal {1 - GOAL:.2f}-{1 + GOAL:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
