"""The commands that run strategies: ``env``, ``compare``, ``check``, ``memory`` and ``demo``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .. import registry
from ..config import RunConfig
from ..flags import add_config_arguments, config_from_args
from ..registry import SYNC_ASYNC
from .common import csv, one_run_only, pd_options, writable, write_html

DP_STRATEGIES = "single,dataparallel,ddp,ddp_naive"
_PARSERS: dict[str, argparse.ArgumentParser] = {}  # the demo runs compare and check as parsed


def add_parsers(sub) -> None:
    p = sub.add_parser("env", help="what this machine has and what labkit will use")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_env)

    p = _PARSERS["compare"] = sub.add_parser(
        "compare", help="run strategies over world sizes and compare them"
    )
    p.add_argument("--json", help="write per-rank records here")
    p.add_argument("--html", help="write a plotly report here")
    p.add_argument("--trace", help="write a Chrome trace here (Perfetto, chrome://tracing)")
    add_config_arguments(p, sweep=("strategy", "world_size"))
    p.set_defaults(func=cmd_compare)

    p = _PARSERS["check"] = sub.add_parser(
        "check", help="do strategies reach the same parameters as single?"
    )
    p.add_argument("--tol", type=float, default=1e-5, help="largest difference allowed")
    add_config_arguments(p, sweep=("strategy",))
    # None: the model the strategies need (a transformer for cp and ep, experts for ep)
    p.set_defaults(func=cmd_check, steps=5, strategies=DP_STRATEGIES, model=None, experts=None)

    p = sub.add_parser("memory", help="memory per rank by category, counted and calculated")
    p.add_argument("--optimizer", default="sgd_momentum", choices=("sgd_momentum", "adam"))
    add_config_arguments(p, sweep=("strategy", "world_size"))
    p.set_defaults(func=cmd_memory, steps=3, warmup=1, strategies="ddp,zero1,fsdp", world_sizes="2")

    p = sub.add_parser("demo", help="environment report, strategy comparison and check")
    p.add_argument("--out", default="out", help="folder for demo.json and demo.html")
    add_config_arguments(p, sweep=("strategy",), skip=("world_size",))
    # big enough that compute, not gloo latency, dominates a step on CPU
    p.set_defaults(
        func=cmd_demo, steps=30, width=1024, depth=3, global_batch=128, strategies=DP_STRATEGIES
    )


def cmd_env(args) -> int:
    from ..env import probe

    report = probe()
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0


def cmd_compare(args) -> int:
    one_run_only(args)
    from .. import experiment
    from ..records import config_label

    writable("--json", args.json)
    writable("--html", args.html)
    writable("--trace", args.trace)
    sizes = csv(args.world_sizes, int, flag="--world-sizes")
    strategies = csv(args.strategies, flag="--strategies")
    balancing = bool(args.slowdown) or args.skew > 0 or args.rebalance != "static"
    # the base must be a config the flags are valid on: load-balancing knobs belong to
    # ddp_naive; any other knob (--comm-hook, --inner-lr, ...) to the first strategy named
    # (a later one that does not take it is refused with the fix, by experiment.grid)
    ref = registry.REFERENCE
    first = next((s for s in strategies if s != ref), ref)
    kind = registry.get(first).kind if first in registry.STRATEGIES else "reference"
    world = {"reference": 1, "pipeline": args.stages}.get(kind, max(sizes))
    base = config_from_args(
        args,
        **(
            dict(strategy="ddp_naive", world_size=max(sizes))
            if balancing
            else dict(strategy=first, world_size=world)
        ),
    )
    configs = experiment.grid(base, strategies, sizes)
    print(
        f"running {len(configs)} configurations: " + ", ".join(config_label(c) for c in configs),
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
    from ..records import config_label

    finished.append(res)
    print(f"finished {config_label(res.cfg)} ({len(res.records)} records)", flush=True)


def _report(args, base: RunConfig, records) -> int:
    """Print the table and its reading; write the records and the HTML report if asked."""
    from .. import plots
    from ..records import save_records, summarize
    from ..report import explain

    table = summarize(records)
    _print_table(table)
    for key, notes in records.attrs.get("notes", {}).items():
        for note in notes:
            print(f"note ({key}): {note}")
    print("\n== what the table says\n" + explain(table))
    if records["strategy"].isin(SYNC_ASYNC[1:]).any():  # the periodic and asynchronous modes
        from ..labs.sync_async import default_target, people_table, to_target

        target = default_target(records)
        print(
            f"\n== to a loss of {target:.3f} "
            f"(smoothed over 4 global batches; labkit.labs.sync_async)"
            f"\nasync_ps and hogwild: read this table, not the one above, which pairs ranks "
            f"by step number (asynchronous ranks share none)"
        )
        print(people_table(to_target(records, target)).to_string(index=False))
    if args.json:
        save_records(
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
        write_html(args.html, "labkit compare", table, figs)
        print(f"report: {args.html}")
    if getattr(args, "trace", None):
        from ..trace import to_chrome_trace

        to_chrome_trace(records, args.trace, meta={"config": base.to_dict()})
        print(f"trace: {args.trace} (open it in ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_check(args) -> int:
    one_run_only(args)
    import pandas as pd

    from ..labs.equivalence import check

    if args.world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {args.world_size}")
    if not args.tol > 0:
        raise ValueError(f"--tol must be positive, got {args.tol}")
    names = csv(args.strategies, flag="--strategies")
    groups = _model_groups(args, names)
    bases = [_check_config(args, group, **model) for group, model in groups]  # all valid first
    if (args.model is None or args.experts is None) and any(
        m["model"] != RunConfig.__dataclass_fields__["model"].default or m["experts"]
        for _, m in groups
    ):
        print(
            "; ".join(
                f"{', '.join(g)}: model={m['model']!r}"
                + (f", experts={m['experts']}" if m["experts"] else "")
                for g, m in groups
            )
            + " (--model and --experts choose)"
        )
    result = pd.concat(
        [
            check(base, group, args.world_size, steps=args.steps, tol=args.tol)
            for base, (group, _) in zip(bases, groups)
        ],
        ignore_index=True,
    )
    print(result.drop(columns=["why"]).to_string(index=False))
    for _, row in result[result["why"] != ""].iterrows():
        print(f"note ({row['strategy']}): {row['why']}")
    bad = result[~result["ok"]]
    wide = result[result["compared_in"] == "float64"]  # float32 rounding, amplified, exceeded tol
    if len(bad):
        named = ", ".join(f"{s} (in {d})" for s, d in zip(bad["strategy"], bad["compared_in"]))
        print(f"FAILED: {named} differ from single by more than {args.tol:g}")
        return 1
    print(
        f"all strategies match single within {args.tol:g} after {args.steps} steps"
        + (f" ({', '.join(wide['strategy'])} compared in float64)" if len(wide) else "")
    )
    return 0


def _model_groups(args, names: list[str]) -> list[tuple[list[str], dict]]:
    """The strategies of one ``check`` grouped by the model each is checked on: what ``--model``
    and ``--experts`` say, or, left out, the one the strategy needs (a transformer to split the
    sequence of, cp; a mixture of experts to spread, ep, on ``2 x world size`` experts; the MLP
    for the rest), each group against its own single-device run."""
    dense = RunConfig.__dataclass_fields__["model"].default

    def needs(name: str) -> dict:
        s = registry.get(name)
        spread = s.kind == "expert_parallel"
        experts = 2 * args.world_size if spread else 0  # unless --experts says
        if args.experts is not None:
            experts = args.experts
        lm = spread or "cp" in s.knobs or experts
        return dict(model=args.model or ("transformer" if lm else dense), experts=experts)

    wanted = {name: needs(name) for name in names}
    if args.model is None and any(m["model"] != dense for m in wanted.values()):
        wanted = {n: {**m, "model": "transformer"} for n, m in wanted.items()}  # one LM for all
    groups: dict[tuple, list[str]] = {}
    for name, model in wanted.items():
        groups.setdefault(tuple(model.items()), []).append(name)
    return [(group, dict(key)) for key, group in groups.items()]


def _check_config(args, names: list[str], **model) -> RunConfig:
    """The flags as the config of one check: validated against the first strategy checked (a
    knob such as --comm-hook belongs to it, not to the single-device reference, which drops it),
    or with --tp the first that splits layers (the others drop it: equivalence.config_for)."""
    from ..labs.equivalence import world_size_for

    first = next((s for s in names if s != registry.REFERENCE), registry.REFERENCE)
    if args.tp is not None or args.sequence_parallel:
        first = next((s for s in names if "tp" in registry.get(s).knobs), first)
    if args.cp is not None or args.cp_layout != RunConfig.__dataclass_fields__["cp_layout"].default:
        first = next((s for s in names if "cp" in registry.get(s).knobs), first)
    return config_from_args(
        args, strategy=first, world_size=world_size_for(first, args.world_size, args.stages),
        **model,
    )  # fmt: skip


def cmd_demo(args) -> int:
    """The main job: what this machine has, then the data-parallel comparison and the check."""
    from ..env import probe

    report = probe()
    print("== environment\n" + str(report) + "\n", flush=True)
    sizes = sorted({1, *[w for w in (2, 4, 8) if w <= max(2, report.max_world_size)]})
    os.makedirs(args.out, exist_ok=True)  # (--out is a folder labkit creates)
    print("== compare", flush=True)
    failed = cmd_compare(
        _as_parsed(
            "compare",
            args,
            world_sizes=",".join(map(str, sizes)),
            json=os.path.join(args.out, "demo.json"),
            html=os.path.join(args.out, "demo.html"),
        )
    )
    if failed:
        return failed
    print("\n== equivalence check (5 steps, deterministic)", flush=True)
    return cmd_check(_as_parsed("check", args, steps=5, world_size=2))


def _as_parsed(command: str, args, **values) -> argparse.Namespace:
    """``command``'s arguments as its parser gives them, holding ``args``' shared values."""
    parsed = vars(_PARSERS[command].parse_args([]))
    parsed.update({k: v for k, v in vars(args).items() if k in parsed and k != "func"})
    return argparse.Namespace(**{**parsed, **values})


class _Progress:
    """One tqdm bar per run (rank 0's steps); silent when stderr is not a terminal."""

    def __enter__(self):
        self.bar, self.key = None, None
        return self

    def update(self, cfg, rank, metrics) -> None:
        from tqdm.auto import tqdm

        from ..records import LiveLoss

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
    from ..report import format_table

    print(format_table(table))
    if "oversubscribed" in table and table["oversubscribed"].any():
        print(
            "! rows with more CPU ranks than cores are time-shared: their speed-up is not "
            "parallelism"
        )


def cmd_memory(args) -> int:
    """Bytes per rank by category for each strategy, counted, and the calculator's error."""
    from ..labs.memory import measure, memory_table

    base = config_from_args(args, strategy="ddp", world_size=2)
    sizes = csv(args.world_sizes, int, "--world-sizes")
    records, errors = measure(
        base, csv(args.strategies, flag="--strategies"), sizes, args.optimizer
    )
    with pd_options():
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
