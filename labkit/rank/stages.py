"""What the stage-split strategies share: cutting the model, metering activations, the step loop.

Every rank builds the *whole* model from the seed (so its stage starts from exactly the weights
``single`` has), agrees on where to cut it, keeps its own stage and iterates the same global
batches as ``single``. ``train_stages`` runs warm-up and measured steps around a schedule
function and turns what it returns into records; the schedules themselves live in pipeline.py.
Event times are read from ``perf_counter``, one monotonic clock for every process on a machine
(plus the offset to rank 0's clock across machines, ``dist.clock_offset``);
``labkit.records.finalize`` puts every rank's events of a step on one origin and computes the
bubble, measured and predicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext
from ..factories import Factories
from ..models import even_bounds, partition, split, stage_state_names
from ..wire import traffic, watch_all
from .loop import Progress, buffers_kept, build_model, final_state, seed_rank_streams
from .memory_meter import optimizer_tensors, storage_bytes
from .probes import RunQueueClock, cpu_seconds, record, sync
from .profiling import layer_costs


@dataclass
class Stage:
    """This rank's slice of the model and where it sits in the pipeline."""

    index: int
    stages: int
    bounds: list[int]
    module: nn.Sequential
    names: dict[str, str]  # local parameter/buffer name -> whole-model name
    inp: torch.Tensor  # meta tensors: one micro-batch's input and output,
    out: torch.Tensor  # the shapes and dtypes every recv allocates
    dataset: torch.utils.data.Dataset  # built once (data_fn is called once per rank per run)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def make_stage(cfg: RunConfig, ctx: RankContext, fns: Factories) -> Stage:
    """Build the whole model (seeded), agree on the cut, keep this rank's stage on ctx.device:
    stage ``rank % stages`` (ranks ``r * stages .. r * stages + stages - 1`` form replica r's
    pipeline when data parallelism runs several, ``dp_pp``)."""
    model = build_model(cfg, ctx, fns)
    dataset = fns.dataset(cfg)
    # one micro-batch of real samples: the shapes every boundary sees
    x, _ = default_collate([dataset[i] for i in range(cfg.batch_per_rank)])
    x = x.to(ctx.device)
    with buffers_kept(model):  # probing shapes and costs must not train BatchNorm
        bounds = stage_bounds(cfg, ctx, model, x)
        shapes = boundary_shapes(model, x)
    s, ends = ctx.rank % cfg.stages, bounds[1:] + [len(model)]
    module = split(model, bounds)[s]
    return Stage(
        s,
        cfg.stages,
        bounds,
        module,
        stage_state_names(bounds, s, module),
        shapes[bounds[s]],
        shapes[ends[s]],
        dataset,
    )


def stage_bounds(
    cfg: RunConfig, ctx: RankContext, model: nn.Sequential, x: torch.Tensor
) -> list[int]:
    """Equal layer counts, or (``cfg.balance_stages``) a cut by per-block cost timed on rank 0 and
    broadcast, because timings differ between ranks and every rank must cut at the same place."""
    if not cfg.balance_stages:
        return even_bounds(len(model), cfg.stages)
    box = [partition(layer_costs(model, x), cfg.stages) if ctx.rank == 0 else None]
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


class ActivationMeter:
    """Bytes autograd saves for backward per micro-batch (``saved_tensors_hooks``), parameters
    excluded, and the peak held at once: the memory a schedule trades for fewer bubbles."""

    def __init__(self, module: nn.Module):
        self._params = {p.data_ptr() for p in module.parameters()}
        self.held: dict[int, int] = {}
        self.peak_bytes = 0
        self.peak_count = 0

    def reset(self) -> None:
        self.held.clear()
        self.peak_bytes = self.peak_count = 0

    @contextmanager
    def forward(self, microbatch: int):
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = (t.data_ptr(), t.numel())
            if t.data_ptr() not in self._params and key not in seen:  # ReLU's output is also
                seen.add(key)  # the next Linear's input
                self.held[microbatch] += t.numel() * t.element_size()
            return t

        self.held[microbatch] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak_count = max(self.peak_count, len(self.held))
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))

    def backward_done(self, microbatch: int) -> None:
        self.held.pop(microbatch, None)


