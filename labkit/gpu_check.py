"""``python -m labkit.gpu_check --out out``: what the README promises of GPUs, run on them.

One command (``make gpu-check``) runs every strategy on CUDA ranks over NCCL at each world size the
GPUs allow, the equivalence check of every data-parallel strategy, CUDA-event timing, the CUDA
allocator's peak, ``dataparallel`` on every GPU, DDP's communication hooks with several buckets,
bf16 and fp16 autocast, and FSDP with bf16. Every row is a real labkit run through the library
(``experiment.run``, ``equivalence.check``, ``launch``), judged against something measured apart
from it, and ends ``pass``, ``fail`` (with the error's last line; the whole traceback is in the
JSON) or ``skipped`` (with why: "needs 2 GPUs, 1 present"). The table goes to ``OUT/gpu.json`` and
``OUT/gpu.txt``, rewritten after each row so a run cut short keeps what it did; the exit status is 1
when a row failed, else 0, and the last line counts each verdict.

Without a GPU every CUDA row is skipped, saying so (style habit 11: skip loudly). ``--cpu`` runs
the same rows on CPU ranks over gloo (up to 2 ranks, 4 on 8+ cores): the check of the check
itself, and on a GPU machine ``--also-cpu`` adds that pass after the CUDA one.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from . import registry, wire
from .config import RunConfig
from .env import cpu_cores, default_backend
from .launch import LaunchTimeout, RankError

VERDICTS = ("pass", "fail", "skipped")
MiB = 2**20

# Small and short: the whole check stays within minutes on one GPU. warmup=2 because PowerSGD
# compresses from the third step on; timeout_s bounds a hang to one row's worth of time.
BASE = RunConfig(steps=3, warmup=2, global_batch=64, width=256, depth=4, timeout_s=120.0)
# DDP's hooks: a ~3 MB model in 0.25 MB buckets, so every step sends several buckets
HOOKS = dict(strategy="ddp", width=512, bucket_cap_mb=0.25)


class Skip(Exception):
    """A row that cannot run here; its message says why."""


class Failed(AssertionError):
    """A row whose run finished but whose result is not what it must be."""


def expect(ok: bool, message: str) -> None:
    """Fail the row with ``message`` unless ``ok`` (an ``assert`` that ``python -O`` keeps)."""
    if not ok:
        raise Failed(message)


@dataclass(frozen=True)
class Target:
    """Where one pass of the check runs: CUDA ranks over NCCL, or CPU ranks over gloo."""

    device: str  # "cuda" or "cpu"
    backend: str
    units: int  # GPUs present, or the CPU ranks this pass runs at most
    absent: str | None = None  # why nothing can run here (every row is skipped with it)

    @property
    def largest(self) -> int:
        """The largest world size this pass runs (1 where nothing runs, so rows still list)."""
        return max(1, self.units)

    def need(self, world_size: int) -> None:
        """Skip the row unless this target can give ``world_size`` ranks (or devices) one each."""
        if self.absent:
            raise Skip(self.absent)
        if world_size > self.units:
            if self.device == "cuda":
                raise Skip(f"needs {world_size} GPUs, {self.units} present")
            raise Skip(
                f"needs {world_size} CPU ranks; this pass runs up to {self.units} "
                f"({cpu_cores()} cores; 4 ranks from 8 cores)"
            )


def cuda_target() -> Target:
    """Every GPU torch sees, one rank each, over the backend labkit picks for them (NCCL)."""
    if torch.version.cuda is None:
        return Target("cuda", "nccl", 0, "no GPU: this torch is a CPU-only build")
    if not torch.cuda.is_available():
        return Target("cuda", "nccl", 0, "no GPU: torch.cuda.is_available() is False")
    return Target("cuda", default_backend("cuda"), torch.cuda.device_count())


def cpu_target() -> Target:
    """CPU ranks over gloo: 2 of them, or 4 where 8+ cores give each rank two."""
    return Target("cpu", "gloo", 4 if cpu_cores() >= 8 else 2)


@dataclass
class Row:
    name: str
    world_size: int
    device: str
    backend: str
    verdict: str  # one of VERDICTS
    seconds: float  # this row's own wall time, runs and judging included
    detail: str  # what was measured (pass), the error's last line (fail), or why (skipped)
    error: str = ""  # fail: the whole traceback (JSON only)


@dataclass(frozen=True)
class Check:
    """One row: ``fn(target, world_size)`` returns the detail, raises ``Skip`` or fails."""

    name: str
    world_size: int
    fn: Callable[[Target, int], str]


# ---- the runs --------------------------------------------------------------------------------


def config(target: Target, strategy: str, world_size: int, **changes) -> RunConfig:
    """``BASE`` for ``strategy`` at ``world_size`` on ``target``: a pipeline one stage per rank
    (enough layers for them), the composed strategies 2-wide (tp=2, 2 stages), the transformer
    where a strategy splits its sequence or its experts (two per rank), and a global batch every
    rank that takes a slice of it divides (async_ps: its workers, not the server)."""
    s = registry.get(strategy)
    kind = s.kind
    slices = world_size - 1 if s.server else world_size
    layout: dict = dict(global_batch=math.lcm(BASE.global_batch, max(1, slices)))
    if kind == "pipeline":
        layout.update(stages=world_size, depth=max(BASE.depth, world_size - 1))
    elif kind == "tensor_parallel":  # every layer split evenly over the ranks
        layout.update(width=-(-BASE.width // world_size) * world_size)
    elif s.schedule is not None:  # data x pipeline
        layout.update(stages=2)
    elif "tp" in s.knobs:  # data x tensor
        layout.update(tp=2)
    if kind in ("context_parallel", "expert_parallel") or s.mesh is not None:
        layout.update(model="transformer")  # a sequence to split, feed-forwards to make experts
    if kind == "expert_parallel":  # two experts per rank
        layout.update(experts=2 * world_size)
    return BASE.replace(
        strategy=strategy,
        world_size=world_size,
        device=target.device,
        backend=target.backend,
        **{**layout, **changes},
    )


def min_world_size(strategy: str) -> int:
    """The fewest ranks a strategy means anything on: a pipeline, a tensor split or a composed
    mesh needs two, a parameter server a server and a worker."""
    s = registry.get(strategy)
    return 2 if s.kind in ("pipeline", "tensor_parallel", "composed") or s.server else 1


@cache
def run(cfg: RunConfig):
    """``labkit.experiment.run``, once per config per process: rows that compare against the
    same reference (fp32, no hook) share its run."""
    from .experiment import run as run_config

    return run_config(cfg)


def measured(res, rank: int = 0):
    """One rank's measured steps (warm-up steps are not recorded)."""
    df = res.records
    return df[df["rank"] == rank]


