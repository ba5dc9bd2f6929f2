"""labkit's command line: ``python -m labkit {env,compare,check,comm,demo,schedule}``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from .config import RunConfig

DP_STRATEGIES = "single,dp,ddp,ddp_naive"


def add_config_args(p: argparse.ArgumentParser) -> None:
    """The RunConfig knobs every sub-command (and the torchrun worker) accepts."""
    d = RunConfig()
    g = p.add_argument_group("run config")
    g.add_argument("--steps", type=int, default=d.steps, help="measured steps per run")
    g.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured steps first")
    g.add_argument(
        "--global-batch", type=int, default=d.global_batch, help="samples per step over all ranks"
    )
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--model", default=d.model, help="mlp, cnn or unbalanced_mlp")
    g.add_argument("--width", type=int, default=d.width)
    g.add_argument("--depth", type=int, default=d.depth)
    g.add_argument("--dataset-size", type=int, default=d.dataset_size)
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    g.add_argument("--backend", default=None, help="gloo, nccl (default: from the device)")
    g.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    g.add_argument("--stages", type=int, default=d.stages, help="pipeline stages P")
    g.add_argument("--microbatches", type=int, default=d.microbatches, help="micro-batches M")
    g.add_argument("--pipeline-impl", default=d.pipeline_impl, help="scratch or torch")
    g.add_argument(
        "--balance",
        nargs="?",
        const="stages",
        default=None,
        help="alone: partition pipeline stages by measured cost; static, dynamic or "
        "join: load balancing of ddp_naive's ranks (notebook 04)",
    )
    g.add_argument(
        "--slowdown",
        default="",
        help="RANK:FACTOR[@STEP],...: e.g. 1:2, rank 1 "
        "computes 2x slower (from measured step STEP); ddp_naive",
    )
    g.add_argument(
        "--skew",
        type=float,
        default=d.skew,
        help="data skew: the last rank holds (1 + SKEW)x the first rank's samples",
    )
    g.add_argument(
        "--rebalance-every",
        type=int,
        default=d.rebalance_every,
        help="--balance dynamic: measured steps between share updates",
    )
    g.add_argument("--timeout", type=float, default=d.timeout_s, help="seconds per launch")
    g.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP bucket size in MB (default: DDP's, 25 MB with a 1 MiB first bucket)",
    )
    g.add_argument(
        "--accumulate",
        type=int,
        default=d.accumulate,
        help="micro-batches per optimizer step (gradient accumulation)",
    )
    g.add_argument(
        "--sync-every-microstep",
        action="store_true",
        help="with --accumulate: all-reduce after every micro-batch (not no_sync)",
    )
    g.add_argument("--comm-hook", default=d.comm_hook, help="ddp: none, fp16, bf16 or powersgd")
    g.add_argument("--powersgd-rank", type=int, default=d.powersgd_rank)
    # elastic (notebook 07)
    g.add_argument(
        "--checkpoint-dir",
        default=None,
        help="resume from the checkpoint in this folder, and write one there",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="optimizer steps between checkpoints (0: after the last step only)",
    )
    g.add_argument(
        "--pace",
        type=float,
        default=d.pace_s,
        help="seconds each step lasts at least (sleeps the rest; demos of elasticity)",
    )
    # memory and mixed precision (notebook 05)
    g.add_argument("--precision", default=d.precision, help="fp32, bf16 or fp16 (autocast)")
    g.add_argument(
        "--checkpoint",
        action="store_true",
        help="activation checkpointing per block (recompute in backward)",
    )
    # the sync/async lab (notebook 06): local_sgd, diloco, async_ps, hogwild
    g.add_argument(
        "--period",
        type=int,
        default=d.period,
        help="local_sgd / diloco: local steps H between averaging rounds",
    )
    g.add_argument("--inner-lr", type=float, default=d.inner_lr, help="diloco: inner AdamW lr")
    g.add_argument(
        "--outer-lr",
        type=float,
        default=d.outer_lr,
        help="diloco: outer Nesterov SGD lr on the averaged parameter delta",
    )
    g.add_argument(
        "--outer-momentum",
        type=float,
        default=d.outer_momentum,
        help="diloco: outer Nesterov momentum",
    )
    g.add_argument(
        "--staleness-lr",
        action="store_true",
        help="async_ps: an update s versions stale uses lr / max(1, s)",
    )


# RunConfig field -> the flag that sets it, so a config error can name what to type instead
FLAGS = {
    "steps": "--steps",
    "warmup": "--warmup",
    "global_batch": "--global-batch",
    "lr": "--lr",
    "seed": "--seed",
    "model": "--model",
    "width": "--width",
    "depth": "--depth",
    "dataset_size": "--dataset-size",
    "device": "--device",
    "backend": "--backend",
    "threads": "--threads",
    "stages": "--stages",
    "microbatches": "--microbatches",
    "pipeline_impl": "--pipeline-impl",
    "timeout_s": "--timeout",
    "world_size": "--world-size",
    "bucket_cap_mb": "--bucket-cap-mb",
    "accumulate": "--accumulate",
    "comm_hook": "--comm-hook",
    "powersgd_rank": "--powersgd-rank",
    "slowdown": "--slowdown",
    "skew": "--skew",
    "rebalance": "--balance",
    "rebalance_every": "--rebalance-every",
    "checkpoint_dir": "--checkpoint-dir",
    "checkpoint_every": "--checkpoint-every",
    "pace_s": "--pace",
    "precision": "--precision",
    "checkpoint": "--checkpoint",
    "period": "--period",
    "inner_lr": "--inner-lr",
    "outer_lr": "--outer-lr",
    "outer_momentum": "--outer-momentum",
    "staleness_lr": "--staleness-lr",
}


def config_from_args(args: argparse.Namespace, **override) -> RunConfig:
    fields = dict(
        steps=args.steps,
        warmup=args.warmup,
        global_batch=args.global_batch,
        lr=args.lr,
        seed=args.seed,
        model=args.model,
        width=args.width,
        depth=args.depth,
        dataset_size=args.dataset_size,
        device=args.device,
        backend=args.backend,
        threads=args.threads,
        stages=args.stages,
        microbatches=args.microbatches,
        pipeline_impl=args.pipeline_impl,
        balance=args.balance == "stages",
        rebalance=args.balance if args.balance not in (None, "stages") else "static",
        slowdown=args.slowdown,
        skew=args.skew,
        rebalance_every=args.rebalance_every,
        timeout_s=args.timeout,
        bucket_cap_mb=args.bucket_cap_mb,
        accumulate=args.accumulate,
        sync_every_microstep=args.sync_every_microstep,
        comm_hook=args.comm_hook,
        powersgd_rank=args.powersgd_rank,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        pace_s=args.pace,
        precision=args.precision,
        checkpoint=args.checkpoint,
        period=args.period,
        inner_lr=args.inner_lr,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        staleness_lr=args.staleness_lr,
    )
    fields.update(override)
    try:
        return RunConfig(**fields)
    except ValueError as exc:
        flag = next(
            (f for name, f in FLAGS.items() if str(exc).startswith(name)),
            "--slowdown" if str(exc).startswith("slowdown") else None,
        )
        raise ValueError(f"{flag}: {exc}" if flag else str(exc)) from None


def _one_run_only(args) -> None:
    """compare, check and demo run several configurations: one checkpoint folder would make each
    run resume from the one before it."""
    if getattr(args, "checkpoint_dir", None):
        raise ValueError(
            "--checkpoint-dir: this command runs several configurations, which would "
            "resume from each other's checkpoints: checkpoint one run with torchrun "
            "-m labkit.worker --checkpoint-dir DIR (or labkit.run in Python)"
        )


def _csv(text: str, cast=str, flag: str = "") -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(
            f"{flag} is empty: give at least one value, e.g. {flag} "
            f"{'1,2' if cast is int else 'single,ddp'}"
        )
    try:
        return [cast(t) for t in items]
    except ValueError:
        bad = next(t for t in items if not t.lstrip("-").isdigit())
        raise ValueError(f"{flag} {text!r}: {bad!r} is not a whole number") from None


def _writable(flag: str, path: str | None) -> None:
    """Refuse an output path before anything runs (not after the run, losing it)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(
            f"{flag} {path}: the folder {folder} does not exist: create it or choose another path"
        )
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def cmd_env(args) -> int:
    from .env import probe

    report = probe()
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0