class EventLog:
    """This stage's F/B events of one step on the shared clock (``perf_counter`` plus this
    machine's offset to rank 0), plus the CPU time its thread got while computing them (on CPU:
    a share below 1 means the rank was descheduled mid-compute, i.e. the stages were not really
    running in parallel)."""

    def __init__(self, stage: int, device: torch.device, offset_s: float = 0.0):
        self.stage, self.device, self.offset_s = stage, device, offset_s
        self.events: list[dict] = []
        self.comm_events: list[dict] = []  # each blocked interval, on the same clock
        self.cpu_s = self.comm_s = 0.0
        self.threads = torch.get_num_threads()

    def begin(self) -> None:
        self.events, self.comm_events, self.cpu_s, self.comm_s = [], [], 0.0, 0.0

    @contextmanager
    def comm(self, kind: str | None = None):
        """Time blocked in a point-to-point receive or a send's completion: the step's
        communication, read where it happens (not what is left of the step). Each interval is
        kept for the step's trace; ``kind`` names it where the caller knows (``label_comm``
        names the schedules' receives and sends)."""
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        self.comm_s += end - start
        self.comm_events.append(
            {"kind": kind, "microbatch": None, "start": start + self.offset_s,
             "end": end + self.offset_s}
        )  # fmt: skip

    @contextmanager
    def time(self, kind: str, microbatch: int):
        start, cpu = time.perf_counter(), cpu_seconds(self.threads)
        yield
        sync(self.device)  # GPU kernels are asynchronous: wait before reading
        self.cpu_s += cpu_seconds(self.threads) - cpu
        self.events.append(
            {
                "stage": self.stage,
                "microbatch": int(microbatch),
                "kind": kind,
                "start": start + self.offset_s,
                "end": time.perf_counter() + self.offset_s,
            }
        )


@dataclass
class StepOut:
    """What one schedule step on one stage returns."""

    log: EventLog
    loss: float | None  # the global batch's loss (last stage only)
    notes: list[str] = field(default_factory=list)


# step_fn(x, y): the global batch's inputs (first stage, else None) and targets (last stage,
# else None); it runs forward and backward, leaving gradients.
Schedule = Callable[[torch.Tensor | None, torch.Tensor | None], StepOut]


