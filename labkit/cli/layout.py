"""``layout``: the layout advisor (``labkit.predict.layout``): tp x pp x dp, ZeRO stage,
micro-batch and recomputation for a transformer on a cluster, ranked by predicted speed."""

from __future__ import annotations

import json

from .common import writable

COLUMNS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "zero": "zero",
    "microbatch": "micro-batch",
    "recompute": "recompute",
    "mem_per_gpu_GB": "GB/GPU",
    "fits": "fits",
    "step_ms": "step ms",
    "tokens_per_s": "tokens/s",
    "tflops_per_gpu": "TFLOP/s/GPU",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "layout", help="rank tensor/pipeline/data-parallel layouts of a transformer on a cluster"
    )
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--vocab", type=int, default=51200)
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--device", default="A100 80GB", help="A100 80GB or H100 SXM 80GB")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    p.add_argument("--mfu", type=float, default=None, help="assumed share of peak (default 0.5)")
    p.add_argument("--top", type=int, default=10, help="how many layouts to show")
    p.add_argument("--json", help="write the ranked layouts here (a list, best first)")
    p.set_defaults(func=cmd_layout)


def cmd_layout(args) -> int:
    """Plan, print the best ``--top`` layouts and say what the figures rest on."""
    from ..predict import layout

    writable("--json", args.json)
    if args.top < 1:
        raise ValueError("--top: show at least 1 layout")
    mfu = layout.MFU if args.mfu is None else args.mfu
    plans = layout.plan(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        vocab=args.vocab,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        device=args.device,
        global_batch=args.global_batch,
        mfu=mfu,
    )
    layout.require_fit(plans)
    shown = layout.to_frame(plans[: args.top])
    table = shown[list(COLUMNS)].rename(columns=COLUMNS)
    table["tokens/s"] = table["tokens/s"].round().astype(int)
    print(table.round({"GB/GPU": 1, "step ms": 1, "TFLOP/s/GPU": 1}).to_string())
    gpu = layout.DEVICES[args.device]
    print(
        f"{sum(p.fits for p in plans)} of {len(plans)} layouts fit in "
        f"{plans[0].device_memory_bytes / 1e9:.0f} GB per GPU ({gpu.name} less a "
        f"{layout.RESERVE:.0%} reserve); best first"
    )
    print(
        f"device and link figures are published ({gpu.name}, {gpu.nvlink}, {gpu.network}; "
        f"latencies typical); {mfu:g} of peak while computing is an "
        f"assumption (--mfu); {layout.FLOPS_CONVENTION}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([p.to_dict() for p in plans], f, indent=1)
        print(f"wrote {args.json}")
    return 0