def cmd_compare(args) -> int:
    _one_run_only(args)
    from . import experiment

    _writable("--json", args.json)
    _writable("--html", args.html)
    sizes = _csv(args.world_sizes, int, flag="--world-sizes")
    balancing = bool(args.slowdown) or args.skew > 0 or args.balance not in (None, "stages")
    # load-balancing knobs belong to ddp_naive; the base must be a config they are valid on
    base = config_from_args(
        args,
        **(
            dict(strategy="ddp_naive", world_size=max(sizes))
            if balancing
            else dict(strategy="single", world_size=1)
        ),
    )
    configs = experiment.grid(base, _csv(args.strategies, flag="--strategies"), sizes)
    print(
        f"running {len(configs)} configurations: "
        + ", ".join(experiment.config_label(c) for c in configs),
        flush=True,
    )
    finished = []
    try:
        with _Progress() as progress:
            experiment.compare(
                configs, on_progress=progress.update, on_result=lambda res: _finished(res, finished)
            )
    except KeyboardInterrupt:  # the launcher has stopped every rank; keep what finished
        print(
            f"labkit: interrupted: every rank stopped; {len(finished)} of {len(configs)} "
            f"configurations had finished" + (", written below" if finished else ""),
            file=sys.stderr,
            flush=True,
        )
        if finished:
            _report(args, base, experiment.combine(finished))
        return 130
    return _report(args, base, experiment.combine(finished))