def trained(res, target: Target) -> str:
    """Check a run's records: every rank reported, on ``target``'s device, a finite loss.
    Returns the loss and the median step (the slowest rank's)."""
    df, cfg = res.records, res.cfg
    expect(not df.empty, "the run returned no records")
    ranks = sorted(df["rank"].unique())
    expect(ranks == list(range(cfg.ranks)), f"records from ranks {ranks}, not 0..{cfg.ranks - 1}")
    devices = sorted(set(df["device"].astype(str)))
    expect(
        all(d.split(":")[0] == target.device for d in devices),
        f"ran on {', '.join(devices)}, not {target.device}",
    )
    loss = df.groupby("step")["loss"].first()
    expect(bool(loss.notna().all()) and all(map(math.isfinite, loss)), f"loss {list(loss)}")
    step_ms = df.groupby("step")["step_s"].max().median() * 1e3
    first, last = loss.iloc[0], loss.iloc[-1]
    return f"loss {first:.4f} -> {last:.4f}, step {step_ms:.1f} ms (median, slowest rank)"


def strategy_row(strategy: str) -> Callable[[Target, int], str]:
    def fn(target: Target, world_size: int) -> str:
        if registry.get(strategy).shared_memory and target.device == "cuda":
            raise Skip(f"{strategy} shares one model in host memory between processes: CPU only")
        if registry.get(strategy).kind == "composed" and world_size % 2:
            raise Skip(f"{strategy} runs groups of 2 ranks: needs an even world size")
        return trained(run(config(target, strategy, world_size)), target)

    return fn


def equivalence_row(strategy: str) -> Callable[[Target, int], str]:
    def fn(target: Target, world_size: int) -> str:
        from .labs.equivalence import check

        table = check(config(target, "ddp", world_size), [strategy], world_size, steps=3)
        row = table.iloc[0]
        diff, tol = float(row["max_abs_diff"]), float(row["tol"])
        how = ", ".join(str(row[c]) for c in ("compared", "compared_in") if c in row)
        said = f"max diff {diff:.2g} (tol {tol:g}, {how})"
        expect(bool(row["ok"]), f"{said}: {row['why']}")
        return said + (f"; {row['adjustments']}" if row["adjustments"] != "none" else "")

    return fn


def per_step(res, column: str) -> float:
    """Rank 0's median per measured step of ``column``."""
    return float(measured(res)[column].median())


