"""Layer timing inside a rank: the compute profile the step-time predictor reads, and the
per-block costs that balance pipeline stages.

``profile_rank`` runs on every rank that ``labkit.labs.compute_profile.measure`` launches (see
there for what a profile holds and why it is taken on concurrent ranks); ``layer_costs`` times
each block of a model on its real input shapes, for ``labkit.models.partition``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..data import batches, shard_loader
from ..dist import RankContext
from ..env import cpu_cores
from ..factories import Factories
from ..predict.step import Layer, Profile
from .probes import sync

AFTER_WAIT_GAPS = (0.0005, 0.002, 0.008, 0.032)  # seconds idle before a step


def profile_rank(
    ctx: RankContext, cfg: RunConfig, fns: Factories, batch: int, repeats: int = 7
) -> Profile:
    torch.manual_seed(cfg.seed)
    model = fns.model(cfg).to(ctx.device)
    dataset = fns.dataset(cfg)
    loss_fn, optimizer = fns.loss(cfg), fns.optimizer(cfg, model.parameters())
    blocks = list(model) if isinstance(model, nn.Sequential) else [model]
    names = (
        [f"{i}: {type(b).__name__}" for i, b in enumerate(blocks)]
        if isinstance(model, nn.Sequential)
        else [type(model).__name__]
    )
    data = batches(shard_loader(dataset, batch, ctx.rank, ctx.world_size, seed=cfg.seed))

    def next_batch():
        return next(data)

    x, y = (t.to(ctx.device) for t in next_batch())
    spread: list[float] = []
    phases = step_phases(model, loss_fn, optimizer, next_batch, ctx.device, repeats, spread=spread)
    warm = sum(phases.values())
    after_wait = tuple(
        (
            gap,
            max(
                0.0,
                sum(
                    step_phases(
                        model,
                        loss_fn,
                        optimizer,
                        next_batch,
                        ctx.device,
                        max(3, repeats - 2),
                        gap_s=gap,
                    ).values()
                )
                - warm,
            ),
        )
        for gap in AFTER_WAIT_GAPS
    )
    full = block_times(blocks, loss_fn, x, y, ctx.device, repeats)
    hb = max(1, batch // 2)
    half = block_times(blocks, loss_fn, x[:hb], y[:hb], ctx.device, repeats) if batch >= 2 else full
    flops = block_flops(blocks, x[:1])
    # isolated blocks say how a step's time divides among them; whole steps say how long it is
    # (one autograd call per block costs more than one for the model)
    fscale = phases["forward"] / max(1e-12, sum(f for f, _, _ in full))
    bscale = phases["backward"] / max(1e-12, sum(b for _, b, _ in full))
    layers = []
    for i, block in enumerate(blocks):
        (f, b, out_bytes), (fh, bh, _) = full[i], half[i]
        layers.append(
            Layer(
                names[i],
                f * fscale,
                b * bscale,
                tuple(p.numel() * p.element_size() for p in block.parameters() if p.requires_grad),
                activation_bytes=out_bytes / batch,
                flops=flops[i],
                forward_fixed_s=_intercept(f, fh, batch, hb) * fscale,
                backward_fixed_s=_intercept(b, bh, batch, hb) * bscale,
            )
        )
    ddp_overhead = (
        ddp_overhead_s(model, loss_fn, x, y, ctx, phases, repeats) if ctx.distributed else 0.0
    )
    comm_spread = (
        all_reduce_spread(model, loss_fn, next_batch, ctx) if ctx.distributed else (1.0, 1.0)
    )
    return Profile(
        batch,
        tuple(layers),
        optimizer_s=phases["optimizer"],
        data_s=phases["data"],
        ddp_overhead_s=ddp_overhead,
        threads=torch.get_num_threads(),
        device=str(ctx.device),
        comm_shares_core=shares_core(ctx),
        after_wait_s=after_wait,
        compute_spread=tuple(spread),
        comm_spread=comm_spread,
        source=f"measured on {ctx.world_size} concurrent rank(s), "
        f"{torch.get_num_threads()} thread(s) each",
    )


def shares_core(ctx: RankContext) -> bool:
    """Whether this rank's communication has to take turns with its compute for a core: on CPU
    when the ranks' compute threads already fill every core (gloo's threads then run on a core
    some rank is computing on)."""
    return ctx.device.type == "cpu" and ctx.world_size * torch.get_num_threads() >= cpu_cores()


def step_phases(
    model,
    loss_fn,
    optimizer,
    next_batch,
    device,
    repeats: int,
    gap_s: float = 0.0,
    spread: list | None = None,
) -> dict:
    """Median seconds of each phase of a plain training step, timed as the training loop does;
    with ``gap_s``, each step after sleeping that long (as after waiting for a peer). Given a
    list ``spread``, the 10th and 90th percentiles of forward + backward over their median are
    appended to it."""
    names = ("data", "forward", "backward", "optimizer")
    samples = {k: [] for k in names}
    for r in range(repeats + 2):
        if gap_s:
            time.sleep(gap_s)
        marks = [time.perf_counter()]
        x, y = (t.to(device) for t in next_batch())
        sync(device)
        marks.append(time.perf_counter())
        loss = loss_fn(model(x), y)
        sync(device)
        marks.append(time.perf_counter())
        loss.backward()
        sync(device)
        marks.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        sync(device)
        marks.append(time.perf_counter())
        if r >= 2:
            for k, t0, t1 in zip(names, marks, marks[1:]):
                samples[k].append(t1 - t0)
    if spread is not None:  # forward + backward's 10th and 90th percentiles over its median
        compute = [f + b for f, b in zip(samples["forward"], samples["backward"])]
        q = statistics.quantiles(compute, n=10) if len(compute) >= 2 else [compute[0]] * 9
        mid = statistics.median(compute)
        spread.extend((q[0] / mid, q[-1] / mid) if mid > 0 else (1.0, 1.0))
    return {k: statistics.median(v) for k, v in samples.items()}


def all_reduce_spread(
    model, loss_fn, next_batch, ctx: RankContext, blocks: int = 8, calls: int = 6
) -> tuple[float, float]:
    """How much the gradient all-reduce's time moves on this machine: a step's forward and
    backward, then one all-reduce of every gradient (DDP's single bucket), ``calls`` times per
    block; the 10th and 90th percentile of the blocks' medians over their median. Blocks, not
    calls: a run's median step moves with the all-reduce's slow drift
    (``benchmarks/comm_drift.py``), not with one call's noise."""
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=ctx.device)
    medians = []
    for b in range(blocks + 1):
        times = []
        for _ in range(calls):
            x, y = (t.to(ctx.device) for t in next_batch())
            loss_fn(model(x), y).backward()
            model.zero_grad(set_to_none=True)
            sync(ctx.device)
            t0 = time.perf_counter()
            dist.all_reduce(flat)
            sync(ctx.device)
            times.append(time.perf_counter() - t0)
        if b:  # the first block warms connections and buffers
            medians.append(statistics.median(times))
    q, mid = statistics.quantiles(medians, n=10), statistics.median(medians)
    return (q[0] / mid, q[-1] / mid) if mid > 0 else (1.0, 1.0)