def _finished(res, finished: list) -> None:
    from .experiment import config_label

    finished.append(res)
    print(f"finished {config_label(res.cfg)} ({len(res.records)} records)", flush=True)


def _report(args, base: RunConfig, records) -> int:
    """Print the table and its reading; write the records and the HTML report if asked."""
    from . import experiment, plots

    table = experiment.summarize(records)
    _print_table(table)
    for key, notes in records.attrs.get("notes", {}).items():
        for note in notes:
            print(f"note ({key}): {note}")
    from .report import explain

    print("\n== what the table says\n" + explain(table))
    if records["strategy"].isin(("local_sgd", "diloco", "async_ps", "hogwild")).any():
        from .sync_async import default_target, people_table, to_target

        target = default_target(records)
        print(
            f"\n== to a loss of {target:.3f} (smoothed over 4 global batches; labkit.sync_async)"
            f"\nasync_ps and hogwild: read this table, not the one above, which pairs ranks "
            f"by step number (asynchronous ranks share none)"
        )
        print(people_table(to_target(records, target)).to_string(index=False))
    if args.json:
        experiment.save_records(
            records,
            args.json,
            config=base.to_dict(),
            summary=json.loads(table.to_json(orient="records")),
        )
        print(f"records: {args.json} ({len(records)} rows)")
    if args.html:
        figs = [
            plots.throughput(table),
            plots.breakdown(records),
            plots.efficiency(table),
            plots.loss_curves(records),
        ]
        _write_html(args.html, "labkit compare", table, figs)
        print(f"report: {args.html}")
    return 0


def cmd_check(args) -> int:
    _one_run_only(args)
    from . import experiment

    base = config_from_args(args, strategy="single", world_size=1)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
    if not args.tol > 0:
        raise ValueError(f"--tol must be positive, got {args.tol}")
    result = experiment.check(
        base,
        _csv(args.strategies, flag="--strategies"),
        args.world_size,
        steps=args.steps,
        tol=args.tol,
    )
    print(result.drop(columns=["why"]).to_string(index=False))
    for _, row in result[result["why"] != ""].iterrows():
        print(f"note ({row['strategy']}): {row['why']}")
    bad = result[~result["ok"]]
    if len(bad):
        print(f"FAILED: {', '.join(bad['strategy'])} differ from single by more than {args.tol:g}")
        return 1
    print(f"all strategies match single within {args.tol:g} after {args.steps} steps")
    return 0


