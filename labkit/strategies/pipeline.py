"""Pipeline parallelism: stages on separate ranks, the global batch cut into M micro-batches.

Two schedules, each in two implementations (naive beside real):

* GPipe: every stage runs all M forwards, then all M backwards. Simple; a stage holds the
  activations of all M micro-batches until their backward.
* 1F1B: after a warm-up of (P - stage - 1) forwards, each stage alternates one forward and one
  backward, so it holds at most P micro-batches. Same bubble as GPipe, less memory.

``pipeline_impl="scratch"`` is ~60 lines below: point-to-point ``isend``/``recv`` over the process
group (gloo on CPU). ``"torch"`` is ``torch.distributed.pipelining`` (``PipelineStage`` with
``ScheduleGPipe``/``Schedule1F1B``). Both scale each micro-batch's mean loss by 1/M, so the
gradients, and after K steps the parameters, equal single-device training on the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import registry
from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..pipeline_schedules import stage_actions
from ..rank.stages import Stage, make_stage, stage_watch, train_stages
from ..rank.watch import Watch


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    schedule = registry.get(cfg.strategy).schedule
    stage = make_stage(cfg, ctx, fns)
    optimizer = fns.optimizer(cfg, stage.module.parameters())
    loss_fn = fns.loss(cfg)
    watch = stage_watch(cfg, ctx, stage, schedule, cfg.pipeline_impl)
    notes = [
        f"stage {stage.index} holds blocks {stage.bounds[stage.index]}.."
        f"{(stage.bounds + [None])[stage.index + 1] or 'end'} (bounds {stage.bounds}"
        f"{', balanced by measured cost' if cfg.balance_stages else ', equal layer counts'})"
    ]
    if cfg.pipeline_impl == "torch":  # model_parallel.run has already set "scratch"
        step_fn = torch_schedule(cfg, ctx, stage, watch, schedule, loss_fn)
        notes.append(
            "torch impl: events time the stage's forward_one_chunk/backward_one_chunk "
            "calls inside torch.distributed.pipelining's schedule (compute only; its "
            "send/recv waits fall between them)"
        )
    else:
        step_fn = scratch_schedule(cfg, ctx, stage, watch, schedule, loss_fn)
    out = train_stages(cfg, ctx, stage, step_fn, optimizer=optimizer, watch=watch)
    out["notes"] = notes + out["notes"]
    return out


def scratch_schedule(
    cfg: RunConfig, ctx: RankContext, stage: Stage, watch: Watch, schedule: str, loss_fn
):
    """A step function running ``schedule`` with blocking recv and asynchronous sends.

    Sends never block (``isend``; we wait for them at the end of the step), so a stage only
    ever waits for data it needs: that is what makes 1F1B's interleaving deadlock-free. Ranks
    are stage indices; messages between a pair of ranks arrive in the order they were sent.
    """
    M = cfg.microbatches
    actions = stage_actions(schedule, cfg.stages, M, stage.index)
    prev, nxt = ctx.rank - 1, ctx.rank + 1  # this pipeline's neighbours (global ranks)

    def recv(like: torch.Tensor, src: int) -> torch.Tensor:
        buf = torch.empty(like.shape, dtype=like.dtype, device=ctx.device)
        with watch.phase("comm"):
            dist.recv(buf, src=src)
        return buf

    def step(x, y) -> float | None:
        xs = x.chunk(M) if stage.first else [None] * M
        ys = y.chunk(M) if stage.last else [None] * M
        held, sends, losses = {}, [], []
        for kind, m in actions:
            if kind == "F":
                inp = xs[m] if stage.first else recv(stage.inp, prev).requires_grad_()
                with watch.phase("forward", xs[m], ys[m], microbatch=m):  # with its data
                    out = stage.module(inp)
                    if stage.last:  # mean over this micro-batch / M = share of the global mean
                        out = loss_fn(out, ys[m]) / M
                if stage.last:
                    losses.append(out.detach())
                else:  # keep the tensor alive until its send completes
                    sends.append((dist.isend(out.detach(), dst=nxt), out))
                held[m] = (inp, out)
            else:
                inp, out = held.pop(m)
                grad = None if stage.last else recv(stage.out, nxt)
                with watch.phase("backward", microbatch=m):
                    torch.autograd.backward(out, grad)
                if not stage.first:
                    sends.append((dist.isend(inp.grad, dst=prev), inp))
        with watch.phase("comm"):
            for work, _ in sends:
                work.wait()
        return float(sum(losses)) if stage.last else None

    return step


def torch_schedule(
    cfg: RunConfig, ctx: RankContext, stage: Stage, watch: Watch, schedule: str, loss_fn
):
    """A step function driving ``torch.distributed.pipelining`` on this rank's stage.

    The library gives no per-micro-batch timings, so we wrap this stage object's own
    ``forward_one_chunk``/``backward_one_chunk`` (the calls its schedules make per micro-batch)
    in the watch's phases; the schedule, the send/recv and the gradient scaling are the
    library's.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pstage = PipelineStage(stage.module, stage.index, cfg.stages, ctx.device)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    # the loss is a mean per micro-batch; scale_grads=True divides gradients by M.
    sched = cls(pstage, cfg.microbatches, loss_fn=loss_fn, scale_grads=True)
    forward_one_chunk, backward_one_chunk = pstage.forward_one_chunk, pstage.backward_one_chunk

    def timed_forward(chunk_id, args=(), *rest, **kwargs):
        with watch.phase("forward", *(args or ()), microbatch=chunk_id):  # the first: its data
            return forward_one_chunk(chunk_id, args, *rest, **kwargs)

    def timed_backward(chunk_id, *args, **kwargs):
        with watch.phase("backward", microbatch=chunk_id):
            return backward_one_chunk(chunk_id, *args, **kwargs)

    pstage.forward_one_chunk, pstage.backward_one_chunk = timed_forward, timed_backward

    def step(x, y) -> float | None:
        losses: list[torch.Tensor] = []
        args = (x,) if stage.first else ()
        kwargs = {"target": y, "losses": losses} if stage.last else {}
        sched.step(*args, **kwargs)
        return float(torch.stack(losses).detach().mean()) if stage.last else None

    return step
