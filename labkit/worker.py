"""One rank of any strategy under torchrun (one node or many, elastic or not).

    torchrun --standalone --nproc-per-node 2 -m labkit.worker --strategy ddp --steps 20 \
        --out run.json

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address;
``labkit.dist.session()`` reads them, so the strategy code is exactly what ``labkit.launch`` runs
from a notebook. Every ``RunConfig`` field is a flag (``labkit.flags``). Records are gathered to
rank 0, which builds them as ``labkit.experiment.run`` does (``labkit.records.from_ranks``) and
writes them in the same JSON format as ``python -m labkit compare --json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import registry
from .cli.common import writable
from .config import RunConfig
from .dist import gather_to_main, refuse_shared_store_restarts, session
from .env import cpu_cores, oversubscription
from .flags import add_config_arguments, config_from_args
from .rank.resume import read_timeline
from .records import config_label, from_ranks, save_records, summarize
from .report import format_table
from .strategies import run_rank
from .trace import to_chrome_trace


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun ... -m labkit.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", help="rank 0 writes the records here (JSON)")
    p.add_argument("--trace", help="rank 0 writes a Chrome trace of every rank here")
    add_config_arguments(p)
    # torchrun decides the world size; the flag, if given, must agree with it
    p.set_defaults(world_size=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error(
            "no torchrun environment (RANK, WORLD_SIZE): start me with "
            "torchrun --nproc-per-node N -m labkit.worker ..."
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:  # every rank checks; only rank 0 says it, once
        cfg = _config(args, world_size)
        refuse_shared_store_restarts()
        writable("--out", args.out)
        writable("--trace", args.trace)
    except ValueError as exc:
        if rank == 0:
            print(f"labkit.worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    threads = cfg.threads or max(1, cpu_cores() // local_world)
    torch.set_num_threads(threads)
    # the loss of the global batch lives on the last stage of a pipeline; a data-parallel rank
    # knows only its own shard's, and says so
    pipeline = registry.get(cfg.strategy).kind == "pipeline"
    speaker = world_size - 1 if pipeline else 0
    what = "loss" if pipeline else "loss (rank 0's shard)"

    def report(step, total, loss, **_):
        if rank == speaker and (step % 10 == 0 or step == total):
            print(f"{cfg.strategy}: step {step}/{total} {what} {loss:.4f}", flush=True)

    with session(
        device=cfg.device, backend=cfg.backend, timeout_s=cfg.timeout_s, report=report
    ) as ctx:
        result = run_rank(ctx, cfg)
        gathered = gather_to_main({"records": result["records"], "notes": result["notes"]})
    if gathered is not None:
        oversub = oversubscription(local_world, threads) if ctx.device.type == "cpu" else None
        records = from_ranks(cfg, gathered, oversub)
        notes = records.attrs["notes"]
        records.attrs["notes"] = {config_label(cfg): notes} if notes else {}
        if len(records):
            print(format_table(summarize(records)))
        for note in notes:
            print(f"note: {note}")
        timeline = {}
        if cfg.checkpoint_dir:  # the whole history, across restarts and world sizes
            timeline = {"timeline": read_timeline(cfg.checkpoint_dir)}
        records["node"] = records["rank"] // local_world  # torchrun numbers ranks node by node
        if args.out:
            save_records(records, args.out, config=cfg.to_dict(), launcher="torchrun", **timeline)
            print(f"records: {args.out} ({len(records)} rows)")
        if args.trace:
            to_chrome_trace(records, args.trace, meta={"config": cfg.to_dict(), **timeline})
            print(f"trace: {args.trace}")
    return 0


def _config(args, world_size: int) -> RunConfig:
    """The run's config, or a ValueError whose fix applies under torchrun."""
    strategy = registry.get(args.strategy)
    if args.world_size is not None and args.world_size != world_size:
        raise ValueError(
            f"--world-size {args.world_size}: torchrun started {world_size} processes; drop "
            f"the flag or start {args.world_size}"
        )
    if strategy.one_process and world_size != 1:
        raise ValueError(
            f"{args.strategy} runs in one process: start it with "
            f"torchrun --nproc-per-node 1 (and one node), or pick ddp"
        )
    if strategy.kind == "pipeline" and args.stages != world_size:
        raise ValueError(
            f"{args.strategy} puts one stage on each process: pass --stages "
            f"{world_size} (the world size torchrun started), or start "
            f"{args.stages} processes"
        )
    return config_from_args(args, world_size=world_size)


if __name__ == "__main__":
    sys.exit(main())
