"""bf16 autocast against fp32, and activation checkpointing against none: step time and memory.

    python benchmarks/memory_precision.py [--rounds 3] [--width 1024] [--quick] [--json PATH]

One process (``single`` on all cores), an MLP of ``--width`` x ``--depth`` at ``--global-batch``.
Each round runs fp32 then bf16 back to back (interleaved, so a busy machine slows both alike);
the median over rounds of each run's median step time is compared, and the counted bytes
(``labkit.labs.memory``: activations, and all five categories) of the two. A second pair
compares the CNN with and without activation checkpointing: backward time and activation bytes.

On CPU, bf16 pays off only where the cores have bf16 matrix instructions (AVX512-BF16, which
this project's machine has, or AMX); elsewhere the casts cost more than the matmuls gain. The memory
ratios hold anywhere; the time ratio is this machine's.
"""

from __future__ import annotations

import argparse
import json
import statistics

from labkit import RunConfig, experiment
from labkit.records import BUSY_SHARE


def pair(base: RunConfig, a: dict, b: dict, rounds: int) -> dict:
    times = {"a": [], "b": []}
    back = {"a": [], "b": []}
    fwd = {"a": [], "b": []}
    recs = {}
    for _ in range(rounds):
        for key, knobs in (("a", a), ("b", b)):
            rec = experiment.run(base.replace(**knobs)).records
            times[key].append(float(rec["step_s"].median()))
            back[key].append(float(rec["backward_s"].median()))
            fwd[key].append(float(rec["forward_s"].median()))
            recs[key] = rec
    cols = [c for c in recs["a"] if c.startswith("mem_")]
    busy = any(float(r["compute_cpu_share"].min()) < BUSY_SHARE for r in recs.values())
    return {
        "step_ratio": statistics.median(times["b"]) / statistics.median(times["a"]),
        "backward_ratio": statistics.median(back["b"]) / statistics.median(back["a"]),
        # recomputation replays the forward inside backward: backward + forward, predicted
        "backward_ratio_predicted": (statistics.median(back["a"]) + statistics.median(fwd["a"]))
        / statistics.median(back["a"]),
        "activation_ratio": float(
            recs["b"]["mem_activations_bytes"].max() / recs["a"]["mem_activations_bytes"].max()
        ),
        "counted_ratio": float(
            recs["b"][cols].sum(axis=1).max() / recs["a"][cols].sum(axis=1).max()
        ),
        "high_water_ratio": float(
            recs["b"]["peak_mem_bytes"].max() / recs["a"]["peak_mem_bytes"].max()
        ),
        "step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "busy": busy,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true", help="a small model, 1 round (a smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.global_batch, args.width, args.steps, args.rounds = 64, 128, 3, 1
    base = RunConfig(
        strategy="single",
        world_size=1,
        global_batch=args.global_batch,
        width=args.width,
        depth=args.depth,
        steps=args.steps,
        warmup=2,
        dataset_size=max(4096, 4 * args.global_batch),
    )
    prec = pair(base, {"precision": "fp32"}, {"precision": "bf16"}, args.rounds)
    cnn = base.replace(
        model="cnn", width=min(args.width, 256), global_batch=min(args.global_batch, 128)
    )
    ckpt = pair(
        cnn, {"activation_checkpointing": False}, {"activation_checkpointing": True}, args.rounds
    )
    print(
        f"mlp {args.width}x{args.depth}, batch {args.global_batch}, {args.rounds} interleaved "
        f"round(s){' (machine busy: compare ratios only)' if prec['busy'] or ckpt['busy'] else ''}"
    )
    print(f"fp32 {prec['step_ms']['a']:.1f} ms/step, bf16 {prec['step_ms']['b']:.1f} ms/step")
    print(f"bf16/fp32 activation bytes ratio: {prec['activation_ratio']:.2f}")
    print(f"bf16/fp32 counted bytes ratio (all categories): {prec['counted_ratio']:.2f}")
    print(
        f"bf16/fp32 process high-water ratio (RSS, each run its own processes): "
        f"{prec['high_water_ratio']:.2f}"
    )
    print(f"checkpointed/plain cnn activation bytes ratio: {ckpt['activation_ratio']:.2f}")
    print(
        f"checkpointed/plain cnn backward time ratio: {ckpt['backward_ratio']:.2f} "
        f"(predicted from the plain run's forward + backward: "
        f"{ckpt['backward_ratio_predicted']:.2f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"precision": prec, "checkpoint": ckpt, "args": vars(args)}, f, indent=1)
    print(f"bf16/fp32 step-time ratio: {prec['step_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
