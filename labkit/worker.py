"""One rank of any strategy under torchrun (one node or many, elastic or not).

    torchrun --standalone --nproc-per-node 2 -m labkit.worker --strategy ddp --steps 20 --out run.json

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

from .__main__ import add_config_args, config_from_args
from .dist import gather_to_main, print0, session
from .env import cpu_cores
from .experiment import save_records
from .strategies import run_rank


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchrun ... -m labkit.worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--out", help="rank 0 writes the records here (JSON)")
    add_config_args(p)
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("no torchrun environment (RANK, WORLD_SIZE): start me with "
                "torchrun --nproc-per-node N -m labkit.worker ...")
    world_size = int(os.environ["WORLD_SIZE"])
    cfg = config_from_args(args, strategy=args.strategy, world_size=world_size)
    if cfg.ranks != world_size:
        p.error(f"{cfg.strategy} runs in one process: use --nproc-per-node 1")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    torch.set_num_threads(cfg.threads or max(1, cpu_cores() // local_world))

    def report(step, total, loss, **_):
        if step % 10 == 0 or step == total:
            print0(f"{cfg.strategy}: step {step}/{total} loss {loss:.4f}", flush=True)

    with session(device=cfg.device, backend=cfg.backend, timeout_s=cfg.timeout_s,
                 report=report) as ctx:
        result = run_rank(ctx, cfg)
        gathered = gather_to_main(result["records"])
    if gathered is not None:
        from .experiment import finalize, summarize
        from .report import format_table
        records = finalize([r for rank_records in gathered for r in rank_records])
        print(format_table(summarize(records)))
        if args.out:
            save_records(records, args.out, config=cfg.to_dict(), launcher="torchrun")
            print(f"records: {args.out} ({len(records)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
