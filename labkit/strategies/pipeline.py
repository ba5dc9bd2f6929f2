"""Pipeline parallelism: stages on separate ranks, the global batch cut into M micro-batches.

The schedules (their order: ``labkit.pipeline_schedules``), each in up to two implementations
(naive beside real):

* GPipe: every stage runs all M forwards, then all M backwards. Simple; a stage holds the
  activations of all M micro-batches until their backward.
* 1F1B: after a warm-up of (P - stage - 1) forwards, each stage alternates one forward and one
  backward, so it holds at most P micro-batches. Same bubble as GPipe, less memory.
* interleaved 1F1B: the model cut into P·v chunks, chunk c on rank c mod P, so a micro-batch
  visits every rank v times and the bubble, counted in chunks, shrinks v times.
* zero bubble (ZB-H1 / ZB1P, ZB-V) and DualPipeV: the backward split into the input's gradient
  (I) and the weights' (W), which waits to fill the bubble. ``torch`` only.

``pipeline_impl="scratch"`` (and ``"auto"`` where labkit has the schedule) is
``scratch_schedule`` below: point-to-point ``isend``/``recv`` over the process group (gloo on
CPU). ``"torch"`` is ``torch.distributed.pipelining`` (``PipelineStage`` with the schedule's
class). Both scale each micro-batch's mean loss by 1/M, so the gradients, and after K steps the
parameters, equal single-device training on the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import registry
from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..pipeline_schedules import (
    chunk_rank,
    compute_actions,
    implementation,
    rank_actions,
    torch_schedule_class,
)
from ..rank.stages import Stage, action, make_stage, plan, stage_watch, train_stages
from ..rank.watch import Watch


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    schedule = registry.get(cfg.strategy).schedule
    stage = make_stage(cfg, ctx, fns, schedule)
    optimizer = fns.optimizer(cfg, stage.module.parameters())
    loss_fn = fns.loss(cfg)
    impl = implementation(schedule, cfg.pipeline_impl)
    watch = stage_watch(cfg, ctx, stage, schedule, impl)
    ends = stage.bounds[1:] + [None]
    held = ", ".join(
        f"chunk {c}: blocks {stage.bounds[c]}..{ends[c] or 'end'}" for c in stage.chunks
    )
    notes = [
        f"stage {stage.index} holds {held} (bounds {stage.bounds}"
        f"{', balanced by measured cost' if cfg.balance_stages else ', equal layer counts'})"
    ]
    if impl == "torch":  # model_parallel.run has already set "scratch"
        step_fn = torch_schedule(cfg, ctx, stage, watch, schedule, loss_fn)
        notes.append(
            "torch impl: events time the stage's forward_one_chunk/backward_one_chunk "
            "(and backward_weight_one_chunk) calls inside torch.distributed.pipelining's "
            "schedule (compute only; its send/recv waits fall between them)"
        )
    else:
        step_fn = scratch_schedule(cfg, ctx, stage, watch, schedule, loss_fn)
    out = train_stages(cfg, ctx, stage, step_fn, optimizer=optimizer, watch=watch)
    out["notes"] = notes + out["notes"]
    return out


def scratch_schedule(
    cfg: RunConfig, ctx: RankContext, stage: Stage, watch: Watch, schedule: str, loss_fn, group=None
):
    """A step function running ``schedule`` with blocking recv and asynchronous sends.

    Each action is (kind, micro-batch m, model chunk c); with one chunk per rank, c is the
    stage. Chunk c's forward takes its input from chunk c-1 (the data for chunk 0) and hands
    its output to chunk c+1 (the loss for the last chunk); its backward takes the gradient of
    its output from chunk c+1 and sends its input's gradient to chunk c-1. Sends never block
    (``isend``; we wait for them at the end of the step), so a rank only ever waits for data it
    needs: that is what makes 1F1B's interleaving deadlock-free. Every message's tag names its
    chunk, micro-batch and direction, so a receive takes the message it asked for whatever the
    sender's order (an interleaved rank sends activations and gradients to the same neighbour).
    ``group``: the pipeline's process group, its ranks in stage order (a device mesh's "pp"
    dimension, ``mesh4d``), which then carries every message; by default the world, this
    pipeline's stage s at global rank ``rank - stage + s``.
    """
    M, P, last = cfg.microbatches, cfg.stages, stage.total - 1
    actions = rank_actions(schedule, P, M, stage.index, stage.virtual)
    plan(watch, actions)
    base = ctx.rank - stage.index  # global rank of this pipeline's stage 0
    ranks = None if group is None else dist.get_process_group_ranks(group)

    def rank_of(chunk: int) -> int:
        s = chunk_rank(schedule, P, chunk)
        return base + s if ranks is None else ranks[s]

    def tag(chunk: int, m: int, grad: bool) -> int:  # into chunk's input (grad: out of it)
        return 2 * (chunk * M + m) + grad

    def recv(like: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype, device=ctx.device)
        with watch.phase("comm"):
            dist.recv(buf, src=src, group=group, tag=tag)
        return buf

    def step(x, y) -> float | None:
        xs = x.chunk(M) if stage.first else [None] * M
        ys = y.chunk(M) if stage.last else [None] * M
        held, sends, losses = {}, [], []
        for kind, m, c in actions:
            inp_meta, out_meta = stage.shapes[c]
            if kind == "F":
                if c == 0:
                    inp = xs[m]
                else:
                    inp = recv(inp_meta, rank_of(c - 1), tag(c, m, False)).requires_grad_()
                data = (xs[m] if c == 0 else None, ys[m] if c == last else None)
                with action(watch, "F", m, c, *data):  # the memory meter: with its data
                    out = stage.chunks[c](inp)
                    if c == last:  # mean over this micro-batch / M = share of the global mean
                        out = loss_fn(out, ys[m]) / M
                if c == last:
                    losses.append(out.detach())
                else:  # keep the tensor alive until its send completes
                    work = dist.isend(
                        out.detach(), dst=rank_of(c + 1), group=group, tag=tag(c + 1, m, False)
                    )
                    sends.append((work, out))
                held[c, m] = (inp, out)
            else:
                inp, out = held.pop((c, m))
                grad = None if c == last else recv(out_meta, rank_of(c + 1), tag(c, m, True))
                with action(watch, "B", m, c):
                    torch.autograd.backward(out, grad)
                if c > 0:
                    sends.append(
                        (
                            dist.isend(
                                inp.grad, dst=rank_of(c - 1), group=group, tag=tag(c - 1, m, True)
                            ),
                            inp,
                        )
                    )
        with watch.phase("comm"):
            for work, _ in sends:
                work.wait()
        return float(sum(losses)) if stage.last else None

    return step


def torch_schedule(
    cfg: RunConfig, ctx: RankContext, stage: Stage, watch: Watch, schedule: str, loss_fn
):
    """A step function driving ``torch.distributed.pipelining`` on this rank's chunks.

    The library gives no per-micro-batch timings, so we wrap each of this rank's stage objects'
    own ``forward_one_chunk``, ``backward_one_chunk`` (a full backward, or with
    ``full_backward=False`` the input's gradient alone) and ``backward_weight_one_chunk`` (the
    weights' gradient) in the watch's phases: the events are what the schedule ran, in the order
    it ran them. The schedule, the send/recv and the gradient scaling are the library's.
    """
    from torch.distributed.pipelining import PipelineStage

    pstages = [
        PipelineStage(module, c, stage.total, ctx.device) for c, module in stage.chunks.items()
    ]
    for ps in pstages:
        _watch_chunk(ps, watch)
    cls = torch_schedule_class(schedule)
    one = cls.__name__ in ("ScheduleGPipe", "Schedule1F1B")  # a single stage per rank
    # the loss is a mean per micro-batch; scale_grads=True divides gradients by M.
    sched = cls(pstages[0] if one else pstages, cfg.microbatches, loss_fn=loss_fn, scale_grads=True)

    def step(x, y) -> float | None:
        losses: list[torch.Tensor] = []
        args = (x,) if stage.first else ()
        kwargs = {"target": y, "losses": losses} if stage.last else {}
        sched.step(*args, **kwargs)
        return float(torch.stack(losses).detach().mean()) if stage.last else None

    # what it runs: the lowered actions of the multi-chunk classes; GPipe and 1F1B loop over
    # their own order, which is labkit's (their declared pipeline_order is a picture only)
    lowered = getattr(sched, "pipeline_order_with_comms", None)
    if lowered:
        plan(watch, compute_actions(lowered[stage.index]))
    else:
        plan(watch, rank_actions(schedule, cfg.stages, cfg.microbatches, stage.index))
    return step


def _watch_chunk(ps, watch: Watch) -> None:
    """Time one stage object's compute calls as the schedule's actions on its chunk."""
    c = ps.stage_index
    forward, backward, weight = (
        ps.forward_one_chunk,
        ps.backward_one_chunk,
        ps.backward_weight_one_chunk,
    )

    def timed_forward(chunk_id, args=(), *rest, **kwargs):
        data = tuple(args or ()) if c == 0 else ()  # the first chunk's micro-batch: its data
        with action(watch, "F", chunk_id, c, *data):
            return forward(chunk_id, args, *rest, **kwargs)

    def timed_backward(chunk_id, *args, full_backward: bool = True, **kwargs):
        with action(watch, "B" if full_backward else "I", chunk_id, c):
            return backward(chunk_id, *args, full_backward=full_backward, **kwargs)

    def timed_weight(chunk_id, *args, **kwargs):
        with action(watch, "W", chunk_id, c):
            return weight(chunk_id, *args, **kwargs)

    ps.forward_one_chunk, ps.backward_one_chunk = timed_forward, timed_backward
    ps.backward_weight_one_chunk = timed_weight
