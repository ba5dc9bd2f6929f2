"""labkit's predictions beside what this machine measured: the step-time predictor and the
pipeline bubble.

1. Step time (issue 10's goal: <= 15 % error for ddp and ddp_naive at world size 2, on the
   default MLP and at width 1024). The network model is fitted on this run's all-reduce
   timings, the compute profile measured on concurrent ranks
   (``labkit.labs.compute_profile``), the step
   predicted by ``labkit.predict.step`` and set beside the measured median step (slowest rank)
   with ``comm.knob_rows``, the same rows notebook 06 shows: the medians of ``--rounds``
   rounds (fit, profile, run), with the fastest and slowest run beside them.
2. Pipeline bubble (goal: predicted within 0.05 of measured at P=2, at the defaults and at
   width 1024 / batch 1024): measured at M in 1, 2, 4, 8; predicted for M = 2 and 4 from the
   costs measured in the runs at M = 1 and 8 (out of sample); the closed form (P-1)/(M+P-1).

Rows whose ranks did not get their cores are flagged ``busy``: they are not the model's error.

    .venv/bin/python benchmarks/predictions.py [--quick] [--rounds 3] [--json FILE]

Last lines: ``predictor |error| at world size 2: ...`` and ``bubble |predicted - measured|: ...``.
"""

from __future__ import annotations

import argparse
import json
import sys

import pandas as pd

from labkit import RunConfig, experiment
from labkit.labs import comm, compute_profile, pipeline_bubble
from labkit.predict import collectives
from labkit.records import BUSY_SHARE, cpu_share


def step_rows(quick: bool, rounds: int) -> pd.DataFrame:
    """One row per (model, strategy): the medians over ``rounds`` rounds, with the fastest and
    slowest measured step beside them. A round fits the network, profiles each model and runs
    ddp and ddp_naive on it, so each prediction is made from measurements taken minutes, not
    seconds, apart from the run it predicts: one run's median step moved by up to +-30 % from
    run to run here (gloo's thread wake-ups on 2 shared cores), and this VM's compute speed
    drifts by ~10 % over seconds."""
    sizes = "1KiB-1MiB" if quick else "1KiB-16MiB"
    steps = 4 if quick else 20
    models = (
        ("default MLP", RunConfig(world_size=2, steps=steps, global_batch=64)),
        (
            "width 1024",
            RunConfig(world_size=2, steps=max(4, steps * 3 // 5), width=1024, global_batch=256),
        ),
    )
    rows = []
    for r in range(rounds):
        table, _ = comm.benchmark(2, ["all_reduce"], sizes, repeats=3 if quick else 15)
        network = collectives.fit_table(table.to_dict("records"), 2)
        for name, cfg in models:
            prof = compute_profile.measure(cfg)
            runs = [experiment.run(cfg.replace(strategy=s)) for s in ("ddp", "ddp_naive")]
            rows.append(comm.knob_rows(runs, prof, network).assign(model=name, round=r))
    per_run = pd.concat(rows, ignore_index=True)
    by = per_run.groupby(["model", "config"], sort=False)
    med = by.median(numeric_only=True).drop(columns=["round", "error"])
    med = med.assign(
        step_min_ms=by["step_ms"].min(),
        step_max_ms=by["step_ms"].max(),
        rounds=by.size(),
        busy=by["busy"].any(),
    )
    med["error"] = (med["predicted_step_ms"] - med["step_ms"]) / med["step_ms"]
    return med.reset_index()


def bubble_rows(quick: bool) -> pd.DataFrame:
    """Per size and M: the bubble measured, predicted from the runs at the smallest and largest
    M (``pipeline_bubble.bubble_table``: out of sample), and the closed form."""
    tables = []
    sizes = (("defaults", dict()), ("width 1024, batch 1024", dict(width=1024, global_batch=1024)))
    for name, size in sizes:
        runs = []
        for m in (1, 2, 8) if quick else (1, 2, 4, 8):
            cfg = RunConfig(
                strategy="pipeline_gpipe",
                world_size=2,
                stages=2,
                microbatches=m,
                steps=4 if quick else 12,
                **size,
            )
            runs.append(experiment.run(cfg).records)
        records = pd.concat(runs, ignore_index=True)
        table = pipeline_bubble.bubble_table(records, min_cpu_share=None)
        share = records.groupby("microbatches").apply(cpu_share)
        table["cpu_share"] = table["microbatches"].map(share)
        table["busy"] = table["cpu_share"] < BUSY_SHARE
        tables.append(table.assign(size=name))
    out = pd.concat(tables, ignore_index=True)
    return out.rename(
        columns={
            "microbatches": "M",
            "bubble_fraction": "measured",
            "bubble_predicted": "predicted",
            "theory": "closed form",
        }
    )[["size", "M", "role", "measured", "predicted", "closed form", "error", "cpu_share", "busy"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smoke run of a few seconds' work")
    p.add_argument(
        "--rounds", type=int, default=5, help="rounds of fit + profile + runs (default 5)"
    )
    p.add_argument("--json", help="write both tables here")
    args = p.parse_args(argv)
    steps = step_rows(args.quick, 1 if args.quick else args.rounds)
    cols = [
        "model",
        "config",
        "step_ms",
        "step_min_ms",
        "step_max_ms",
        "predicted_step_ms",
        "error",
        "comm_ms",
        "predicted_exposed_ms",
        "cpu_share",
        "busy",
    ]
    print(steps[cols].round(3).to_string(index=False))
    bubbles = bubble_rows(args.quick)
    print(bubbles.round(3).to_string(index=False))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"steps": steps.to_dict("records"), "bubbles": bubbles.to_dict("records")},
                f,
                indent=1,
            )
    err = ", ".join(
        f"{r.config} {r.model} {abs(r.error):.0%}{' (busy)' if r.busy else ''}"
        for r in steps.itertuples()
    )
    print(f"predictor |error| at world size 2: {err}")
    predicted = bubbles[bubbles["role"] == "predicted"]
    quiet = predicted.loc[~predicted["busy"], "error"].abs()
    worst = f"max {quiet.max():.3f} over rows not busy" if len(quiet) else "no row was quiet"
    print(
        f"bubble |predicted - measured|: {worst} ({int(predicted['busy'].sum())} busy of "
        f"{len(predicted)} predicted rows; all: max {predicted['error'].abs().max():.3f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
