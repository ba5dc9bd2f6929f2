"""The mechanisms the lessons draw before they measure them, each run for real.

Every picture of the course is made from what the code did, not drawn by hand:

* ``collective(op, n)``: one collective on ``n`` gloo ranks (threads of this process,
  ``labkit.dist.on_threads``). Every chunk a rank starts with is tagged with who owns it
  (rank ``r``'s chunk ``c`` is the unit vector ``r * n + c``), so after the operation each
  chunk says which chunks were summed or copied into it: who holds what, before and after.
* ``ring_all_reduce(x, group)``: the ring all-reduce written out with sends and receives
  (n - 1 steps of reduce-scatter, then n - 1 of all-gather), and ``ring(n)``, which runs it on
  tagged chunks and keeps every step: what each rank holds and what it sent.
* ``shards(strategy, n)``: what each rank keeps of every parameter, gradient and optimizer
  state under the strategy's own sharding code (``zero1.shard_optimizer``, ``fsdp.shard``,
  ``hsdp.shard``), run once per rank on torch's fake process group (``labkit.dist.fake_rank``).
* ``pipeline_order(schedule, P, M)``: the order the pipeline executor runs
  (``labkit.pipeline_schedules``), laid out in unit time (a forward 1, a backward 2) by the
  simulator the predictions use.
* ``ddp_buckets(cfg)``: a real DDP run's step per rank, its phases beside each bucket's
  all-reduce in flight: the buckets leaving while backward goes on.

``labkit.plots.mechanisms`` draws each of them.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist

from ..config import RunConfig
from ..dist import fake_rank, on_threads
from ..models import make_model
from ..pipeline_schedules import SCHEDULES
from ..predict.schedule import ScheduleCosts, simulate
from ..rank.probes import PHASES
from ..registry import STRATEGIES

COLLECTIVES = (
    "broadcast",
    "reduce",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "scatter",
    "gather",
)
ROOT = 0  # the root of broadcast, reduce, scatter and gather
MAX_RANKS = 8  # a picture, not a benchmark: 8 ranks of 8 chunks stay legible


def owner(r: int) -> str:
    """Rank ``r``'s letter: A, B, C, ... (a chunk is its owner's letter and its index)."""
    return string.ascii_uppercase[r]


def label(tag: torch.Tensor, n: int) -> str:
    """The name of a tagged chunk: "A0" (rank 0's chunk 0), "A1+C1" (a partial sum), "Σ1"
    (chunk 1 summed over every rank), "·" (nothing: an empty buffer)."""
    parts = [(i // n, i % n) for i in torch.nonzero(tag).flatten().tolist()]
    if not parts:
        return "·"
    if len(parts) == n and len({c for _, c in parts}) == 1 and n > 1:
        return f"Σ{parts[0][1]}"
    return "+".join(f"{owner(r)}{c}" for r, c in parts)


def _tags(rank: int, n: int, chunks) -> torch.Tensor:
    """Rank ``rank``'s chunks ``chunks`` as rows of unit vectors (row c: the vector of
    (rank, c)); float64, so sums of up to ``n`` ones are exact."""
    rows = torch.zeros(len(chunks), n * n, dtype=torch.float64)
    for i, c in enumerate(chunks):
        rows[i, rank * n + c] = 1.0
    return rows


def _check_n(n: int) -> None:
    if not 2 <= n <= MAX_RANKS:
        raise ValueError(f"world size must be 2..{MAX_RANKS} for a picture, got {n}")


@dataclass(frozen=True)
class Collective:
    """Who holds what before and after one collective: ``before[r]`` and ``after[r]`` are
    rank r's chunk labels (``label``), ``sums[r]`` its chunks' tags after the operation
    (rows of unit-vector sums, to check), ``note`` what a reader must know about the picture."""

    op: str
    world_size: int
    before: list[list[str]]
    after: list[list[str]]
    sums: list[torch.Tensor]
    note: str = ""


def _run_collective(op: str, group) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tagged chunks before ``op`` and the buffer it holds after, on ``group``."""
    n, r = group.size(), group.rank()
    if op in ("all_reduce", "reduce", "reduce_scatter", "all_to_all"):
        x = _tags(r, n, range(n))  # n chunks of its own
    elif op in ("all_gather", "gather"):
        x = _tags(r, n, [r])  # one piece each: rank r's piece r
    else:  # broadcast, scatter: only the root has data; the others a buffer
        x = _tags(r, n, range(n)) if r == ROOT else torch.zeros(n, n * n, dtype=torch.float64)
    before = x.clone()
    if op == "all_reduce":
        group.allreduce([x]).wait()
        out = x
    elif op == "reduce":
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = ROOT, dist.ReduceOp.SUM
        group.reduce([x], opts).wait()
        out = x
    elif op == "broadcast":
        opts = dist.BroadcastOptions()
        opts.rootRank = ROOT
        group.broadcast([x], opts).wait()
        out = x
    elif op == "reduce_scatter":
        out = torch.zeros(1, n * n, dtype=torch.float64)
        group.reduce_scatter([out], [list(x.split(1))]).wait()
    elif op == "all_gather":
        outs = [torch.zeros_like(x) for _ in range(n)]
        group.allgather([outs], [x]).wait()
        out = torch.cat(outs)
    elif op == "all_to_all":
        out = torch.zeros_like(x)
        group.alltoall_base(out, x, [], []).wait()
    elif op == "scatter":
        out = torch.zeros(1, n * n, dtype=torch.float64)
        opts = dist.ScatterOptions()
        opts.rootRank = ROOT
        group.scatter([out], [list(x.split(1))] if r == ROOT else [], opts).wait()
    elif op == "gather":
        outs = [torch.zeros_like(x) for _ in range(n)] if r == ROOT else []
        opts = dist.GatherOptions()
        opts.rootRank = ROOT
        group.gather([outs] if r == ROOT else [], [x], opts).wait()
        out = torch.cat(outs) if r == ROOT else x
    else:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(COLLECTIVES)}")
    return before, out


