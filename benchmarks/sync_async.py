"""Steps, wall time and bytes to a target loss, per mode, with and without a 3x straggler.

    python benchmarks/sync_async.py [--width 256] [--global-batch 512] [--steps 40]
                                    [--rounds 3] [--straggler 3] [--quick] [--json PATH]

One task (a 2-layer MLP on the toy classification set, global batch 512, seed 0) in the five
modes of notebook 09: ddp, local_sgd (H=4), diloco (H=4), async_ps (a server + 2 workers) and
hogwild, each once without and once with rank 1 computing ``--straggler`` times slower. Each
round runs all ten configurations back to back (interleaved, so a busy spell hits every mode).
The target is 60 % of the way from the first smoothed loss to where DDP without a straggler
ended (``labkit.labs.sync_async.default_target``, on the first round). Per mode and condition the
median over rounds of: updates, samples, seconds and bytes to the target, samples per second,
and whether any rank was starved of CPU (busy). The last line: the asynchronous parameter
server's seconds to target over DDP's, under the straggler (below 1: async wins on wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import pandas as pd

from labkit import RunConfig, experiment
from labkit.labs import sync_async
from labkit.registry import SYNC_ASYNC

COLUMNS = (
    "updates_to_target",
    "samples_to_target",
    "seconds_to_target",
    "bytes_to_target",
    "samples_per_s",
    "final_loss",
)


def median(values):
    values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else math.nan


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--straggler", type=float, default=3.0)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="a small model, 1 round (a smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.width, args.steps, args.rounds, args.global_batch = 64, 12, 1, 128
    base = RunConfig(
        world_size=2,
        steps=args.steps,
        warmup=2,
        global_batch=args.global_batch,
        width=args.width,
        depth=2,
        period=4,
        timeout_s=300,
    )
    tables, target = [], None
    for _ in range(args.rounds):
        configs = sync_async.sweep(base) + sync_async.sweep(base, straggler=args.straggler)
        records = experiment.compare(configs)
        target = sync_async.default_target(records) if target is None else target
        tables.append(sync_async.to_target(records, target))
    every = pd.concat(tables, ignore_index=True)
    every["straggler"] = every["run"].str.contains("slow")
    rows = []
    print(
        f"target loss {target:.3f}; medians over {args.rounds} round(s); "
        f"straggler: rank 1 {args.straggler:g}x slower"
    )
    print(
        f"{'mode':>10} {'straggler':>9} {'updates':>8} {'samples':>8} {'seconds':>8} "
        f"{'MB':>7} {'samples/s':>9}"
    )
    for straggler in (False, True):
        for mode in SYNC_ASYNC:
            g = every[(every["strategy"] == mode) & (every["straggler"] == straggler)]
            row = {
                "mode": mode,
                "straggler": args.straggler if straggler else 1.0,
                **{c: median(g[c].tolist()) for c in COLUMNS},
                "rounds": g["seconds_to_target"].tolist(),
                "busy": bool(g["busy"].any()),
            }
            rows.append(row)
            print(
                f"{mode:>10} {row['straggler']:>8g}x {row['updates_to_target']:>8.0f} "
                f"{row['samples_to_target']:>8.0f} {row['seconds_to_target']:>8.3f} "
                f"{row['bytes_to_target'] / 1e6:>7.1f} {row['samples_per_s']:>9.0f}"
                f"{'  BUSY' if row['busy'] else ''}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": base.to_dict(), "target": target, "rows": rows}, f, indent=1)
    slow = {r["mode"]: r for r in rows if r["straggler"] > 1}
    missing = [m for m in ("async_ps", "ddp") if math.isnan(slow[m]["seconds_to_target"])]
    headline = f"async_ps / ddp seconds to target under a {args.straggler:g}x straggler ratio"
    if missing:  # a ratio of a run that never got there is not a number to report
        print(
            f"{headline}: not measured: {' and '.join(missing)} did not reach the target loss "
            f"{target:.3f} in any round (run more steps)"
        )
        return 0
    ratio = slow["async_ps"]["seconds_to_target"] / slow["ddp"]["seconds_to_target"]
    print(f"{headline}: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
