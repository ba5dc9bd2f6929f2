"""What the stage-split strategies share: cutting the model, the step loop, its events.

Every rank builds the *whole* model from the seed (so its stage starts from exactly the weights
``single`` has), agrees on where to cut it, keeps its own stage and iterates the same global
batches as ``single``. ``train_stages`` runs warm-up and measured steps around a schedule
function; the schedules themselves live in pipeline.py, their order in
``labkit.pipeline_schedules``. Both are watched through ``labkit.rank.watch`` like the shared
loop: the same phases, the same memory meter, the same record builder. Event times are read
from ``perf_counter``, one monotonic clock for every process on a machine (plus the offset to
rank 0's clock across machines, ``dist.clock_offset``); ``labkit.records.finalize`` puts every
rank's events of a step on one origin and computes the bubble, measured and predicted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext, clock_offset
from ..factories import Factories
from ..models import even_bounds, partition, split, stage_state_names
from ..pipeline_schedules import chunks_per_rank, rank_chunks
from .layer_timing import layer_costs
from .loop import build_model, final_state, seed_rank_streams
from .probes import buffers_kept
from .watch import Watch


@dataclass
class Stage:
    """This rank's slice of the model and where it sits in the pipeline: one chunk of the
    model (a stage), or v chunks (virtual stages) where the schedule interleaves them."""

    index: int
    stages: int
    bounds: list[int]  # where each chunk of the model starts (P·v of them)
    module: nn.Module  # the stage (v = 1), else an nn.ModuleList of this rank's chunks
    names: dict[str, str]  # local parameter/buffer name -> whole-model name
    inp: torch.Tensor  # meta tensors: one micro-batch's input and output of the first chunk,
    out: torch.Tensor  # the shapes and dtypes every recv allocates
    dataset: torch.utils.data.Dataset  # built once (data_fn is called once per rank per run)
    schedule: str = "1f1b"
    chunks: dict[int, nn.Sequential] = field(default_factory=dict)  # model chunk -> its layers
    shapes: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def virtual(self) -> int:
        """v: the model chunks this rank holds."""
        return len(self.chunks) or 1

    @property
    def total(self) -> int:
        """P·v: the model chunks in the whole pipeline."""
        return len(self.bounds)

    @property
    def first(self) -> bool:
        """Holds the model's first chunk (it reads the data)."""
        return 0 in self.chunks if self.chunks else self.index == 0

    @property
    def last(self) -> bool:
        """Holds the model's last chunk (it computes the loss; under a V schedule rank 0)."""
        return self.total - 1 in self.chunks if self.chunks else self.index == self.stages - 1


def make_stage(
    cfg: RunConfig,
    ctx: RankContext,
    fns: Factories,
    schedule: str = "1f1b",
    index: int | None = None,
) -> Stage:
    """Build the whole model (seeded), agree on the cut, keep this rank's stage on ctx.device:
    stage ``rank % stages`` (ranks ``r * stages .. r * stages + stages - 1`` form replica r's
    pipeline when data parallelism runs several, ``dp_pp``), or ``index`` where a device mesh
    places the stages otherwise (``mesh4d``: the rank's "pp" coordinate). A schedule with v
    chunks per rank (``labkit.pipeline_schedules``) cuts the model into P·v chunks and keeps the
    ones its placement gives this rank."""
    model = build_model(cfg, ctx, fns)
    dataset = fns.dataset(cfg)
    # one micro-batch of real samples: the shapes every boundary sees
    x, _ = default_collate([dataset[i] for i in range(cfg.batch_per_rank)])
    x = x.to(ctx.device)
    v = chunks_per_rank(schedule, cfg.virtual_stages)
    with buffers_kept(model):  # probing shapes and costs must not train BatchNorm
        bounds = stage_bounds(cfg, ctx, model, x, cfg.stages * v)
        shapes = boundary_shapes(model, x)
    s = ctx.rank % cfg.stages if index is None else index
    ends = bounds[1:] + [len(model)]
    parts = split(model, bounds)
    mine = rank_chunks(schedule, cfg.stages, v, s)
    chunks = {c: parts[c] for c in mine}
    io = {c: (shapes[bounds[c]], shapes[ends[c]]) for c in mine}
    if v == 1:  # one chunk: the stage itself, named as before
        module, names = parts[mine[0]], stage_state_names(bounds, mine[0], parts[mine[0]])
    else:  # "k.<layer>.<name>": this rank's k-th chunk
        module = nn.ModuleList(chunks[c] for c in mine)
        names = {
            f"{k}.{local}": whole
            for k, c in enumerate(mine)
            for local, whole in stage_state_names(bounds, c, chunks[c]).items()
        }
    first_in, last_out = io[mine[0]][0], io[mine[-1]][1]
    return Stage(
        s, cfg.stages, bounds, module, names, first_in, last_out, dataset, schedule, chunks, io
    )