def counting() -> None:
    """Skip a row that reads bytes unless ``labkit.wire`` can count them on this torch."""
    if not wire.COUNTING:
        raise Skip(f"labkit.wire cannot count bytes: {wire.WHY_NOT}")


def buckets_row(target: Target, world_size: int) -> str:
    """DDP without a hook in small buckets: several all-reduces per step (the hooks' baseline)."""
    counting()
    res = run(config(target, world_size=world_size, **HOOKS))
    trained(res, target)
    calls = per_step(res, "comm_calls")
    expect(calls >= 2, f"{calls:g} all-reduce per step: one bucket, not several")
    mb = per_step(res, "comm_payload_bytes") / 1e6
    return f"{calls:g} all-reduces per step ({mb:.2f} MB, bucket_cap_mb {HOOKS['bucket_cap_mb']})"


def hook_row(hook: str) -> Callable[[Target, int], str]:
    """A DDP hook against the same run without one: bytes handed to the process group (and on
    the wire, with peers) half for fp16/bf16, far fewer for PowerSGD, counted by labkit.wire."""

    def fn(target: Target, world_size: int) -> str:
        counting()
        plain = run(config(target, world_size=world_size, **HOOKS))
        res = run(config(target, world_size=world_size, comm_hook=hook, **HOOKS))
        trained(res, target)
        columns = ["comm_payload_bytes"] + (["comm_bytes"] if world_size > 1 else [])
        for c in columns:  # a ratio of nothing to nothing proves nothing
            got = {"no hook": per_step(plain, c), hook: per_step(res, c)}
            expect(min(got.values()) > 0, f"{c} per step: {got}: nothing counted")
        ratios = {c: per_step(res, c) / per_step(plain, c) for c in columns}
        said = ", ".join(f"{c} {r:.3f}x no hook's" for c, r in ratios.items())
        for c, r in ratios.items():
            if hook == "powersgd":
                expect(r < 0.5, f"PowerSGD {c} is {r:.3f}x no hook's: not compressed")
            else:
                expect(abs(r - 0.5) <= 0.01, f"{hook} {c} is {r:.3f}x no hook's, not 0.5x")
        one = [n for n in res.notes if "one bucket" in n]
        expect(not one or target.backend == "gloo", f"forced to one bucket on {target.backend}")
        return said + (" (one bucket on gloo, as labkit says)" if one else "")

    return fn


def precision_row(precision: str) -> Callable[[Target, int], str]:
    """Autocast against the same run in fp32: activations counted smaller, the loss close."""

    def fn(target: Target, world_size: int) -> str:
        full = run(config(target, "ddp", world_size))
        res = run(config(target, "ddp", world_size, precision=precision))
        trained(res, target)
        fp32 = per_step(full, "mem_activations_bytes")
        expect(fp32 > 0, "fp32's activations counted 0 bytes: nothing to compare with")
        ratio = per_step(res, "mem_activations_bytes") / fp32
        expect(ratio < 0.75, f"activations {ratio:.2f}x fp32's: autocast did not take")
        loss, ref = (float(r.records["loss"].iloc[-1]) for r in (res, full))
        expect(abs(loss - ref) <= 0.05 * abs(ref), f"final loss {loss:.4f}, fp32's {ref:.4f}")
        said = f"activations {ratio:.2f}x fp32's, final loss {loss:.4f} (fp32 {ref:.4f})"
        if precision == "fp16":
            scale = measured(res)["amp_scale"]
            expect(bool((scale > 0).all()), f"GradScaler scale {list(scale)}")
            skipped = int(measured(res)["amp_skipped"].sum())
            said += f", scale {scale.iloc[-1]:g}, {skipped} step(s) skipped"
        return said

    return fn


def fsdp_bf16_row(target: Target, world_size: int) -> str:
    """The README's memory snippet: fsdp, bf16, activation checkpointing."""
    cfg = config(target, "fsdp", world_size, precision="bf16", activation_checkpointing=True)
    return trained(run(cfg), target)


def dataparallel_row(target: Target, world_size: int) -> str:
    """nn.DataParallel over every GPU: no note that it fell back to fewer devices."""
    if target.device != "cuda":
        raise Skip("DataParallel splits a batch over GPUs; on CPU it runs as single")
    res = run(config(target, "dataparallel", world_size))
    said = trained(res, target)
    fell_back = [n for n in res.notes if "DataParallel" in n]
    expect(not fell_back, fell_back[0] if fell_back else "")
    return f"{world_size} GPU(s); {said}"