def cmd_demo(args) -> int:
    """The main job: what this machine has, then the data-parallel comparison and the check."""
    from .env import probe

    report = probe()
    print("== environment\n" + str(report) + "\n", flush=True)
    sizes = sorted({1, *[w for w in (2, 4, 8) if w <= max(2, report.max_world_size)]})
    os.makedirs(args.out, exist_ok=True)  # (--out is a folder labkit creates)
    compare_args = argparse.Namespace(
        **{
            **vars(args),
            "strategies": args.strategies,
            "world_sizes": ",".join(map(str, sizes)),
            "json": os.path.join(args.out, "demo.json"),
            "html": os.path.join(args.out, "demo.html"),
        }
    )
    print("== compare", flush=True)
    cmd_compare(compare_args)
    print("\n== equivalence check (5 steps, deterministic)", flush=True)
    check_args = argparse.Namespace(**{**vars(args), "steps": 5, "world_size": 2, "tol": 1e-5})
    return cmd_check(check_args)


class _Progress:
    """One tqdm bar per run (rank 0's steps); silent when stderr is not a terminal."""

    def __enter__(self):
        self.bar, self.key = None, None
        return self

    def update(self, cfg, rank, metrics) -> None:
        from tqdm.auto import tqdm

        from .experiment import LiveLoss

        key = cfg
        if key != self.key:
            self._close()
            self.key, self.loss = key, LiveLoss(cfg.ranks)
            self.bar = tqdm(
                total=metrics["total"],
                desc=f"{cfg.strategy}@{cfg.world_size}",
                leave=False,
                disable=None,
            )
        latest = self.loss.update(rank, metrics)  # the global batch's loss, once all ranks
        if rank == cfg.ranks - 1:  # reported a step (pipelines: last stage)
            self.bar.update(metrics["step"] - self.bar.n)
        if latest is not None:
            self.bar.set_postfix(loss=f"{latest[1]:.3f}", refresh=False)

    def _close(self):
        if self.bar is not None:
            self.bar.close()

    def __exit__(self, *exc):
        self._close()


def _print_table(table) -> None:
    from .report import format_table

    print(format_table(table))
    if "oversubscribed" in table and table["oversubscribed"].any():
        print(
            "! rows with more CPU ranks than cores are time-shared: their speed-up is not "
            "parallelism"
        )


def _write_html(path: str, title: str, table, figs) -> None:
    parts = [f"<h1>{title}</h1>", table.to_html(index=False, float_format=lambda v: f"{v:.3g}")]
    for i, fig in enumerate(figs):  # plotly.js inline once: the report works offline
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    with open(path, "w") as f:
        f.write(
            "<html><head><meta charset='utf-8'></head><body>" + "".join(parts) + "</body></html>"
        )


def cmd_comm(args) -> int:
    from . import comm
    from .plots import communication as charts
    from .predict.collectives import OPS, fit_table

    _writable("--json", args.json)
    _writable("--html", args.html)
    ops = _csv(args.ops, flag="--ops")
    bad = [op for op in ops if op not in OPS]
    if bad:
        raise ValueError(f"--ops: unknown {', '.join(bad)}: choose from {','.join(OPS)}")
    sizes = comm.size_range(args.sizes)
    if args.world_size < 2:
        raise ValueError("--world-size: a collective needs at least 2 ranks")
    print(
        f"timing {', '.join(ops)} on {args.world_size} ranks at {len(sizes)} sizes "
        f"({comm.human_bytes(sizes[0])} to {comm.human_bytes(sizes[-1])})",
        flush=True,
    )
    table, ceilings = comm.benchmark(
        args.world_size,
        ops,
        sizes,
        repeats=args.repeats,
        device=args.device,
        timeout_s=args.timeout,
    )
    fits, held = comm.fit_report(table)
    shown = table.assign(
        size=table["bytes"].map(comm.human_bytes),
        time_ms=1e3 * table["time_s"],
        p10_ms=1e3 * table["p10_s"],
        p90_ms=1e3 * table["p90_s"],
    )
    print(
        shown[["op", "size", "time_ms", "p10_ms", "p90_ms", "algbw", "busbw"]]
        .round(3)
        .to_string(index=False)
    )
    print("bandwidths in GB/s (1e9 B/s); busbw as nccl-tests defines it")
    print(
        "ceilings measured in this run: "
        + ", ".join(f"{k} {v:.2f} GB/s" for k, v in ceilings.items())
    )
    print(fits.round(3).to_string(index=False))
    print("alpha-beta per op (ring formulas), error on held-out sizes >= 64 KiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": table.to_dict("records"),
                    "ceilings": ceilings,
                    "fits": fits.to_dict("records"),
                    "held_out": held.to_dict("records"),
                },
                f,
                indent=1,
            )
        print(f"wrote {args.json}")
    if args.html:
        fitted = fit_table(table.to_dict("records"), args.world_size).ops
        _write_html(args.html, "labkit comm", table, [charts.bandwidth(table, ceilings, fitted)])
        print(f"wrote {args.html}")
    return 0