_NOTES = {
    "reduce": "torch leaves the other ranks' buffers undefined after reduce: gloo passed its "
    "partial sums through them on the way to the root, as shown.",
    "gather": "only the root receives; the others still hold their own piece.",
}


def collective(op: str, world_size: int = 4) -> Collective:
    """Run ``op`` on ``world_size`` gloo ranks (threads) on tagged chunks: who holds what."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(COLLECTIVES)}")
    _check_n(world_size)
    runs = on_threads(lambda group: _run_collective(op, group), world_size)
    n = world_size
    return Collective(
        op,
        n,
        before=[[label(row, n) for row in before] for before, _ in runs],
        after=[[label(row, n) for row in after] for _, after in runs],
        sums=[after for _, after in runs],
        note=_NOTES.get(op, ""),
    )


# ---- the ring all-reduce, written out -----------------------------------------------------


def ring_all_reduce(x: torch.Tensor, group, record=None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group`` in place, as a ring: each rank only ever talks to
    its two neighbours, and sends 2 (n - 1) / n of ``x`` in all, whatever n is.

    ``x`` is cut into n chunks. Reduce-scatter: at step s, rank r sends chunk r - s to its
    right neighbour and adds the chunk r - s - 1 that arrives from its left; after n - 1 steps
    rank r holds the full sum of chunk r + 1. All-gather: at step s it sends chunk r + 1 - s,
    complete, and keeps chunk r - s from its left; after n - 1 more steps every rank holds
    every sum. ``record(phase, step, sent_chunk)`` is called after each step (the figure's
    frames). ``group``: any process group object (``dist.group.WORLD`` in a rank).
    """
    n, r = group.size(), group.rank()
    if x.numel() % n:
        raise ValueError(f"x has {x.numel()} elements: pad it to a multiple of {n} ranks")
    chunks = x.view(n, -1)  # chunk i is row i: a view, so x is summed in place
    right, left = (r + 1) % n, (r - 1) % n
    incoming = torch.empty_like(chunks[0])
    for step in range(n - 1):  # reduce-scatter
        send, keep = (r - step) % n, (r - step - 1) % n
        _exchange(group, chunks[send], incoming, right, left)
        chunks[keep] += incoming
        if record is not None:
            record("reduce-scatter", step, send)
    for step in range(n - 1):  # all-gather
        send, keep = (r + 1 - step) % n, (r - step) % n
        _exchange(group, chunks[send], chunks[keep], right, left)
        if record is not None:
            record("all-gather", step, send)
    return x


def _exchange(group, out: torch.Tensor, into: torch.Tensor, right: int, left: int) -> None:
    """Send ``out`` to ``right`` while receiving ``into`` from ``left`` (both posted before
    either is waited on: every rank sends first, so waiting on the send first would not
    deadlock with gloo's buffered sends, but need not rely on it)."""
    sending = group.send([out.contiguous()], right, 0)
    receiving = group.recv([into], left, 0)
    sending.wait()
    receiving.wait()


