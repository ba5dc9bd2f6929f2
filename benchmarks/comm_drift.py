"""Does this machine's all-reduce hold still? One bucket-sized all-reduce, timed in blocks.

    python benchmarks/comm_drift.py [--bytes 833000] [--blocks 8] [--calls 20] [--launches 3]
                                    [--quick] [--json PATH]

Each rank computes for 3 ms (a busy loop, like a small model's forward and backward), then
all-reduces one tensor of ``--bytes`` (default: the default MLP's gradients, DDP's single
bucket), ``--calls`` times per block. Per block, the median call on rank 0 is printed; blocks
follow each other within one launch (~0.1-0.2 s apart), launches follow each other.

A step-time prediction made from measurements taken earlier (``benchmarks/predictions.py``)
can only be as close as the quantity it predicts holds still: if the median of 20 calls moves
by several times between consecutive blocks, so does a 20-step run's exposed communication.
Last line: ``all_reduce <bytes> B, median of <calls> calls per block: min X ms, max Y ms (Z x)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import labkit


def rank(ctx, nbytes: int, blocks: int, calls: int, compute_s: float) -> list[float]:
    import torch
    import torch.distributed as dist

    x = torch.ones(max(1, nbytes // 4))
    for _ in range(3):  # warm-up: connections, buffers
        dist.all_reduce(x)
    medians = []
    for _ in range(blocks):
        times = []
        for _ in range(calls):
            until = time.perf_counter() + compute_s
            while time.perf_counter() < until:
                pass
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        medians.append(statistics.median(times))
    return medians


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bytes", type=int, default=833_000, help="bytes per all-reduce")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--calls", type=int, default=20, help="all-reduces per block")
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--compute-ms", type=float, default=3.0, help="busy loop before each call")
    p.add_argument("--quick", action="store_true", help="1 launch of 2 blocks of 5 calls")
    p.add_argument("--json", help="write every block's median here")
    args = p.parse_args(argv)
    if args.quick:
        args.launches, args.blocks, args.calls = 1, 2, 5
    if min(args.bytes, args.blocks, args.calls, args.launches) < 1:
        p.error("--bytes, --blocks, --calls and --launches must be at least 1")
    every, per_launch = [], []
    for i in range(args.launches):
        medians = labkit.launch(
            rank, 2, args=(args.bytes, args.blocks, args.calls, args.compute_ms / 1e3), device="cpu"
        )[0]
        every += medians
        per_launch.append(medians)
        print(
            f"launch {i}: block medians (ms) " + ", ".join(f"{1e3 * m:.2f}" for m in medians),
            flush=True,
        )
    lo, hi = min(every), max(every)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "bytes": args.bytes,
                    "calls": args.calls,
                    "compute_ms": args.compute_ms,
                    "block_medians_s": per_launch,
                },
                f,
                indent=1,
            )
    print(
        f"all_reduce {args.bytes} B, median of {args.calls} calls per block: "
        f"min {1e3 * lo:.2f} ms, max {1e3 * hi:.2f} ms ({hi / lo:.1f} x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
