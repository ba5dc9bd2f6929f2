"""``dryrun``: one rank of a job of any size, its real strategy code run on tensors without
storage (``labkit.labs.dryrun``): memory by category and every collective, beside the formulas.

    python -m labkit dryrun --strategy fsdp --world-size 1024 --model transformer \\
        --layers 32 --hidden 4096 --heads 32 --seq-len 4096 --vocab 32000
"""

from __future__ import annotations

import json

from ..flags import add_config_arguments, config_from_args
from .common import pd_options, writable

GB = 1e9


def _unit(nbytes: float) -> tuple[float, str]:
    """GB for a model that needs them, else MB (a toy model's bytes read 0.000 GB)."""
    return (GB, "GB") if nbytes >= 0.1 * GB else (1e6, "MB")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "dryrun",
        help="run one rank of a job of any size on tensors without storage: memory and bytes",
    )
    shape = p.add_argument_group("a language model by its shape (with --model transformer)")
    shape.add_argument("--layers", type=int, help="transformer layers L")
    shape.add_argument("--hidden", type=int, help="hidden size h")
    shape.add_argument("--vocab", type=int, help="vocabulary V (then --heads, --seq-len too)")
    shape.add_argument("--tie", action="store_true", help="tie the output layer to the embedding")
    p.add_argument(
        "--rank",
        type=int,
        default=None,
        help="the rank to run (default: each rank that holds something different)",
    )
    p.add_argument(
        "--recipe",
        default="labkit",
        choices=("labkit", "paper"),
        help="labkit: fp32 weights (autocast by --precision); paper: 16-bit weights, "
        "fp32 master weights and Adam's moments (the ZeRO paper's bytes)",
    )
    p.add_argument(
        "--optimizer",
        default=None,
        choices=("sgd_momentum", "adam"),
        help="recipe labkit: the optimizer (default: labkit's SGD with momentum; "
        "adam for a language model)",
    )
    p.add_argument(
        "--device-memory",
        type=float,
        default=None,
        help="GB one device holds: say whether the fullest rank fits",
    )
    p.add_argument("--json", help="write each rank's categories and collectives here")
    add_config_arguments(p)
    p.set_defaults(func=cmd_dryrun, global_batch=0)


def _shape(args):
    from ..labs.dryrun import Transformer

    given = {k: getattr(args, k) for k in ("layers", "hidden", "vocab")}
    if not any(v is not None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(
            f"--{missing[0]}: a language model by its shape needs --layers, --hidden and --vocab "
            f"(with --heads and --seq-len)"
        )
    if args.model != "transformer":
        raise ValueError("--vocab describes a transformer language model: add --model transformer")
    return Transformer(args.layers, args.hidden, args.heads, args.seq_len, args.vocab, args.tie)


def _config(args, shape):
    """The run config; ``--global-batch`` left at 0: one micro-batch of 1 per data rank."""
    from .. import registry

    batch = args.global_batch
    if not batch:
        s = registry.get(args.strategy)
        if args.strategy in registry.STAGED:
            copies = args.world_size // args.stages if s.kind == "composed" else 1
            batch = copies * args.microbatches
        elif s.kind == "tensor_parallel":  # every rank on the same samples
            batch = args.accumulate
        else:  # one per data-parallel rank (per tensor-parallel group, when tp divides)
            tp = args.tp if "tp" in s.knobs and args.tp and args.world_size % args.tp == 0 else 1
            batch = args.world_size // tp * args.accumulate
        batch = max(batch, 1)
    extra = {"global_batch": batch}
    if shape is not None:
        extra.update(
            model="transformer", width=shape.hidden, depth=shape.layers, classes=shape.vocab
        )
    if args.dataset_size < batch:
        extra["dataset_size"] = batch
    return config_from_args(args, **extra)


def cmd_dryrun(args) -> int:
    from ..labs.dryrun import beside, dryrun

    writable("--json", args.json)
    if args.device_memory is not None and not args.device_memory > 0:
        raise ValueError("--device-memory: give the GB one device holds, e.g. 80")
    shape = _shape(args)
    cfg = _config(args, shape)
    optimizer = args.optimizer or ("adam" if shape is not None else None)
    run = dryrun(cfg, rank=args.rank, shape=shape, recipe=args.recipe, optimizer=optimizer)
    model = str(shape) if shape else cfg.model
    print(
        f"dry run: {cfg.strategy} on {cfg.world_size} ranks, {model}, recipe {run.recipe}, "
        f"global batch {cfg.global_batch}"
    )
    with pd_options():
        _print_memory(run)
        _print_collectives(run)
        if not run.failed:
            _print_beside(run, beside)
    if args.device_memory is not None and not run.failed:
        worst = run.fullest()
        fits = worst.total <= args.device_memory * GB
        print(
            f"fullest rank {worst.rank} ({worst.role}): {worst.total / GB:.2f} GB of "
            f"{args.device_memory:g} GB: {'fits' if fits else 'does NOT fit'}"
        )
    for note in run.notes:
        print(f"note: {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(run.to_dict(), f, indent=1)
        print(f"wrote {args.json}")
    return 1 if run.failed else 0


def _print_memory(run) -> None:
    table = run.memory()
    for r in run.failed:
        print(f"rank {r.rank} ({r.role}) {r.error}")
    ok = table[table["error"].isna()].drop(columns="error")
    if ok.empty:
        return
    scale, unit = _unit(ok["total"].max())
    shown = ok.set_index(["rank", "role"]).T / scale
    print(f"memory per rank, {unit} (the meter's categories):")
    print(shown.round(3).to_string())
    print(f"  run in {sum(r.seconds for r in run.ranks):.1f} s")


def _print_collectives(run) -> None:
    table = run.collectives()
    if table.empty:
        print("collectives: none")
        return
    table = table.assign(payload_MB=table["payload_bytes"] / 1e6, sent_MB=table["sent_bytes"] / 1e6)
    cols = ["rank", "role", "op", "group_size", "count", "payload_MB", "sent_MB"]
    print("collectives in one step (sent: bytes this rank puts on the wire, ring algorithms):")
    print(table[cols].round(3).to_string(index=False))


def _print_beside(run, beside) -> None:
    table = beside.beside(run)
    if table["calculator"].isna().all():
        why = "recipe labkit: the formulas describe the paper's recipe (--recipe paper)"
        print(f"calculator: {why if run.shape else 'no formula for this strategy'}")
        return
    cols = ["category", "dry_run", "calculator", "difference", "residual"]
    scale, unit = _unit(table["dry_run"].max())
    where = f"{table.attrs['source']}; rank {table.attrs['rank']}"
    print(f"beside the calculator ({where}), {unit}:")
    print((table[cols].set_index("category") / scale).round(3).to_string())
    for _, row in table.iterrows():
        if row["why"] and row["category"] != "total":
            print(f"  {row['category']}: {row['why']}")
    traffic = beside.traffic_beside(run)
    if traffic["advisor"].notna().all():
        scale, unit = _unit(traffic["dry_run"].max())
        print(f"bytes sent per step beside the layout advisor, {unit}:")
        cols = ["traffic", "dry_run", "advisor", "difference", "residual"]
        print((traffic[cols].set_index("traffic") / scale).round(3).to_string())
        for _, row in traffic.iterrows():
            if row["why"]:
                print(f"  {row['traffic']}: {row['why']}")