def train_stages(
    cfg: RunConfig,
    ctx: RankContext,
    stage: Stage,
    step_fn: Schedule,
    *,
    optimizer: torch.optim.Optimizer,
    meter: ActivationMeter,
    log: EventLog,
    schedule: str,
    impl: str,
    notes: list[str],
    replica: int = 0,
    replicas: int = 1,
    sync_grads: Callable[[], None] | None = None,
) -> dict:
    """Warm up, then run ``cfg.steps`` measured steps of ``step_fn``; return this rank's result.

    Each step: fetch the global batch (data; replica r of ``replicas`` pipelines takes its r-th
    slice), meet every rank at a barrier (wait), run the schedule, ``sync_grads`` (data
    parallelism across replicas: timed as comm), step the optimizer. The record's ``start_s``
    is the barrier's exit, where every stage starts the schedule together: the origin
    ``labkit.records.finalize`` puts the step's events on. The step's data and wait come
    before it, so the step lasts from ``start_s - data_s - wait_s`` for ``step_s``.
    """
    data = batches(shard_loader(stage.dataset, cfg.global_batch, 0, 1, seed=cfg.seed))
    part = cfg.global_batch // replicas
    seed_rank_streams(cfg, ctx)
    total, records, wire = cfg.warmup + cfg.steps, [], traffic()
    watch_all()  # the groups the strategy made (a device mesh's)
    progress = Progress(ctx, cfg.steps)
    sched = RunQueueClock(all_threads=log.threads > 1)
    for i in range(total):
        meter.reset()
        sched0 = sched.read()
        wire.take()  # warm-up and the step before are not this step's traffic
        t_start = time.perf_counter()
        x, y = next(data)  # every stage draws it, so all stay on single's order
        x, y = x[replica * part : (replica + 1) * part], y[replica * part : (replica + 1) * part]
        x = x.to(ctx.device) if stage.first else None
        y = y.to(ctx.device) if stage.last else None
        t_data = time.perf_counter()
        if ctx.distributed:
            dist.barrier()
        t0 = time.perf_counter()
        log.begin()
        out = step_fn(x, y)
        if sync_grads is not None:
            with log.comm("sync"):
                sync_grads()
        t_sched = time.perf_counter()
        counting = i == max(cfg.warmup - 1, 0)  # one step, as the shared loop's meter does
        if counting:
            held = stage_memory(stage.module, optimizer, meter.peak_bytes, (x, y), grads=True)
        optimizer.step()
        if counting:
            held.update(stage_memory(stage.module, optimizer, meter.peak_bytes, (x, y)))
        optimizer.zero_grad(set_to_none=True)
        t_end = time.perf_counter()
        if i < cfg.warmup:
            continue  # progress counts measured steps only
        events = list(out.log.events)
        fwd = sum(e["end"] - e["start"] for e in events if e["kind"] == "F")
        bwd = sum(e["end"] - e["start"] for e in events if e["kind"] == "B")
        cpu_share = sched.share(sched0, sched.read())
        if cpu_share is None:  # no schedstat: the thread's CPU time while computing
            cpu_share = out.log.cpu_s / (fwd + bwd) if ctx.device.type == "cpu" else float("nan")
        step_s, data_s, opt_s = t_end - t_start, t_data - t_start, t_end - t_sched
        wait_s, comm_s = t0 - t_data, out.log.comm_s  # the barrier: every stage starts the step
        start = t0 + log.offset_s  # start_s: the barrier's exit, on the events' clock
        base = {
            "strategy": cfg.strategy,
            "world_size": cfg.world_size,
            "rank": ctx.rank,
            "device": str(ctx.device),
            "global_batch": cfg.global_batch,
            "threads": log.threads,
        }
        times = {
            "data_s": data_s,
            "wait_s": wait_s,
            "forward_s": fwd,
            "backward_s": bwd,
            "comm_s": comm_s,
            "optimizer_s": opt_s,
            # schedule bookkeeping between the timed phases (torch's schedule: its sends and
            # receives too, which labkit cannot time from outside)
            "other_s": max(0.0, step_s - data_s - wait_s - fwd - bwd - comm_s - opt_s),
            "step_s": step_s,
        }
        sent = wire.take()
        records.append(
            record(
                base,
                i - cfg.warmup,
                out.loss,  # the batch's loss lives on the last stage; the others have none
                part,
                times,
                start_s=start,
                cpu_share=cpu_share,
                device=ctx.device,
                comm_bytes=sent["comm_bytes"],
                comm_calls=sent["comm_calls"],
                comm_payload_bytes=sent["comm_payload_bytes"],
                stage=stage.index,
                stages=cfg.stages,
                replica=replica,
                microbatches=cfg.microbatches,
                schedule=schedule,
                impl=impl,
                activations_peak=meter.peak_count,
                activation_bytes_peak=meter.peak_bytes,
                **held,
                events=events,
                comm_events=[  # each blocked interval, in seconds from start_s
                    {**c, "start": c["start"] - start, "end": c["end"] - start}
                    for c in label_comm(events, out.log.comm_events)
                ],
                comm_spans=[list(span) for span in sent["spans"]],
            )
        )
        notes.extend(n for n in out.notes if n not in notes)
        progress(i + 1 - cfg.warmup, out.loss, part if stage.last else 0)
    return {
        "records": records,
        "notes": notes,
        "params": _whole_names(stage, final_state(cfg, stage.module)),
    }


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


def stage_memory(module, optimizer, activations: int, batch, grads: bool = False) -> dict:
    """This stage's bytes in the memory meter's five categories (``rank.memory_meter``): its
    own parameters, their gradients (``grads=True``: counted before the optimizer step), the
    optimizer's state, the activations its schedule held at its peak (GPipe all M micro-
    batches', 1F1B at most P), and the rest: this stage's part of the batch and buffers."""
    if grads:
        return {"mem_grads_bytes": storage_bytes(p.grad for p in module.parameters())}
    return {
        "mem_params_bytes": storage_bytes(module.parameters()),
        "mem_optimizer_bytes": storage_bytes(optimizer_tensors(optimizer)),
        "mem_activations_bytes": activations,
        "mem_rest_bytes": storage_bytes(t for t in batch if t is not None)
        + storage_bytes(module.buffers()),
    }


def _whole_names(stage: Stage, state: dict | None) -> dict | None:
    return None if state is None else {stage.names[k]: v for k, v in state.items()}