def ddp_overhead_s(model, loss_fn, x, y, ctx: RankContext, phases: dict, repeats: int) -> float:
    """What DDP's own machinery adds to a forward + backward on this rank: preparing backward,
    copying gradients into buckets and back, calling a communication hook per bucket. Timed
    with a hook that communicates nothing (the all-reduce is the network model's part); under
    ``no_sync()`` the copies and the hook calls would be missing (~10 % of the default MLP's
    step, measured)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model, device_ids=ctx.device_ids)

    def no_comm(state, bucket):  # labkit's timed all-reduce minus the all-reduce
        fut = torch.futures.Future()  # (which also takes the mean: ReduceOp.AVG)
        fut.set_result(bucket.buffer())
        return fut

    wrapped.register_comm_hook(None, no_comm)

    def fb():
        loss_fn(wrapped(x), y).backward()

    t = _median(fb, ctx.device, repeats)
    wrapped.zero_grad(set_to_none=True)
    return max(0.0, t - phases["forward"] - phases["backward"])


def block_times(blocks, loss_fn, x, y, device, repeats: int) -> list[tuple[float, float, int]]:
    """Median (forward s, backward s, output bytes) per block; the loss counts to the last."""
    samples = [[] for _ in blocks]
    for r in range(repeats + 2):  # two warm-up rounds
        inputs, outputs, h = [], [], x
        for i, block in enumerate(blocks):
            inp = h.detach().requires_grad_(i > 0 and h.is_floating_point())
            sync(device)
            t0 = time.perf_counter()
            out = block(inp)
            if i == len(blocks) - 1:
                out = loss_fn(out, y)
            sync(device)
            t1 = time.perf_counter()
            inputs.append(inp)
            outputs.append(out)
            if r >= 2:
                samples[i].append([t1 - t0, 0.0, out.numel() * out.element_size()])
            h = out
        grad = None
        for i in reversed(range(len(blocks))):
            sync(device)
            t0 = time.perf_counter()
            outputs[i].backward(grad)
            sync(device)
            if r >= 2:
                samples[i][-1][1] = time.perf_counter() - t0
            grad = inputs[i].grad
        for block in blocks:
            block.zero_grad(set_to_none=True)
    # the last block's output bytes: its logits, not the scalar loss
    return [
        (statistics.median(s[0] for s in rows), statistics.median(s[1] for s in rows), rows[0][2])
        for rows in samples
    ]


def block_flops(blocks, x1: torch.Tensor) -> list[float]:
    """Forward matmul FLOPs per sample of each block (Linear and Conv layers; others 0)."""
    counts = [0.0] * len(blocks)
    current = [0]

    def hook(mod, inputs, out):
        if isinstance(mod, nn.Linear):
            counts[current[0]] += (
                2.0 * mod.in_features * mod.out_features * out.numel() / out.shape[-1]
            )
        elif isinstance(mod, nn.modules.conv._ConvNd):
            k = mod.weight[0].numel()  # in_channels/groups * kernel elements
            counts[current[0]] += 2.0 * k * out.numel()

    handles = [
        m.register_forward_hook(hook)
        for b in blocks
        for m in b.modules()
        if isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))
    ]
    try:
        with torch.no_grad():
            h = x1
            for i, block in enumerate(blocks):
                current[0] = i
                h = block(h)
    finally:
        for handle in handles:
            handle.remove()
    return counts


def layer_costs(
    model: nn.Sequential, example: torch.Tensor, repeats: int = 5, warmup: int = 2
) -> list[float]:
    """Median forward+backward seconds of each block of ``model`` on the real input shapes."""
    costs, x = [], example.detach()
    for block in model:
        times = []
        for i in range(warmup + repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            sync(inp.device)
            t0 = time.perf_counter()
            out = block(inp)
            out.float().sum().backward()
            sync(inp.device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        block.zero_grad(set_to_none=True)
        costs.append(statistics.median(times))
        x = out.detach()
    return costs


def _intercept(t_full: float, t_half: float, b_full: int, b_half: int) -> float:
    """Where the line through (b_half, t_half), (b_full, t_full) meets batch 0, kept in
    [0, t_full]."""
    if b_full == b_half:
        return 0.0
    slope = (t_full - t_half) / (b_full - b_half)
    return min(max(0.0, t_full - slope * b_full), t_full)


def _median(fn, device, repeats: int) -> float:
    times = []
    for r in range(repeats + 2):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if r >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
