"""The training loop every strategy but the pipelines runs, and what it needs to start.

The loop is written once and only trains, so that a strategy's file holds how it prepares the
model, the data and the gradient synchronisation: the algorithm. That difference is the lesson:
diff single.py and ddp.py. What watches the run (timing, bytes, memory, records, progress,
checkpoints, pacing) attaches through ``labkit.rank.watch``; what perturbs it (a straggler,
load balancing) is composed by the strategies that take it (``labkit.rank.balancer``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext
from ..factories import Factories
from ..models import checkpoint_blocks
from ..registry import DATA_PARALLEL
from .precision import Amp
from .watch import Watch


def set_check_mode(cfg: RunConfig) -> None:
    """Deterministic kernels and no TF32, so strategies can be compared to 1e-5 on GPUs too."""
    if not cfg.deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS initialises
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False


def build_model(cfg: RunConfig, ctx: RankContext, fns: Factories) -> nn.Module:
    """The same initial weights on every rank and every strategy: seed, build, move."""
    set_check_mode(cfg)
    model = fns.model(cfg)
    if cfg.sync_batchnorm and cfg.strategy in DATA_PARALLEL and ctx.world_size > 1:
        from .syncbn import convert_sync_batchnorm

        model = convert_sync_batchnorm(model, ctx.device.type)
    if cfg.activation_checkpointing:  # activation checkpointing, per block
        model = checkpoint_blocks(model)
    return model.to(ctx.device)


def seed_rank_streams(cfg: RunConfig, ctx: RankContext) -> None:
    """After everything is built from the shared seed, give each rank its own random stream:
    dropout masks and augmentations must differ between ranks (identical masks would repeat one
    sample of noise on every rank instead of drawing world_size of them)."""
    torch.manual_seed(cfg.seed + ctx.rank)


def final_state(cfg: RunConfig, module: nn.Module) -> dict | None:
    """Parameters and buffers (running statistics too) to compare in check mode, else None."""
    if not cfg.deterministic:
        return None
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {k: v.detach().cpu().clone() for k, v in state.items()}


def data_iter(cfg: RunConfig, fns: Factories, rank: int, world_size: int) -> batches:
    """This rank's endless batches of ``cfg.batch_per_rank`` samples: shard ``rank`` of
    ``world_size`` (``.loader.dataset`` is the dataset, built once per run)."""
    loader = shard_loader(fns.dataset(cfg), cfg.batch_per_rank, rank, world_size, seed=cfg.seed)
    return batches(loader)


def train_loop(
    cfg: RunConfig,
    ctx: RankContext,
    model: nn.Module,
    data: batches,
    *,
    fns: Factories,
    sync_grads: Callable[[], None] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable | None = None,
    after_step: Callable[[int], dict] | None = None,
    until: Callable[[], bool] | None = None,
    steps: int | None = None,
    watch: Watch | None = None,
) -> dict:
    """Warm up, then train ``cfg.steps`` measured steps; return this rank's records.

    A strategy hands over its algorithm: the model (wrapped or not), this rank's data, and
    optionally ``sync_grads`` (after the backward that ends a step: gradient averaging by
    hand), an ``optimizer`` or ``loss_fn`` of its own, ``after_step(i)`` (after the optimizer
    step: local SGD's and DiLoCo's averaging; it returns record columns), ``until()`` (True
    ends the run early) and ``steps`` (measured steps, if not ``cfg.steps``). Each step runs
    ``cfg.accumulate`` micro-batches, their losses scaled by 1/k; gradients are synchronised
    after the last one (DDP's ``no_sync()`` on the others) or after every one
    (``cfg.sync_every_microstep``); forward runs under ``cfg.precision``'s autocast.
    """
    loss_fn = loss_fn or fns.loss(cfg)  # a mean over the local batch; ranks then average grads
    optimizer = optimizer or fns.optimizer(cfg, model.parameters())
    amp = Amp(cfg.precision, ctx.device)
    seed_rank_streams(cfg, ctx)
    watch = (watch or Watch(cfg, ctx)).attach(model, optimizer, data, loss_fn, amp)
    k = cfg.accumulate
    for i in watch.steps(cfg.warmup + (cfg.steps if steps is None else steps)):
        if until is not None and i >= cfg.warmup and until():
            break
        losses = []
        for j in range(k):
            sync_now = j == k - 1 or cfg.sync_every_microstep
            with watch.phase("data"):
                x, y = next(data)
                x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with nullcontext() if sync_now or not hasattr(model, "no_sync") else model.no_sync():
                with watch.phase("forward", x, y), amp.autocast():
                    loss = loss_fn(model(x), y)
                with watch.phase("backward"):
                    amp.backward(loss / k if k > 1 else loss)
            with watch.phase("comm"):
                if sync_grads is not None and sync_now:
                    sync_grads()
            losses.append((loss.detach(), len(x)))
        with watch.phase("optimizer"):
            columns = amp.step(optimizer)
            if after_step is not None:  # before zero_grad: torch's averager skips grad-less
                with watch.phase("comm"):  # parameters
                    columns.update(after_step(i))
            optimizer.zero_grad(set_to_none=True)
        watch.step_end(losses, **columns)
    return watch.result(final_state(cfg, getattr(model, "module", model)))