@dataclass(frozen=True)
class RingStep:
    """After one step of the ring: ``phase`` ("start", "reduce-scatter", "all-gather"), its
    ``step``, each rank's chunk labels (``held[r]``) and the chunk each rank sent (``sent[r]``,
    None at the start), and elements each rank has sent so far (``elements_sent[r]``)."""

    phase: str
    step: int
    held: list[list[str]]
    sent: list[int | None]
    elements_sent: list[int]


def ring(world_size: int = 4) -> list[RingStep]:
    """``ring_all_reduce`` on tagged chunks on ``world_size`` gloo ranks (threads), every step
    kept: the frames of the ring's picture. The last frame must equal ``collective``'s
    all_reduce (a test checks it)."""
    _check_n(world_size)
    n = world_size

    def rank(group):
        x = _tags(group.rank(), n, range(n))
        frames = [("start", 0, label_rows(x), None, 0)]
        sent = 0

        def record(phase, step, chunk):
            nonlocal sent
            sent += x[chunk].numel()
            frames.append((phase, step, label_rows(x), chunk, sent))

        ring_all_reduce(x, group, record)
        return frames

    def label_rows(x):
        return [label(row, n) for row in x]

    per_rank = on_threads(rank, n)
    per_element = n * n  # one chunk's elements: a tag vector
    return [
        RingStep(
            phase=per_rank[0][i][0],
            step=per_rank[0][i][1],
            held=[frames[i][2] for frames in per_rank],
            sent=[frames[i][3] for frames in per_rank],
            elements_sent=[frames[i][4] // per_element for frames in per_rank],
        )
        for i in range(len(per_rank[0]))
    ]


# ---- what each rank keeps: the sharding strategies' own code, on a fake process group ----

SHARDING = ("ddp", "zero1", "fsdp", "hsdp", "tp_dtensor")


def shards(
    strategy: str, world_size: int = 4, cfg: RunConfig | None = None, shard_size: int = 2
) -> pd.DataFrame:
    """What each rank keeps of every parameter, its gradient and its optimizer state under
    ``strategy`` (one of ``SHARDING``), one row per (rank, tensor, kind): ``held`` and
    ``total`` elements and ``share`` = held / total. Each rank's share comes from the
    strategy's own sharding code run as that rank of ``world_size`` on torch's fake process
    group: ``fully_shard``'s local shards (FSDP, HSDP on a (replicas, ``shard_size``) mesh) and
    ZeroRedundancyOptimizer's partition (ZeRO-1). Gradients and optimizer state follow the
    parameters' sharding under FSDP (its reduce-scatter leaves each rank its shard's
    gradient, its optimizer sees only the shard); under ZeRO-1 only the state is partitioned;
    DDP keeps everything everywhere. Tensor parallelism (``tp_dtensor``: ``parallelize``'s
    plan on a 1-D mesh of ``world_size``, labkit's transformer by default) splits the weights
    of each block's column- and row-parallel Linears, and each rank's gradient and optimizer
    state follow its shard. ``placement`` says how (DTensor's short names: "S(0)", split along
    dimension 0 of the weight, the output features; "S(1)", the input features; "R",
    replicated; "whole": a plain tensor) and
    ``local_shape`` what the rank holds."""
    if strategy not in SHARDING:
        raise ValueError(f"unknown sharding {strategy!r}: choose one of {', '.join(SHARDING)}")
    if strategy == "hsdp" and (world_size % shard_size or shard_size < 2):
        raise ValueError(
            f"hsdp needs a shard size of at least 2 that divides the world size "
            f"({world_size}), got {shard_size}"
        )
    if cfg is None:
        tp = strategy == "tp_dtensor"
        cfg = (
            RunConfig(model="transformer", width=32, depth=1, heads=world_size)
            if tp
            else (RunConfig(model="mlp", width=64, depth=2))
        )
    rows = []
    for r in range(world_size):
        with fake_rank(r, world_size) as ctx:
            torch.manual_seed(cfg.seed)
            model = make_model(cfg)
            names = [name for name, _ in model.named_parameters()]
            totals = [p.numel() for p in model.parameters()]
            params = grads = state = [1.0] * len(names)
            placements = ["whole"] * len(names)
            local_shapes = [tuple(p.shape) for p in model.parameters()]
            if strategy == "zero1":
                from ..strategies.zero1 import shard_optimizer

                optimizer = shard_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
                owned = {id(p) for g in optimizer.optim.param_groups for p in g["params"]}
                state = [1.0 if id(p) in owned else 0.0 for p in model.parameters()]
            elif strategy in ("fsdp", "hsdp"):
                from ..strategies import fsdp, hsdp

                model = (
                    hsdp.shard(model, ctx, shard_size)
                    if strategy == "hsdp"
                    else (fsdp.shard(model, ctx))
                )
            elif strategy == "tp_dtensor":
                from torch.distributed.device_mesh import init_device_mesh

                from ..strategies import tp_dtensor

                mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
                model = tp_dtensor.parallelize(model, mesh, cfg.sequence_parallel)
            if strategy in ("fsdp", "hsdp", "tp_dtensor"):
                local = [p.to_local() for p in model.parameters()]
                params = grads = state = [t.numel() / n for t, n in zip(local, totals)]
                placements = [str(p.placements[-1]) for p in model.parameters()]
                local_shapes = [tuple(t.shape) for t in local]
        for kind, shares in (("parameters", params), ("gradients", grads), ("optimizer", state)):
            for name, total, share, placement, shape in zip(
                names, totals, shares, placements, local_shapes
            ):
                rows.append(
                    {
                        "rank": r,
                        "tensor": name,
                        "kind": kind,
                        "held": round(share * total),
                        "total": total,
                        "share": share,
                        "placement": placement,
                        "local_shape": shape,
                    }
                )
    out = pd.DataFrame(rows)
    out.attrs["strategy"] = strategy
    out.attrs["zero_stage"] = STRATEGIES[strategy].zero_stage
    out.attrs["world_size"] = world_size
    return out


# ---- a pipeline schedule's order, in unit time ---------------------------------------------


def pipeline_order(
    schedule: str, stages: int = 4, microbatches: int = 8, backward: float = 2.0
) -> list[dict]:
    """The events the executor's order gives when a forward takes 1 unit and a backward
    ``backward`` units, nothing else costs: ``labkit.predict.schedule.simulate`` on
    ``labkit.pipeline_schedules.stage_actions``, the order ``strategies.pipeline`` runs."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    m = 1 if schedule == "model_parallel" else microbatches
    return simulate(schedule, m, ScheduleCosts.uniform(stages, 1.0, backward))


def ddp_buckets(cfg: RunConfig, step: int | None = None) -> pd.DataFrame:
    """DDP's buckets overlapping backward, from a real run of ``cfg`` (DDP's strategy; Li et
    al. 2020, arXiv:2006.15704): one measured ``step`` (default: the last) on every rank, as
    two lanes. *compute*: the step's phases end to end as the probe timed them
    (``labkit.rank.probes.PHASES``: data, forward, backward, ..., optimizer; under DDP
    ``comm`` is the part of backward the all-reduces added, ``sync_overhead`` DDP's own
    machinery). *all-reduce*: every collective DDP handed the process group, from that moment
    to its completion, with its bytes (``labkit.wire``'s timing, the records' ``comm_spans``).
    Rows: rank, lane, name, start and end (seconds from rank 0's step start), bytes."""
    if STRATEGIES[cfg.strategy].grad_sync != "buckets":
        raise ValueError(
            f"ddp_buckets draws DDP's buckets: {cfg.strategy!r} does not average gradients in "
            f"them, pick a strategy whose registry row has grad_sync='buckets' (ddp)"
        )
    from .. import experiment  # the run: only this picture needs one

    records = experiment.run(cfg).records
    at = int(records["step"].max()) if step is None else step
    rows = records[records["step"] == at].sort_values("rank")
    if rows.empty:
        last = records["step"].max()
        raise ValueError(f"no measured step {at}: the run measured steps 0..{last}")
    origin = float(rows["start_s"].min())
    out = []
    for rec in rows.to_dict("records"):
        t = rec["start_s"]
        for phase in PHASES:
            dur = float(rec.get(f"{phase}_s", 0.0) or 0.0)
            if dur > 0:
                out.append((rec["rank"], "compute", phase, t - origin, t + dur - origin, 0))
                t += dur
        for op, a, b, nbytes in rec.get("comm_spans") or []:
            out.append((rec["rank"], "all-reduce", op, a - origin, b - origin, int(nbytes)))
    return pd.DataFrame(out, columns=["rank", "lane", "name", "start", "end", "bytes"])
