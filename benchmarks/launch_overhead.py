"""How long it takes to start 2 ranks that each do one all-reduce: labkit vs mp.spawn (vs
Accelerate).

    python benchmarks/launch_overhead.py [--repeats 5] [--cold 3] [--quick] [--json PATH]

labkit's first launch is timed in a fresh child interpreter, so its forkserver really starts cold
(as in a new kernel), ``--cold`` times over (the median is reported); the last child then stays
alive and times every later launch when the parent asks, so the later launches interleave with
``torch.multiprocessing.spawn`` (and Accelerate's ``notebook_launcher``, if installed) round by
round and drift on a busy machine hits all of them.
Every number is end to end as the caller sees it: start processes, rendezvous, init the gloo
group, one all_reduce, destroy, join. Medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone

WORLD_SIZE = 2
# Goals: first launch in a kernel <= 1.5 s; a warm launch at most half as long as Accelerate's
# notebook_launcher measured in the same run (without Accelerate that goal is not judged: a
# baseline from another run on another day is not a side-by-side).
FIRST_LAUNCH_GOAL_S = 1.5
WARM_RATIO_GOAL = 0.5


# ---- what every rank does ----------------------------------------------------------------------


def _labkit_rank(ctx) -> float:
    """labkit side: the group is already up (launch() did it); one all-reduce."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def _init_allreduce_destroy(rank: int, world_size: int, init_method: str) -> None:
    """What a hand-written rank does: init the gloo group on loopback, one all-reduce, destroy."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
    dist.destroy_process_group()


def _spawn_rank(rank: int, world_size: int, port: int) -> None:
    _init_allreduce_destroy(rank, world_size, f"tcp://127.0.0.1:{port}")


def _accelerate_rank() -> None:
    # notebook_launcher sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT for each forked rank.
    _init_allreduce_destroy(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://")


# ---- the contenders, as the caller times them -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_mp_spawn() -> float:
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.spawn(_spawn_rank, args=(WORLD_SIZE, _free_port()), nprocs=WORLD_SIZE, join=True)
    return time.perf_counter() - t0


def time_notebook_launcher() -> float:
    from accelerate import notebook_launcher

    t0 = time.perf_counter()
    notebook_launcher(
        _accelerate_rank, args=(), num_processes=WORLD_SIZE, use_port=str(_free_port())
    )
    return time.perf_counter() - t0


def accelerate_available() -> bool:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        return False
    return True


class LabkitChild:
    """A fresh interpreter that times ``labkit.launch`` each time the parent writes a line."""

    def __init__(self):
        # LABKIT_PREWARM=1: start the forkserver at import, as `import labkit` does in a kernel
        env = {**os.environ, "LABKIT_PREWARM": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--labkit-child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.import_s = self._read()["import_s"]

    def launch(self) -> float:
        self.proc.stdin.write("launch\n")
        self.proc.stdin.flush()
        return self._read()["launch_s"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"labkit child exited with code {self.proc.wait()} (see stderr)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _child_main() -> None:
    """Runs in the fresh interpreter: import labkit (as a notebook's first cell), then serve."""
    t0 = time.perf_counter()
    import labkit

    print(json.dumps({"import_s": time.perf_counter() - t0}), flush=True)
    for _ in sys.stdin:
        t0 = time.perf_counter()
        out = labkit.launch(_labkit_rank, WORLD_SIZE, device="cpu", timeout_s=120)
        elapsed = time.perf_counter() - t0
        assert out == [float(WORLD_SIZE)] * WORLD_SIZE, out
        print(json.dumps({"launch_s": elapsed}), flush=True)


# ---- run, summarise, print ----------------------------------------------------------------------


def measure(repeats: int, with_accelerate: bool, cold: int = 3) -> dict:
    """``cold`` first launches, each in its own fresh interpreter (one sample each, and the
    machine's drift moves it by a few tenths of a second), then ``repeats`` interleaved rounds
    in the last of them; every sample in seconds."""
    samples = {"labkit first launch": [], "labkit later launch": [], "mp.spawn": []}
    if with_accelerate:
        samples["accelerate notebook_launcher"] = []
    imports = []
    for _ in range(cold - 1):
        child = LabkitChild()
        imports.append(child.import_s)
        samples["labkit first launch"].append(child.launch())
        child.close()
    child = LabkitChild()
    imports.append(child.import_s)
    try:
        samples["labkit first launch"].append(child.launch())
        for i in range(repeats):
            # Rotate who goes first, so none of them always runs right after the heavy spawn.
            order = ["labkit later launch", "mp.spawn"] + (
                ["accelerate notebook_launcher"] if with_accelerate else []
            )
            order = order[i % len(order) :] + order[: i % len(order)]
            for name in order:
                if name == "labkit later launch":
                    samples[name].append(child.launch())
                elif name == "mp.spawn":
                    samples[name].append(time_mp_spawn())
                else:
                    samples[name].append(time_notebook_launcher())
    finally:
        child.close()
    return {"labkit_import_s": statistics.median(imports), "samples": samples}


def summarise(measured: dict, with_accelerate: bool) -> dict:
    samples = measured["samples"]
    medians = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {
        "labkit first launch / mp.spawn": medians["labkit first launch"] / medians["mp.spawn"],
        "labkit later launch / mp.spawn": medians["labkit later launch"] / medians["mp.spawn"],
    }
    goals = {
        f"first launch <= {FIRST_LAUNCH_GOAL_S:g} s": medians["labkit first launch"]
        <= FIRST_LAUNCH_GOAL_S
    }
    if with_accelerate:
        reference = medians["accelerate notebook_launcher"]
        goals[f"later launch <= {WARM_RATIO_GOAL:g} x notebook_launcher ({reference:.3f} s)"] = (
            medians["labkit later launch"] <= WARM_RATIO_GOAL * reference
        )
        ratios["labkit/notebook_launcher warm launch ratio"] = (
            medians["labkit later launch"] / reference
        )
    return {"medians_s": medians, "ratios": ratios, "goals": goals}


def print_report(measured: dict, summary: dict, with_accelerate: bool) -> None:
    print(
        f"2 ranks, each: init gloo group on loopback + one all_reduce + destroy; "
        f"{os.cpu_count()} CPU cores; torch {_torch_version()}"
    )
    print(
        f"labkit import in the fresh interpreter (not counted below): "
        f"{measured['labkit_import_s']:.2f} s"
    )
    print(f"{'launcher':<32}{'runs':>6}{'median s':>11}{'min s':>9}{'max s':>9}")
    for name, values in measured["samples"].items():
        print(
            f"{name:<32}{len(values):>6}{statistics.median(values):>11.3f}"
            f"{min(values):>9.3f}{max(values):>9.3f}"
        )
    if not with_accelerate:
        print(f"{'accelerate notebook_launcher':<32}  not installed, skipped")
    for name, value in summary["ratios"].items():
        print(f"{name}: {value:.2f}x")
    for goal, met in summary["goals"].items():
        print(f"goal {goal}: {'met' if met else 'NOT met'}")
    ratio = summary["ratios"].get("labkit/notebook_launcher warm launch ratio")
    print(
        f"labkit/notebook_launcher warm launch ratio: {ratio:.2f}"
        if ratio is not None
        else "labkit/notebook_launcher warm launch ratio: not measured (Accelerate is not "
        "installed: `make bench` installs it for this side-by-side)"
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--cold",
        type=int,
        default=3,
        help="first launches, each in a fresh interpreter (default 3)",
    )
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 cold: a smoke run")
    parser.add_argument("--json", metavar="PATH", help="also write samples and medians here")
    parser.add_argument("--labkit-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.labkit_child:
        _child_main()
        return 0
    repeats, cold = (2, 1) if args.quick else (args.repeats, args.cold)
    if repeats < 1 or cold < 1:
        parser.error("--repeats and --cold must be at least 1")
    with_accelerate = accelerate_available()
    measured = measure(repeats, with_accelerate, cold)
    summary = summarise(measured, with_accelerate)
    print_report(measured, summary, with_accelerate)
    if args.json:
        out = {
            "benchmark": "launch_overhead",
            "world_size": WORLD_SIZE,
            "repeats": repeats,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "cpu_cores": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": _torch_version(),
            },
            "accelerate": with_accelerate,
            **measured,
            **summary,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