def stage_bounds(
    cfg: RunConfig, ctx: RankContext, model: nn.Sequential, x: torch.Tensor, parts: int = 0
) -> list[int]:
    """Equal layer counts, or (``cfg.balance_stages``) a cut by per-block cost timed on rank 0 and
    broadcast, because timings differ between ranks and every rank must cut at the same place.
    ``parts``: the chunks to cut (default: one per stage)."""
    parts = parts or cfg.stages
    if not cfg.balance_stages:
        return even_bounds(len(model), parts)
    box = [partition(layer_costs(model, x), parts) if ctx.rank == 0 else None]
    if ctx.distributed:
        dist.broadcast_object_list(box, src=0)
    model.zero_grad(set_to_none=True)
    return box[0]


def boundary_shapes(model: nn.Sequential, x: torch.Tensor) -> list[torch.Tensor]:
    """Meta tensors of the input of every block and the output: what each send/recv carries."""
    outs = [x.to("meta")]
    with torch.no_grad():
        for block in model:
            x = block(x)
            outs.append(x.to("meta"))
    return outs


class ScheduleLog:
    """This stage's compute events of one step on the shared clock (``perf_counter`` plus this
    machine's offset to rank 0), and each interval it was blocked in a receive or a send's
    completion, kept for the step's trace: a participant of the stage's watch
    (``labkit.rank.watch``), which times them as the phases they are, so an event is exactly the
    time its phase adds to the record. Each event is one action of the schedule, as the executor
    announced it (``action``): its kind (F, B, or the split backward's I and W), micro-batch and
    model chunk. The step's record starts where the barrier lets every stage start the schedule
    together (``start_s``)."""

    def __init__(self, stage: int, offset_s: float = 0.0):
        self.stage, self.offset_s = stage, offset_s
        self.watch: Watch | None = None
        self.pending: deque[tuple[str, int, int]] = deque()  # announced, not yet closed
        self.planned: list[tuple[str, int, int]] = []  # what the executor was told to run
        self.closed: list[tuple[str, object]] = []  # (phase, action or label), in order

    def attach(self, watch: Watch) -> None:
        self.watch = watch

    def step_start(self, i: int) -> None:
        self.closed = []

    def exit(self, phase) -> None:
        if phase.name in ("forward", "backward"):
            kind = "F" if phase.name == "forward" else "B"
            self.closed.append(
                (phase.name, self.pending.popleft() if self.pending else
                 (kind, phase.microbatch, self.stage))
            )  # fmt: skip
        elif phase.name == "comm":  # ``label``: what it waited for, where the caller knows
            self.closed.append((phase.name, phase.label))

    def step_end(self, i: int, rec: dict) -> None:
        events, comm_events, origin, closed = [], [], 0.0, iter(self.closed)
        for phase, a, b in self.watch.probe.segments(self.watch.stopped):
            a, b = a + self.offset_s, b + self.offset_s
            if phase == "wait":  # the barrier's exit: every stage starts the schedule now
                origin = b
            elif phase in ("forward", "backward", "comm"):
                name, what = next(closed)
                assert name == phase, (name, phase)
                if phase == "comm":
                    comm_events.append({"kind": what, "microbatch": None, "start": a, "end": b})
                else:
                    kind, m, chunk = what
                    events.append(
                        {"stage": self.stage, "chunk": int(chunk), "microbatch": int(m),
                         "kind": kind, "start": a, "end": b}
                    )  # fmt: skip
        rec["start_s"] = origin  # the barrier's exit, on the events' clock
        rec["events"] = events
        rec["planned"] = [list(a) for a in self.planned]
        rec["comm_events"] = [  # each blocked interval, in seconds from start_s
            {**c, "start": c["start"] - origin, "end": c["end"] - origin}
            for c in label_comm(events, comm_events)
        ]


def plan(watch: Watch, actions) -> None:
    """Record the order this rank's executor runs (``(kind, micro-batch, chunk)`` each): labkit's
    own, or what torch's schedule object lowered; each record carries it as ``planned``."""
    _log(watch).planned = [tuple(a) for a in actions]


def _log(watch: Watch) -> ScheduleLog:
    return next(p for p in watch.parts if isinstance(p, ScheduleLog))


