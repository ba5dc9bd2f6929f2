"""How often does a torchrun rank abort at exit? The regression check for session()'s teardown.

DDP's reducer sits in reference cycles that can keep gloo work alive until interpreter shutdown,
where a rank then aborts with "terminate called without an active exception" (pytorch#179291).
``labkit.dist.session()`` collects garbage before destroying the group; this runs the tested
torchrun command (tests/ranks/test_cli.py) N times and counts the runs that failed or aborted.

    .venv/bin/python benchmarks/torchrun_exit.py --runs 70

Last line: ``torchrun exit aborts: K of N runs``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

COMMAND = [
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc-per-node",
    "2",
    "-m",
    "labkit.worker",
    "--strategy",
    "ddp",
    "--steps",
    "4",
    "--width",
    "64",
    "--depth",
    "2",
    "--global-batch",
    "32",
    "--dataset-size",
    "512",
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=70)
    p.add_argument("--quick", action="store_true", help="3 runs (a smoke test)")
    args = p.parse_args(argv)
    runs = 3 if args.quick else args.runs
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    bad, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            out = os.path.join(tmp, f"run{i}.json")
            r = subprocess.run(
                [sys.executable, *COMMAND, "--out", out],
                capture_output=True,
                text=True,
                timeout=300,
                env=env,
            )
            aborted = "terminate called" in r.stderr
            if r.returncode != 0 or aborted:
                bad.append(i)
                print(
                    f"run {i}: exit {r.returncode}{', aborted' if aborted else ''}\n"
                    f"{r.stderr[-2000:]}",
                    flush=True,
                )
    print(f"{runs} runs in {time.perf_counter() - t0:.0f} s; failed runs: {bad or 'none'}")
    print(f"torchrun exit aborts: {len(bad)} of {runs} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
