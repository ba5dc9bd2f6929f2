"""labkit's DDP trainer vs a minimal hand-written DDP loop: same model, data, ranks and launcher.

    python benchmarks/ddp_overhead.py [--steps 30] [--rounds 24] [--width 512] [--quick]
                                      [--json PATH]

Both sides run through ``labkit.launch`` (so process start-up is identical, and not timed) and
alternate round by round, so a noisy neighbour slows both.

The headline is end to end: on each rank, the wall time from the first measured step's start to
the last measured step's end on the same clock (``perf_counter``), so everything labkit does
between steps (``probe.finish`` building the record, ``ctx.report`` sending progress) counts;
the slowest rank's time per step is the side's figure for the round. Each round compares the two
sides and the ratio reported is the median of the per-round ratios: pairing rounds that ran
seconds apart keeps load from other processes (which comes and goes over seconds) from landing
on one side only. The last line is ``labkit/raw step-time ratio: X.XX`` (goal <= 1.02).
Round ratios on this 2-core VM spread 0.8-1.3, so the median of 8 moved by +-0.05 from run to
run (0.97, 1.03, 1.06 in three runs of the same code): 24 rounds is the default, and the report
gives a bootstrap 90 % interval of the median beside it.
labkit's DDP strategy runs a calibration (5 backward passes under ``no_sync``) once, after
warm-up and before its first measured step: it is outside the measured span. The median probed
``step_s`` (which excludes the work between steps) is printed for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import labkit
from labkit.config import RunConfig
from labkit.data import batches, make_dataset, shard_loader
from labkit.models import make_model
from labkit.rank.probes import probe_overhead_s
from labkit.strategies import run_rank
from labkit.wire import unwatch

WORLD_SIZE = 2
GOAL_RATIO = 1.02  # #34: end to end, median of interleaved rounds


def raw_ddp_rank(ctx, cfg: RunConfig) -> dict:
    """The hand-written baseline: DDP as the PyTorch tutorial writes it, timed per step, on a
    process group without labkit's byte-counting hooks."""
    unwatch()
    torch.manual_seed(cfg.seed)
    model = DDP(make_model(cfg).to(ctx.device))
    loader = shard_loader(
        make_dataset(cfg),
        cfg.global_batch // ctx.world_size,
        ctx.rank,
        ctx.world_size,
        seed=cfg.seed,
    )
    data = batches(loader)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    times, first_start = [], None
    for i in range(cfg.warmup + cfg.steps):
        t0 = time.perf_counter()
        if i == cfg.warmup:
            first_start = t0
        x, y = next(data)
        loss = loss_fn(model(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        if i >= cfg.warmup:
            times.append(time.perf_counter() - t0)
    return {"step_s": times, "wall_s": time.perf_counter() - first_start}


def run_labkit(cfg: RunConfig) -> tuple[list[float], float]:
    """Per-step max-over-ranks ``step_s``, and the slowest rank's end-to-end wall per step."""
    results = labkit.launch(
        run_rank, WORLD_SIZE, args=(cfg,), device="cpu", timeout_s=cfg.timeout_s
    )
    per_rank = [[rec["step_s"] for rec in res["records"]] for res in results]
    # start_s is each step's start on the shared clock; the last step ends step_s later
    walls = [
        (r[-1]["start_s"] + r[-1]["step_s"] - r[0]["start_s"])
        for r in (res["records"] for res in results)
    ]
    return _max_over_ranks(per_rank), max(walls) / cfg.steps


def run_raw(cfg: RunConfig) -> tuple[list[float], float]:
    results = labkit.launch(
        raw_ddp_rank, WORLD_SIZE, args=(cfg,), device="cpu", timeout_s=cfg.timeout_s
    )
    return (
        _max_over_ranks([r["step_s"] for r in results]),
        max(r["wall_s"] for r in results) / cfg.steps,
    )


def _max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    return [max(step) for step in zip(*per_rank)]


def measure(cfg: RunConfig, rounds: int) -> dict:
    """Alternate labkit and raw for ``rounds`` rounds (who goes first alternates too)."""
    labkit.launch(
        raw_ddp_rank,
        WORLD_SIZE,
        args=(cfg.replace(steps=1, warmup=0),),
        device="cpu",
        timeout_s=cfg.timeout_s,
    )  # start the forkserver, untimed
    out = {"labkit": [], "raw": [], "rounds": []}
    for i in range(rounds):
        walls = {}
        for side in ("labkit", "raw") if i % 2 == 0 else ("raw", "labkit"):
            steps, walls[side] = run_labkit(cfg) if side == "labkit" else run_raw(cfg)
            out[side] += steps
        out["rounds"].append(walls)
    return out


def median_interval(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap 90 % interval of the median: resample the values with replacement."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return meds[int(0.05 * draws)], meds[int(0.95 * draws) - 1]


def summarise(measured: dict, probe_s: float) -> dict:
    med = {k: statistics.median(measured[k]) for k in ("labkit", "raw")}
    wall = {k: statistics.median(r[k] for r in measured["rounds"]) for k in ("labkit", "raw")}
    round_ratios = [r["labkit"] / r["raw"] for r in measured["rounds"]]
    return {
        "median_step_s": {"labkit": med["labkit"], "raw": med["raw"]},
        "wall_per_step_s": wall,
        "round_ratios": round_ratios,
        "probed_step_ratio": med["labkit"] / med["raw"],
        "probe_overhead_s": probe_s,
        "probe_overhead_fraction": probe_s / wall["labkit"],
        "ratio": statistics.median(round_ratios),
        "ratio_interval_90": median_interval(round_ratios),
    }


def print_report(cfg: RunConfig, rounds: int, s: dict) -> None:
    print(
        f"DDP, {WORLD_SIZE} CPU ranks on gloo, {cfg.model} width {cfg.width} depth "
        f"{cfg.depth}, global batch {cfg.global_batch}; {rounds} rounds x {cfg.steps} steps "
        f"(+{cfg.warmup} warm-up); {_cores()} CPU cores; torch {torch.__version__}"
    )
    for i, r in enumerate(s["round_ratios"]):
        print(f"round {i}: labkit/raw end-to-end {r:.3f}")
    print(
        f"end-to-end wall per step (slowest rank, median over rounds): labkit "
        f"{s['wall_per_step_s']['labkit'] * 1e3:.3f} ms, raw "
        f"{s['wall_per_step_s']['raw'] * 1e3:.3f} ms"
    )
    print(
        f"probed step only (median, max over ranks; excludes work between steps): labkit "
        f"{s['median_step_s']['labkit'] * 1e3:.3f} ms, raw "
        f"{s['median_step_s']['raw'] * 1e3:.3f} ms (ratio {s['probed_step_ratio']:.2f})"
    )
    print(
        f"probe overhead: {s['probe_overhead_s'] * 1e6:.1f} us per step "
        f"({s['probe_overhead_fraction'] * 100:.2f}% of labkit's step)"
    )
    lo, hi = s["ratio_interval_90"]
    print(
        f"median of {len(s['round_ratios'])} round ratios {s['ratio']:.3f}, bootstrap 90 % "
        f"interval {lo:.3f}-{hi:.3f}"
    )
    print(f"goal labkit/raw <= {GOAL_RATIO}: {'met' if s['ratio'] <= GOAL_RATIO else 'NOT met'}")
    print(f"labkit/raw step-time ratio: {s['ratio']:.2f}")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per run")
    parser.add_argument("--rounds", type=int, default=24, help="labkit/raw alternations")
    parser.add_argument("--width", type=int, default=512, help="MLP hidden width")
    parser.add_argument(
        "--quick", action="store_true", help="1 round of 8 small steps: a smoke run"
    )
    parser.add_argument("--json", metavar="PATH", help="also write samples and medians here")
    args = parser.parse_args(argv)
    steps, rounds, width = (8, 1, 64) if args.quick else (args.steps, args.rounds, args.width)
    if steps < 2 or rounds < 1:
        parser.error("--steps must be at least 2 and --rounds at least 1")
    cfg = RunConfig(
        strategy="ddp",
        world_size=WORLD_SIZE,
        steps=steps,
        warmup=5,
        width=width,
        device="cpu",
        timeout_s=300.0,
    )
    measured = measure(cfg, rounds)
    summary = summarise(measured, probe_overhead_s("cpu"))
    if args.json:
        out = {
            "benchmark": "ddp_overhead",
            "cfg": cfg.to_dict(),
            "rounds": rounds,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "cpu_cores": _cores(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
            "samples_s": {k: measured[k] for k in ("labkit", "raw")},
            "wall_per_step_rounds_s": measured["rounds"],
            **summary,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print_report(cfg, rounds, summary)  # last, so its last line is the ratio
    return 0


if __name__ == "__main__":
    sys.exit(main())