# ---- cluster scheduling (labkit.sched, notebook 08) ----------------------------------------------


def cmd_schedule(args) -> int:
    """Simulate policies on a trace (a CSV file or a generated one); --replay runs it for real."""
    from .sched import replay, sim, traces
    from .sched.jobs import resolve_curve
    from .sched.policies import POLICIES, make_policy

    if bool(args.trace) == bool(args.generate):
        raise ValueError("give either --trace FILE or --generate N")
    policies = _csv(args.policy, flag="--policy")
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
    _writable("--json", args.json)
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
        curves = _csv(args.curves, flag="--curves")
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
    from .sched import replay

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


def add_schedule_parser(sub) -> None:
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


def cmd_memory(args) -> int:
    """Bytes per rank by category for each strategy, counted, and the calculator's error."""
    from .memory import measure, memory_table

    base = config_from_args(args, strategy="ddp", world_size=2)
    sizes = _csv(args.world_sizes, int, "--world-sizes")
    records, errors = measure(
        base, _csv(args.strategies, flag="--strategies"), sizes, args.optimizer
    )
    with _pd_options():
        print(memory_table(records).round(4).to_string(index=False))
        print(
            "MiB per rank: counted from live tensor storage; high_water: the process's peak "
            "(RSS on CPU: interpreter, libraries and caches too)\n"
        )
        worst = errors.assign(abs_error=errors["error"].abs()).groupby(
            ["run", "category"], sort=False
        )
        print(worst["abs_error"].max().unstack().round(4).to_string())
        print(
            "calculator error per category (largest over ranks, |calculated - counted| / counted)"
        )
    return 0


def _pd_options():
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_columns", 30)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m labkit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("env", help="what this machine has and what labkit will use")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_env)

    p = sub.add_parser("compare", help="run strategies over world sizes and compare them")
    p.add_argument("--strategies", default="single,dp,ddp")
    p.add_argument("--world-sizes", default="1,2")
    p.add_argument("--json", help="write per-rank records here")
    p.add_argument("--html", help="write a plotly report here")
    add_config_args(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("check", help="do strategies reach the same parameters as single?")
    p.add_argument("--strategies", default=DP_STRATEGIES)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--tol", type=float, default=1e-5)
    add_config_args(p)
    p.set_defaults(func=cmd_check, steps=5)

    p = sub.add_parser("comm", help="collective bandwidth (algbw/busbw) and the alpha-beta fit")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast")
    p.add_argument("--sizes", default="1KiB-64MiB", help="a range (x4 steps) or a list: 1KiB,1MiB")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per size")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    p.add_argument("--json", help="write the table, ceilings and fits here")
    p.add_argument("--html", help="write the bandwidth chart here")
    p.set_defaults(func=cmd_comm)

    p = sub.add_parser("memory", help="memory per rank by category, counted and calculated")
    p.add_argument("--strategies", default="ddp,zero1,fsdp")
    p.add_argument("--world-sizes", default="2")
    p.add_argument("--optimizer", default="sgd_momentum", help="sgd_momentum or adam")
    add_config_args(p)
    p.set_defaults(func=cmd_memory, steps=3, warmup=1)

    p = sub.add_parser("demo", help="environment report, strategy comparison and check")
    p.add_argument("--strategies", default=DP_STRATEGIES)
    p.add_argument("--out", default="out", help="folder for demo.json and demo.html")
    add_config_args(p)
    # big enough that compute, not gloo latency, dominates a step on CPU
    p.set_defaults(func=cmd_demo, steps=30, width=1024, depth=3, global_batch=128)
    add_schedule_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            return args.func(args)
    except (ValueError, TypeError) as exc:  # bad input: one line saying what to change
        print(f"labkit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # every rank was stopped by the launcher
        print("labkit: interrupted: every rank stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
