"""How fast the scheduling simulator is: 10,000 jobs on a 1,024-GPU cluster, every policy, at
two offered loads.

The trace is the Philly-like mix (``labkit.labs.sched.traces``), curves "good" and "poor" in equal
parts, at 80 % offered load (``rate_for_load``: no job ever waits long, every policy gives
nearly the same mean JCT) and at 120 % (jobs queue: the round-based policies re-rank hundreds of
waiting jobs every round and rotate GPUs among them, the costly case). Goal: <= 3 s of CPU per
policy at either load on this machine (``time.process_time``: the simulator is one thread, and
CPU time is what another program on the machine disturbs least). Each policy runs ``--repeats``
times, interleaved (policy by policy within a round), and the median is reported. Last line:
the slowest policy's ratio to the goal.

    .venv/bin/python benchmarks/sched_speed.py [--quick] [--loads 0.8,1.2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from labkit.labs.sched import sim, traces
from labkit.labs.sched.policies import POLICIES

GOAL_S = 3.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=10_000)
    ap.add_argument("--cluster", default="128x8")
    ap.add_argument("--loads", default="0.8,1.2", help="offered loads, comma-separated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="1,000 jobs on 128 GPUs (a smoke run)")
    ap.add_argument("--json", help="write every timing here")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.cluster = 1000, "16x8"
    cluster = sim.Cluster.parse(args.cluster)
    loads = [float(x) for x in args.loads.split(",")]
    times = {(load, p): [] for load in loads for p in POLICIES}
    rows = {}
    for load in loads:
        rate = traces.rate_for_load(load, cluster.gpus)
        jobs = traces.generate(
            args.jobs, rate_per_hour=rate, seed=0, curves=("good", "poor"), high_priority=0.2
        )
        print(
            f"{len(jobs)} jobs, {rate:.1f} arrivals/hour ({load:.0%} offered load) on "
            f"{cluster} = {cluster.gpus} GPUs; goal {GOAL_S:g} s per policy"
        )
        for _ in range(args.repeats):
            for p in POLICIES:
                t0 = time.process_time()
                res = sim.simulate(jobs, cluster, p, record_gantt=False)
                times[load, p].append(time.process_time() - t0)
                rows[load, p] = {**res.metrics(), "events": res.events}
        print(f"{'policy':<9} {'CPU s':>8} {'events':>8} {'mean JCT h':>11} {'util':>6}")
        for p in POLICIES:
            m = rows[load, p]
            print(
                f"{p:<9} {statistics.median(times[load, p]):8.2f} {m['events']:8d} "
                f"{m['mean_jct_s'] / 3600:11.1f} {m['utilisation']:6.2f}"
            )
    worst_key = max(times, key=lambda k: statistics.median(times[k]))
    worst = statistics.median(times[worst_key])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "jobs": args.jobs,
                    "cluster": str(cluster),
                    "goal_s": GOAL_S,
                    "times_s": {f"{load}/{p}": v for (load, p), v in times.items()},
                    "metrics": {f"{load}/{p}": v for (load, p), v in rows.items()},
                },
                f,
                indent=1,
            )
    print(
        f"slowest policy / goal ratio: {worst / GOAL_S:.2f} "
        f"({worst_key[1]} at {worst_key[0]:.0%} load, {worst:.2f} s)"
    )


if __name__ == "__main__":
    main()
