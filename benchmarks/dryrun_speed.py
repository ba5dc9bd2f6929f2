"""How fast the dry run is: one rank of a 70B model under FSDP x TP on 1,024 ranks, and a sweep of
the layout advisor's ten best layouts that labkit's strategies run, for one model.

Goals (#38.4): the 70B rank in under a minute, the sweep in under five. Both are timed in CPU
seconds of this process (``time.process_time``: the dry run is one thread, and CPU time is
what the other programs on a shared machine disturb least) and in wall seconds beside them, with
the load average, so a busy machine reads as busy. Last lines: each goal's ratio (CPU seconds
over the goal).

    .venv/bin/python benchmarks/dryrun_speed.py [--quick] [--json PATH]

The 70B rank: ``LLAMA_70B``'s shape (80 layers, h 8192, 64 heads, s 4096, V 32000), fsdp_tp with
t = 8 over 1,024 ranks (128 FSDP groups), one sequence per group, the paper's recipe (16-bit
weights, fp32 master weights and Adam's moments). The sweep: ``LLAMA_7B`` on 1,024 A100 80GB,
global batch 1,024, the advisor's plan over ZeRO stages 0, 1 and 3, its first ten layouts that
``strategy_for_layout`` maps to a strategy, each dry-run on every rank that differs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from labkit.labs import dryrun as D
from labkit.predict import layout as advisor

GOAL_70B_S = 60.0
GOAL_SWEEP_S = 300.0
GB = 1e9


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 layers, 64 ranks, 3 layouts (smoke)")
    ap.add_argument("--json", help="write every timing here")
    args = ap.parse_args()
    big = D.LLAMA_70B if not args.quick else D.Transformer(4, 8192, 64, 4096, 32000)
    ranks = 1024 if not args.quick else 64
    top = 10 if not args.quick else 3

    # warm: torch's distributed and fake-tensor modules import on the first dry run
    D.dryrun(D.Transformer(1, 64, 4, 16, 100).config(strategy="fsdp_tp", world_size=4, tp=2,
                                                      global_batch=2), rank=0)  # fmt: skip

    cfg = big.config(strategy="fsdp_tp", world_size=ranks, tp=8, global_batch=ranks // 8)
    run, cpu, wall = timed(lambda: D.dryrun(cfg, shape=big, rank=0, recipe="paper"))
    one = run.ranks[0]
    print(f"{big} under fsdp_tp, t=8, {ranks} ranks, rank 0: {cpu:.1f} s CPU, {wall:.1f} s wall "
          f"(load {os.getloadavg()[0]:.1f}); {one.total / GB:.1f} GB"
          + (f"; FAILED: {one.error}" if one.error else ""))  # fmt: skip

    shape = D.LLAMA_7B
    plans = advisor.plan(layers=shape.layers, hidden=shape.hidden, heads=shape.heads,
                         seq=shape.seq_len, vocab=shape.vocab, gpus=1024, global_batch=1024,
                         zero_stages=(0, 1, 3))  # fmt: skip
    chosen = [p for p in plans if D.strategy_for_layout(p.tp, p.pp, p.dp, p.zero)[0]][:top]
    print(f"sweep: {shape} on 1024 A100 80GB, global batch 1024: the advisor's first {len(chosen)} "
          f"layouts labkit runs (of {len(plans)} it ranks)")  # fmt: skip
    print(f"{'tp':>3} {'pp':>3} {'dp':>5} {'zero':>4} {'b':>3} {'recompute':>9} {'strategy':>14} "
          f"{'ranks':>5} {'advisor GB':>10} {'dry GB':>7} {'CPU s':>6} {'wall s':>6}")  # fmt: skip
    rows, sweep_cpu, sweep_wall = [], 0.0, 0.0
    for p in chosen:
        lay = D.layout_config(shape, tp=p.tp, pp=p.pp, dp=p.dp, zero=p.zero,
                              microbatch=p.microbatch, recompute=p.recompute,
                              global_batch=1024)  # fmt: skip
        r, c, w = timed(lambda lay=lay: D.dryrun(lay, shape=shape, recipe="paper"))
        sweep_cpu, sweep_wall = sweep_cpu + c, sweep_wall + w
        gb = None if r.failed else r.fullest().total / GB
        rows.append({"tp": p.tp, "pp": p.pp, "dp": p.dp, "zero": p.zero, "microbatch": p.microbatch,
                     "recompute": p.recompute, "strategy": lay.strategy, "ranks_run": len(r.ranks),
                     "advisor_GB": p.mem_per_gpu_bytes / GB, "dry_run_GB": gb, "cpu_s": c,
                     "wall_s": w, "error": r.failed[0].error if r.failed else None})  # fmt: skip
        shown = f"{gb:7.1f}" if gb is not None else "  fails"
        print(f"{p.tp:>3} {p.pp:>3} {p.dp:>5} {p.zero:>4} {p.microbatch:>3} {p.recompute:>9} "
              f"{lay.strategy:>14} {len(r.ranks):>5} {p.mem_per_gpu_bytes / GB:>10.1f} {shown} "
              f"{c:>6.1f} {w:>6.1f}")  # fmt: skip
    print(f"sweep: {sweep_cpu:.1f} s CPU, {sweep_wall:.1f} s wall (load {os.getloadavg()[0]:.1f})")
    print(f"70B rank CPU / goal ({GOAL_70B_S:g} s): {cpu / GOAL_70B_S:.2f}")
    print(f"sweep CPU / goal ({GOAL_SWEEP_S:g} s): {sweep_cpu / GOAL_SWEEP_S:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rank_70b": {"cpu_s": cpu, "wall_s": wall, "bytes": one.total,
                                    "error": one.error, "ranks": ranks},
                       "sweep": rows, "sweep_cpu_s": sweep_cpu, "sweep_wall_s": sweep_wall,
                       "load": os.getloadavg()[0], "quick": args.quick}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