def action(watch: Watch, kind: str, microbatch: int, chunk: int, *batch):
    """The phase that times one action of the schedule, announced to the stage's log: a forward
    ("F", with ``batch``, the data it was handed), a full backward ("B"), or the split
    backward's input ("I") and weight ("W") halves. The memory meter holds what a forward saved
    until the backward that frees it: B, or W (an I keeps what its W will need)."""
    _log(watch).pending.append((kind, microbatch, chunk))
    key = None if kind == "I" else (microbatch, chunk)
    return watch.phase("forward" if kind == "F" else "backward", *batch, microbatch=key)


def stage_watch(
    cfg: RunConfig,
    ctx: RankContext,
    stage: Stage,
    schedule: str,
    impl: str,
    replica: int = 0,
    **columns,
) -> Watch:
    """The watch of one stage's steps: its schedule's events on the shared clock, the CPU share
    over the whole step, and the columns that say which stage of which pipeline it is
    (``replica``: the pipeline; ``columns``: more of the rank's coordinates, e.g. on a mesh)."""
    log = ScheduleLog(stage.index, clock_offset(ctx))
    return Watch(
        cfg,
        ctx,
        log,
        spans=False,
        whole_step=True,
        stage=stage.index,
        stages=cfg.stages,
        replica=replica,
        microbatches=cfg.microbatches,
        virtual_stages=stage.virtual,
        schedule=schedule,
        impl=impl,
        **columns,
    )


# step_fn(x, y): the global batch's inputs (first stage, else None) and targets (last stage,
# else None); it runs forward and backward, leaving gradients, and returns the batch's loss
# (last stage, else None).
Schedule = Callable[[torch.Tensor | None, torch.Tensor | None], float | None]


def train_stages(
    cfg: RunConfig,
    ctx: RankContext,
    stage: Stage,
    step_fn: Schedule,
    *,
    optimizer: torch.optim.Optimizer,
    watch: Watch,
    replica: int = 0,
    replicas: int = 1,
    sync_grads: Callable[[], None] | None = None,
) -> dict:
    """Warm up, then run ``cfg.steps`` measured steps of ``step_fn``; return this rank's result.

    Each step: fetch the global batch (data; replica r of ``replicas`` pipelines takes its r-th
    slice), meet every rank at a barrier (wait), run the schedule (its forwards, backwards and
    blocked receives are phases of their own; what is left between them is the schedule's
    bookkeeping, ``other``), ``sync_grads`` (data parallelism across replicas), step the
    optimizer. The record's ``start_s`` is the barrier's exit, where every stage starts the
    schedule together: the origin ``labkit.records.finalize`` puts the step's events on. The
    step's data and wait come before it, so the step lasts from ``start_s - data_s - wait_s``
    for ``step_s``.
    """
    data = batches(shard_loader(stage.dataset, cfg.global_batch, 0, 1, seed=cfg.seed))
    part = cfg.global_batch // replicas
    seed_rank_streams(cfg, ctx)
    watch.attach(stage.module, optimizer, every_step=True)  # activations held, every step
    for _ in watch.steps(cfg.warmup + cfg.steps):
        with watch.phase("data"):
            x, y = next(data)  # every stage draws it, so all stay on single's order
            mine = slice(replica * part, (replica + 1) * part)
            x, y = x[mine], y[mine]
            x = x.to(ctx.device) if stage.first else None
            y = y.to(ctx.device) if stage.last else None
        with watch.phase("wait"):  # every stage starts the schedule together
            if ctx.distributed:
                dist.barrier()
        with watch.phase("other"):
            loss = step_fn(x, y)
        if sync_grads is not None:
            with watch.phase("comm", label="sync"):
                sync_grads()
        with watch.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        watch.step_end([(loss, part)])  # the batch's loss lives on the last stage
    return watch.result(_whole_names(stage, final_state(cfg, stage.module)))


def label_comm(events: list[dict], comm_events: list[dict]) -> list[dict]:
    """Name the step's unnamed blocked intervals. A scratch schedule receives the tensor a
    forward or backward needs just before running it, so an interval that this stage's next
    compute event follows is that micro-batch's receive (``"recv"``, ``"for"`` the event's
    kind: activations for F, a gradient for B); one after the last compute event is the wait
    for the step's sends to complete (``"send"``)."""
    compute = sorted(events, key=lambda e: e["start"])
    out = []
    for c in comm_events:
        if c["kind"] is None:
            nxt = next((e for e in compute if e["start"] >= c["end"]), None)
            c = {**c, "kind": "send"} if nxt is None else {
                **c, "kind": "recv", "microbatch": nxt["microbatch"], "for": nxt["kind"]
            }  # fmt: skip
        out.append(c)
    return out


def _whole_names(stage: Stage, state: dict | None) -> dict | None:
    return None if state is None else {stage.names[k]: v for k, v in state.items()}
