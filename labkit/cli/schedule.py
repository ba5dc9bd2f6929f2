"""``schedule``: cluster-scheduling policies simulated on a job trace, or replayed for real."""

from __future__ import annotations

import json

from .common import csv, writable


def add_parser(sub) -> None:
    p = sub.add_parser("schedule", help="simulate cluster-scheduling policies on a job trace")
    p.add_argument("--trace", help="a CSV trace (job_id,arrival_s,gpus,priority,duration_s,curve)")
    p.add_argument("--generate", type=int, help="generate N jobs (Philly-like mix) instead")
    p.add_argument("--cluster", default="4x8", help="NODESxGPUS, e.g. 4x8")
    p.add_argument(
        "--policy",
        default="fifo,srtf,las,elastic",
        help="comma-separated: fifo,srtf,priority,las,maxmin,ftf,elastic",
    )
    p.add_argument("--placement", default="consolidated", help="consolidated or spread")
    p.add_argument(
        "--load",
        type=float,
        default=1.0,
        help="--generate: offered load (GPU-hours asked / GPU-hours the cluster has)",
    )
    p.add_argument(
        "--high-priority", type=float, default=0.2, help="--generate: share of high-priority jobs"
    )
    p.add_argument("--curves", default="good,poor", help="--generate: curve presets to draw from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--round",
        type=float,
        default=None,
        help="seconds per round of maxmin, ftf and elastic (default 360)",
    )
    p.add_argument(
        "--replay",
        action="store_true",
        help="run --generate N (6-12) short jobs for real on this machine's cores and "
        "compare with the simulator fed with measured curves",
    )
    p.add_argument("--json", help="write the metrics here")
    p.set_defaults(func=cmd_schedule)


def cmd_schedule(args) -> int:
    """Simulate policies on a trace (a CSV file or a generated one); --replay runs it for real."""
    from ..labs.sched import replay, sim, traces
    from ..labs.sched.jobs import resolve_curve
    from ..labs.sched.policies import POLICIES, make_policy

    if bool(args.trace) == bool(args.generate):
        raise ValueError("give either --trace FILE or --generate N")
    policies = csv(args.policy, flag="--policy")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"--policy: unknown {', '.join(bad)}: choose from {','.join(POLICIES)}")
    try:
        cluster = sim.Cluster.parse(args.cluster, args.placement)
    except ValueError as exc:
        raise ValueError(f"--cluster: {exc}") from None
    for flag, value in (("--round", args.round), ("--load", args.load)):
        if value is not None and not value > 0:
            raise ValueError(f"{flag} must be positive, got {value}")
    if not 0 <= args.high_priority <= 1:
        raise ValueError(f"--high-priority is a share of jobs in [0, 1], got {args.high_priority}")
    writable("--json", args.json)
    if args.replay:
        if cluster.gpus != replay.CORES:
            raise ValueError(
                f"--replay runs on this machine's cores: use --cluster 1x{replay.CORES} "
                f"(got {cluster})"
            )
        if args.trace:
            raise ValueError(
                "--replay builds its own small trace of labkit runs: use --generate N "
                f"(N from {replay.MIN_JOBS} to {replay.MAX_JOBS}) instead of --trace"
            )
        if not replay.MIN_JOBS <= args.generate <= replay.MAX_JOBS:
            raise ValueError(
                f"--generate: the replay runs {replay.MIN_JOBS} to {replay.MAX_JOBS} "
                f"jobs, got {args.generate}"
            )
        for p in policies:
            make_policy(p)
        return _schedule_replay(args, policies)
    if args.trace:
        try:
            jobs = traces.load(args.trace)
        except ValueError as exc:
            raise ValueError(f"--trace: {exc}") from None
    else:
        if args.generate < 1:
            raise ValueError(f"--generate must be at least 1 job, got {args.generate}")
        curves = csv(args.curves, flag="--curves")
        try:
            [resolve_curve(c) for c in curves]
        except ValueError as exc:
            raise ValueError(f"--curves: {exc}") from None
        rate = traces.rate_for_load(args.load, cluster.gpus)
        jobs = traces.generate(
            args.generate,
            rate_per_hour=rate,
            seed=args.seed,
            high_priority=args.high_priority,
            curves=curves,
        )
    try:
        traces.check_fits(jobs, cluster.gpus)
    except ValueError as exc:
        raise ValueError(f"--cluster: {exc}") from None
    options = {"round_s": args.round}
    print(
        f"{len(jobs)} jobs on {cluster} ({cluster.gpus} GPUs, {cluster.placement} placement)",
        flush=True,
    )
    table, runs = sim.compare(jobs, cluster, policies, record_gantt=False, **options)
    print(_schedule_table(table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cluster": str(cluster),
                    "jobs": len(jobs),
                    "metrics": json.loads(table.to_json(orient="records")),
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    return 0


def _schedule_table(table) -> str:
    shown = table.assign(
        **{
            "mean JCT h": table["mean_jct_s"] / 3600,
            "p95 JCT h": table["p95_jct_s"] / 3600,
            "p99 JCT h": table["p99_jct_s"] / 3600,
            "queue h": table["mean_queue_s"] / 3600,
            "makespan h": table["makespan_s"] / 3600,
            "util": table["utilisation"],
            "rho mean": table["mean_rho"],
            "rho max": table["max_rho"],
            "GPU-h": table["gpu_hours"],
            "restarts/job": table["restarts_per_job"],
            "high-prio JCT h": table["mean_jct_high_s"] / 3600,
        }
    )
    cols = [
        "policy",
        "mean JCT h",
        "p95 JCT h",
        "p99 JCT h",
        "queue h",
        "makespan h",
        "util",
        "rho mean",
        "rho max",
        "GPU-h",
        "restarts/job",
        "high-prio JCT h",
    ]
    if shown["high-prio JCT h"].isna().all():
        cols.remove("high-prio JCT h")
    return (
        shown[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}")
        + "\nrho: JCT / time alone at the requested size (finish-time fairness)"
    )


def _schedule_replay(args, policies) -> int:
    from ..labs.sched import replay

    print(
        f"replay: {args.generate} short labkit runs on {replay.CORES} CPU cores, policies "
        f"{', '.join(policies)}; measuring this machine's curves and restart cost first",
        flush=True,
    )
    report = replay.check(args.generate, policies, seed=args.seed, log=print, recalibrate=True)
    print(report.table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(report.summary())
    print(
        "(measured again before each policy: other programs' load drifts; the summary's "
        "measurements are the last policy's)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.as_dict(), f, indent=1)
        print(f"wrote {args.json}")
    return 0
