"""Throughput under a 2x straggler at world size 2, ddp_naive and DDP: static shares, join,
dynamic shares.

    python benchmarks/load_balance.py [--global-batch 2048] [--rounds 2] [--quick] [--json PATH]

Rank 0 computes twice as slowly as rank 1 (``slowdown="0:2"``). Each round runs the three
policies back to back, interleaved:

* static: half of every global batch on each rank (the straggler sets the pace);
* join: rank 1 holds twice rank 0's data (``skew=1``), each rank trains through its own data
  at a fixed batch, and ``Join`` covers the steps after rank 0 ran out;
* dynamic: shares follow measured throughput every 2 steps.

For each, ``throughput_fraction``: samples trained over the run's gated time, over the sum of the
ranks' solo throughputs (``labkit.records.throughput``); the median over rounds is reported,
beside the step-time predictor's (ddp_naive, static and dynamic). Goal: dynamic >= 0.90 for
both; static about what the slowest rank allows (~0.67 for one 2x straggler in two ranks).
Under DDP the shares work the same (each rank's loss weighted by share x world size); the
straggler sleeps before backward (DDP's buckets leave during it) and the shares follow each
rank's own compute time, pooled in one all-gather when they move.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from labkit import RunConfig, experiment
from labkit.labs import comm, compute_profile
from labkit.predict import collectives
from labkit.records import summarize

GOAL = 0.90
STRATEGIES = ("ddp_naive", "ddp")
POLICIES = {
    "static": dict(rebalance="static"),
    "join": dict(rebalance="join", skew=1.0),  # ddp_naive's hand-written Joinable only
    "dynamic": dict(rebalance="dynamic", rebalance_every=2),
}
RUNS = [(s, name) for s in STRATEGIES for name in POLICIES if s == "ddp_naive" or name != "join"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--global-batch", type=int, default=2048)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="a small model, 1 round (a smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.global_batch, args.width, args.steps, args.rounds = 128, 128, 4, 1
    base = RunConfig(
        strategy="ddp_naive",
        world_size=2,
        global_batch=args.global_batch,
        width=args.width,
        steps=args.steps,
        warmup=2,
        slowdown="0:2",
        dataset_size=max(4096, 4 * args.global_batch),
    )
    got: dict[tuple, list[float]] = {run: [] for run in RUNS}
    busy: dict[tuple, list[bool]] = {run: [] for run in RUNS}
    for _ in range(args.rounds):
        for strategy, name in RUNS:
            cfg = base.replace(strategy=strategy, **POLICIES[name])
            row = summarize(experiment.run(cfg).records).iloc[0]
            got[strategy, name].append(float(row["throughput_fraction"]))
            busy[strategy, name].append(bool(row["busy"]))
    bench, _ = comm.benchmark(world_size=2, ops=["all_reduce"], sizes="4KiB-4MiB")
    network = collectives.fit_table(bench.to_dict("records"), world_size=2)
    prof = compute_profile.measure(base)
    from labkit.predict.step import predict_balance

    rows = []
    for strategy, name in RUNS:
        pred = (
            predict_balance(prof, network, 2, base.global_batch, [2.0, 1.0], policy=name)[
                "throughput_fraction"
            ]
            if name != "join" and strategy == "ddp_naive"
            else float("nan")
        )
        runs = got[strategy, name]
        rows.append(
            {
                "strategy": strategy,
                "policy": name,
                "fraction": statistics.median(runs),
                "rounds": runs,
                "predicted": pred,
                "busy": any(busy[strategy, name]),
            }
        )
        print(
            f"{strategy:>9} {name:>8}  {rows[-1]['fraction']:.2f} of ideal (rounds: "
            f"{', '.join(f'{v:.2f}' for v in runs)})  predicted "
            f"{'-' if pred != pred else f'{pred:.2f}'}{'  BUSY' if rows[-1]['busy'] else ''}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": base.to_dict(), "rows": rows, "goal_dynamic": GOAL}, f, indent=1)
    dyn = {r["strategy"]: r["fraction"] for r in rows if r["policy"] == "dynamic"}
    print(
        "dynamic throughput fraction under a 2x straggler: "
        + ", ".join(f"{s} {v:.2f}" for s, v in dyn.items())
        + f" (goal >= {GOAL:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
