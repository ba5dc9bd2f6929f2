"""What an elastic job pays for each change: a node joining, a worker killed, a node leaving.

    python benchmarks/elastic.py [--pace 0.02] [--checkpoint-every 10] [--quick] [--json PATH]

One torchrun job (``labkit.labs.elastic.ElasticJob``, ddp, ``--nnodes 1:2``, ``--max-restarts 3``,
agents on loopback) trains a small MLP: one node starts; after 20 steps a second joins; after 20
steps at world size 2 one worker is SIGKILLed; 20 steps after the restart the second node leaves;
20 steps later the first is stopped (SIGTERM). ``--quick``: 6 steps per phase, a checkpoint
every 3 (a smoke run; the re-forms still take their full time). Each step lasts at least
``--pace`` seconds (a real model's pace; the toy MLP alone takes milliseconds).
Printed: the cold start (first agent started -> first step), per change the steps lost, the time
from the change to the first step of the re-formed group (``reform_s``) and the time without any
step (``pause_s``); then the loss at the steps around each change beside an uninterrupted
one-process run of the same config (the same global batch every step, so the same curve). The
last line is the kill's re-form time over the cold start, both from this one run.
"""

from __future__ import annotations

import argparse
import json
import sys

import pandas as pd

from labkit import RunConfig, experiment
from labkit.labs.elastic import ElasticJob, changes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--pace", type=float, default=0.02, help="seconds a step lasts at least")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="6 steps per phase (a smoke run)")
    args = p.parse_args(argv)
    phase = 6 if args.quick else 20  # steps between two changes
    if args.quick:
        args.checkpoint_every = 3
    cfg = RunConfig(
        strategy="ddp",
        steps=100_000,
        warmup=0,
        width=64,
        depth=2,
        global_batch=32,
        dataset_size=512,
        timeout_s=60,
        pace_s=args.pace,
    )
    with ElasticJob(
        cfg, nnodes="1:2", max_restarts=3, checkpoint_every=args.checkpoint_every
    ) as job:
        job.add_agent()
        job.wait_for(lambda s: len(s) > 0 and s["step"].max() >= phase, timeout_s=120)
        job.add_agent()
        job.wait_for(lambda s: (s["world_size"] == 2).sum() >= phase, timeout_s=120)
        job.kill_worker()
        job.wait_for(
            lambda s: (
                s["attempt"].max() >= 2 and (s["attempt"] == s["attempt"].max()).sum() >= phase
            ),
            timeout_s=120,
        )
        job.remove_agent(1)
        job.wait_for(
            lambda s: s["attempt"].max() >= 3 and (s["attempt"] == 3).sum() >= phase,
            timeout_s=120,
        )
        job.remove_agent(0)  # the end: SIGTERM, a checkpoint, exit
        job.wait(timeout_s=180)
        steps = job.steps()
    table = changes(job.events, steps, job.t0)
    cold = float(steps["time_s"].iloc[0])
    print(f"cold start (first agent started -> first step): {cold:.2f} s")
    print(table.to_string(index=False))
    ref = experiment.run(
        cfg.replace(strategy="single", world_size=1, pace_s=0, steps=int(steps["step"].max()))
    ).records
    reference = ref.set_index(ref["step"] + 1)["loss"]
    last = steps.drop_duplicates("step", keep="last").set_index("step")
    around = sorted(
        {
            s
            for r in table.itertuples()
            for s in (
                r.last_step_before - 1,
                r.last_step_before,
                r.first_step_after,
                r.first_step_after + 1,
            )
            if s in last.index
        }
    )
    curve = pd.DataFrame(
        {
            "world_size": last.loc[around, "world_size"].astype(int),
            "attempt": last.loc[around, "attempt"].astype(int),
            "loss (elastic)": last.loc[around, "loss"].round(5),
            "loss (uninterrupted)": reference.loc[around].round(5),
        }
    )
    print("\nthe loss around each change, beside the uninterrupted run:")
    print(curve.to_string())
    gap = float((last["loss"] - reference).abs().max())
    print(f"largest loss difference over all {len(last)} steps: {gap:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cold_start_s": cold,
                    "changes": table.to_dict("records"),
                    "curve": curve.reset_index().to_dict("records"),
                    "max_loss_gap": gap,
                },
                f,
                indent=1,
            )
    kill = table[table["event"] == "kill"]
    if len(kill):
        print(f"kill-to-first-step over cold start ratio: {kill['reform_s'].iloc[0] / cold:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