def peak_row(target: Target, world_size: int) -> str:
    """``peak_mem_bytes`` (the CUDA allocator's peak on a GPU, RSS on CPU) on every rank: above
    the parameters, gradients and optimizer state the memory meter counted on that rank."""
    res = run(config(target, "ddp", world_size, width=1024))
    trained(res, target)
    last = res.records.groupby("rank").last()
    counted = last[["mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes"]].sum(axis=1)
    peak = last["peak_mem_bytes"]
    expect(bool((counted > 0).all()), f"counted {list(counted)} bytes of model state")
    low = [int(r) for r in last.index if not peak[r] >= counted[r]]
    expect(not low, f"rank(s) {low}: peak {list(peak)} below counted {list(counted)}")
    kind = "CUDA allocator's peak" if target.device == "cuda" else "RSS high-water mark"
    return (
        f"{kind} {peak.min() / MiB:.1f}-{peak.max() / MiB:.1f} MiB per rank >= "
        f"{counted.max() / MiB:.1f} MiB counted (params + grads + optimizer)"
    )


def _spin(cycles: int) -> None:
    """One GPU kernel that spins ``cycles`` clock cycles: torch's private ``torch.cuda._sleep``
    (written for torch 2.14)."""
    torch.cuda._sleep(cycles)


def sleep_under_probe(ctx, seconds: float = 0.05) -> dict:
    """On a rank: one GPU kernel of ``seconds``, timed by a StepProbe (CUDA events), by the wall
    clock around it synchronised, and by the wall clock without synchronising (the launch)."""
    from .rank.probes import StepProbe

    dev = ctx.device
    _spin(1000)  # first launch pays for the context
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    _spin(10**7)
    torch.cuda.synchronize(dev)
    cycles = int(10**7 * seconds / (time.perf_counter() - t0))
    t0 = time.perf_counter()
    _spin(cycles)
    torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    probe = StepProbe(dev)
    probe.start()
    t0 = time.perf_counter()
    _spin(cycles)
    launch_s = time.perf_counter() - t0
    probe.mark("forward")
    rec = probe.finish()
    return {"wall_s": wall, "launch_s": launch_s, "forward_s": rec["forward_s"]}


def cuda_events_row(target: Target, world_size: int) -> str:
    """A training run's records name a CUDA device (the column that makes StepProbe record
    CUDA events), and such a probe times a GPU kernel's work, not its launch."""
    if target.device != "cuda":
        raise Skip("CUDA events need a GPU; on CPU each phase boundary is a perf_counter read")
    from .launch import launch

    res = run(config(target, "ddp", world_size))
    trained(res, target)
    got = launch(sleep_under_probe, 1, device="cuda", timeout_s=BASE.timeout_s)[0]
    wall, probe, cpu = got["wall_s"], got["forward_s"], got["launch_s"]
    said = (
        f"a {wall * 1e3:.1f} ms kernel (synchronised wall clock): the probe read "
        f"{probe * 1e3:.1f} ms, an unsynchronised clock {cpu * 1e3:.2f} ms"
    )
    expect(abs(probe - wall) <= 0.2 * wall, said)
    expect(cpu < 0.25 * wall, f"{said}: the launch waited for the kernel")
    return said + f"; records on {', '.join(sorted(set(res.records['device'])))}"


# ---- the table -------------------------------------------------------------------------------


def world_sizes(units: int) -> list[int]:
    """1, 2, 4, the powers of two up to ``units`` and ``units`` itself: what a machine with
    ``units`` GPUs runs, and the 2 and 4 a smaller one lists as skipped."""
    sizes, w = {1, 2, 4, max(units, 1)}, 1
    while w <= units:
        sizes.add(w)
        w *= 2
    return sorted(sizes)


def checks(target: Target) -> list[Check]:
    """Every row of one pass, in order: strategies, equivalence, hooks, precision, the rest."""
    top = target.largest
    rows = [
        Check(f"run {name}", w, strategy_row(name))
        for name in registry.STRATEGIES
        for w in ([1] if registry.get(name).reference else world_sizes(target.units))
        if w >= min_world_size(name)
    ]
    rows += [Check(f"check {n}", top, equivalence_row(n)) for n in registry.names("data_parallel")]
    rows += [Check("cuda events", 1, cuda_events_row), Check("peak memory", top, peak_row)]
    rows += [Check("dataparallel on every GPU", top, dataparallel_row)]
    rows += [Check("ddp buckets", top, buckets_row)]
    rows += [Check(f"comm hook {h}", top, hook_row(h)) for h in ("fp16", "bf16", "powersgd")]
    rows += [Check(f"precision {p}", top, precision_row(p)) for p in ("bf16", "fp16")]
    rows.append(Check("fsdp bf16 + checkpointing", max(2, top), fsdp_bf16_row))
    return rows


