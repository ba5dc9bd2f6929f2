"""``comm``: collective bandwidth (algbw/busbw as nccl-tests defines them) and the alpha-beta
fit."""

from __future__ import annotations

import json

from .common import csv, writable, write_html


def add_parser(sub) -> None:
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


def cmd_comm(args) -> int:
    from ..labs import comm
    from ..plots import communication as charts
    from ..predict.collectives import OPS, fit_table

    writable("--json", args.json)
    writable("--html", args.html)
    ops = csv(args.ops, flag="--ops")
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
        write_html(args.html, "labkit comm", table, [charts.bandwidth(table, ceilings, fitted)])
        print(f"wrote {args.html}")
    return 0
