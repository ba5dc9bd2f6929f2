"""How fast the scheduling simulator is: 10,000 jobs on a 1,024-GPU cluster, every policy.

Goal (issue 15): <= 10 s per policy on this machine. The trace is the Philly-like mix at 80 %
offered load (``labkit.sched.traces.rate_for_load``), curves "good" and "poor" in equal parts.
Each policy runs ``--repeats`` times, interleaved (policy by policy within a round), and the
median is reported. Last line: the slowest policy's ratio to the 10 s goal.

    .venv/bin/python benchmarks/sched_speed.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from labkit.sched import sim, traces
from labkit.sched.policies import POLICIES

GOAL_S = 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--cluster", default="128x8")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="1,000 jobs on 128 GPUs (a smoke run)")
    ap.add_argument("--json", help="write every timing here")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.cluster = 1000, "16x8"
    cluster = sim.Cluster.parse(args.cluster)
    rate = traces.rate_for_load(args.load, cluster.gpus)
    jobs = traces.generate(
        args.jobs, rate_per_hour=rate, seed=0, curves=("good", "poor"), high_priority=0.2
    )
    print(
        f"{len(jobs)} jobs, {rate:.1f} arrivals/hour ({args.load:.0%} offered load) on "
        f"{cluster} = {cluster.gpus} GPUs; goal {GOAL_S:g} s per policy"
    )
    times = {p: [] for p in POLICIES}
    rows = {}
    for _ in range(args.repeats):
        for p in POLICIES:
            t0 = time.perf_counter()
            res = sim.simulate(jobs, cluster, p, record_gantt=False)
            times[p].append(time.perf_counter() - t0)
            rows[p] = {**res.metrics(), "events": res.events}
    print(f"{'policy':<9} {'seconds':>8} {'events':>8} {'mean JCT h':>11} {'util':>6}")
    for p in POLICIES:
        m = rows[p]
        print(
            f"{p:<9} {statistics.median(times[p]):8.2f} {m['events']:8d} "
            f"{m['mean_jct_s'] / 3600:11.1f} {m['utilisation']:6.2f}"
        )
    worst = max(statistics.median(v) for v in times.values())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"jobs": len(jobs), "cluster": str(cluster), "times_s": times, "metrics": rows},
                f,
                indent=1,
            )
    print(f"slowest policy / goal ratio: {worst / GOAL_S:.2f}")


if __name__ == "__main__":
    main()