def last_line(err: BaseException) -> str:
    """The line that says what went wrong: a rank's exception, not the launcher's preamble."""
    if isinstance(err, RankError):
        text = (err.traceback or "").strip() or (err.stderr_tail or "").strip()
        lines = text.splitlines() or [f"exit code {err.exitcode}"]
        return f"rank {err.rank}: {lines[-1].strip()}"
    if isinstance(err, LaunchTimeout):
        return str(err).splitlines()[0]
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[-1].strip()}" if lines else type(err).__name__


def run_checks(
    todo: list[Check],
    target: Target,
    *,
    deadline: float | None = None,
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """Run each check in turn; a row's error never stops the ones after it."""
    rows = []
    for c in todo:
        t0, error = time.perf_counter(), ""
        try:
            if deadline is not None and t0 > deadline:
                raise Skip("the time budget (--budget-s) was spent")
            target.need(c.world_size)
            verdict, detail = "pass", c.fn(target, c.world_size)
        except Skip as e:
            verdict, detail = "skipped", str(e)
        except Exception as e:  # any error is this row's verdict, never the end of the check
            verdict, detail, error = "fail", last_line(e), traceback.format_exc()
        row = Row(
            c.name,
            c.world_size,
            target.device,
            target.backend,
            verdict,
            time.perf_counter() - t0,
            detail,
            error,
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def counts(rows: list[Row]) -> dict[str, int]:
    return {v: sum(r.verdict == v for r in rows) for v in VERDICTS}


def summary(rows: list[Row]) -> str:
    """The last line: "N passed, M failed, K skipped"."""
    n = counts(rows)
    return f"{n['pass']} passed, {n['fail']} failed, {n['skipped']} skipped"


def machine() -> dict:
    """What the table ran on."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = [torch.cuda.get_device_name(i) for i in range(gpus)]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": names,
        "cpu_cores": cpu_cores(),
    }


def text_table(rows: list[Row], meta: dict) -> str:
    gpus = ", ".join(meta["gpus"]) or "none"
    head = (
        f"labkit gpu check: python {meta['python']}, torch {meta['torch']} "
        f"(CUDA {meta['cuda'] or 'none'}), GPUs: {gpus}, {meta['cpu_cores']} CPU cores"
    )
    cols = ("name", "ws", "device", "backend", "verdict", "seconds", "detail")
    cells = [
        (r.name, str(r.world_size), r.device, r.backend, r.verdict, f"{r.seconds:.1f}", r.detail)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [cols, *cells]) for i in range(len(cols) - 1)]
    lines = [head]
    for c in [cols, *cells]:
        fixed = [c[i].rjust(w) if i in (1, 5) else c[i].ljust(w) for i, w in enumerate(widths)]
        lines.append("  ".join([*fixed, c[-1]]))
    return "\n".join([*lines, summary(rows)]) + "\n"


def write(out: Path, rows: list[Row], meta: dict) -> None:
    """``gpu.json`` (every row, tracebacks included) and ``gpu.txt`` (the table) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "rows": [asdict(r) for r in rows], "counts": counts(rows)}
    (out / "gpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "gpu.txt").write_text(text_table(rows, meta))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m labkit.gpu_check",
        description="Run every GPU promise of the README on this machine's GPUs; write a table "
        "of verdicts to OUT/gpu.json and OUT/gpu.txt.",
    )
    p.add_argument("--out", default="out", help="folder for gpu.json and gpu.txt (default out)")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--cpu", action="store_true", help="only the CPU pass: the same rows on gloo ranks"
    )
    where.add_argument(
        "--also-cpu", action="store_true", help="after the CUDA pass, the same rows on gloo ranks"
    )
    p.add_argument(
        "--only",
        default="",
        help="comma-separated parts of row names to run (e.g. 'run ddp,comm hook'); the rest "
        "are left out of the table",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="seconds the check may take: rows not started by then are skipped, saying so",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    targets = [cpu_target()] if args.cpu else [cuda_target()]
    if args.also_cpu:
        targets.append(cpu_target())
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s
    out, meta, rows = Path(args.out), machine(), []

    def done(row: Row) -> None:
        rows.append(row)
        print(f"{row.verdict:>7}  {row.name} @{row.world_size} {row.device}: {row.detail}")
        sys.stdout.flush()
        write(out, rows, meta)

    for target in targets:
        todo = [c for c in checks(target) if not wanted or any(w in c.name for w in wanted)]
        run_checks(todo, target, deadline=deadline, on_row=done)
    write(out, rows, meta)
    print(text_table(rows, meta), end="")
    return 1 if counts(rows)["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
