"""One rank of any strategy under torchrun (one node or many, elastic or not).

    torchrun --standalone --nproc-per-node 2 -m labkit.worker --strategy ddp --steps 20 \
        --out run.json

torchrun starts the processes and sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address;
``labkit.dist.session()`` reads them, so the strategy code is exactly what ``labkit.launch`` runs
from a notebook. Records are gathered to rank 0, which writes them in the same JSON format as
``python -m labkit compare --json``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .__main__ import _writable, add_config_args, config_from_args
from .config import PIPELINE_STRATEGIES, STRATEGY_RANKS, RunConfig
from .dist import gather_to_main, session
from .env import cpu_cores, oversubscription
from .experiment import save_records
from .strategies import run_rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="torchrun ... -m labkit.worker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--out", help="rank 0 writes the records here (JSON)")
    add_config_args(p)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error(
            "no torchrun environment (RANK, WORLD_SIZE): start me with "
            "torchrun --nproc-per-node N -m labkit.worker ..."
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:  # every rank checks; only rank 0 says it, once
        cfg = _config(args, world_size)
        _writable("--out", args.out)
    except ValueError as exc:
        if rank == 0:
            print(f"labkit.worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    threads = cfg.threads or max(1, cpu_cores() // local_world)
    torch.set_num_threads(threads)
    # the loss of the global batch lives on the last stage of a pipeline; a data-parallel rank
    # knows only its own shard's, and says so
    speaker = world_size - 1 if cfg.strategy in PIPELINE_STRATEGIES else 0
    what = "loss" if cfg.strategy in PIPELINE_STRATEGIES else "loss (rank 0's shard)"

    def report(step, total, loss, **_):
        if rank == speaker and (step % 10 == 0 or step == total):
            print(f"{cfg.strategy}: step {step}/{total} {what} {loss:.4f}", flush=True)

    with session(
        device=cfg.device, backend=cfg.backend, timeout_s=cfg.timeout_s, report=report
    ) as ctx:
        result = run_rank(ctx, cfg)
        gathered = gather_to_main({"records": result["records"], "notes": result["notes"]})
    if gathered is not None:
        from .experiment import finalize, summarize
        from .report import format_table

        records = finalize([r for part in gathered for r in part["records"]])
        oversub = oversubscription(local_world, threads) if ctx.device.type == "cpu" else None
        records["oversubscribed"] = oversub is not None
        notes = list(
            dict.fromkeys(
                [
                    *([oversub] if oversub else []),
                    *(n for part in gathered for n in part["notes"]),
                    *records.attrs.pop("notes", []),
                ]
            )
        )
        records.attrs["notes"] = {f"{cfg.strategy}@{world_size}": notes} if notes else {}
        if len(records):
            print(format_table(summarize(records)))
        for note in notes:
            print(f"note: {note}")
        timeline = {}
        if cfg.checkpoint_dir:  # the whole history, across restarts and world sizes
            from .checkpoint import read_timeline

            timeline = {"timeline": read_timeline(cfg.checkpoint_dir)}
        if args.out:
            save_records(records, args.out, config=cfg.to_dict(), launcher="torchrun", **timeline)
            print(f"records: {args.out} ({len(records)} rows)")
    return 0


def _config(args, world_size: int) -> RunConfig:
    """The run's config, or a ValueError whose fix applies under torchrun."""
    if (
        args.strategy in STRATEGY_RANKS
        and STRATEGY_RANKS[args.strategy] == "one"
        and world_size != 1
    ):
        raise ValueError(
            f"{args.strategy} runs in one process: start it with "
            f"torchrun --nproc-per-node 1 (and one node), or pick ddp"
        )
    if args.strategy in PIPELINE_STRATEGIES and args.stages != world_size:
        raise ValueError(
            f"{args.strategy} puts one stage on each process: pass --stages "
            f"{world_size} (the world size torchrun started), or start "
            f"{args.stages} processes"
        )
    return config_from_args(args, strategy=args.strategy, world_size=world_size)


if __name__ == "__main__":
    sys.exit(main())
