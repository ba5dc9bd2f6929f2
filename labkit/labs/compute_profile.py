"""Measure a model's compute profile, the input of the step-time predictor
(``labkit.predict.step``).

Per block (each child of an ``nn.Sequential``; a model of another shape is one block): forward
and backward seconds at the per-rank batch and at half of it (a line through both is how the
predictor scales to other batches), gradient bytes per parameter tensor, output bytes and
matmul FLOPs per sample; plus the optimizer step and the data loader per step.

It is measured the way the prediction will be used: on ``world_size`` rank processes computing
at once with the threads each rank gets in a run (two ranks on two cores slow each other down
through shared caches and memory bandwidth; a profile of one quiet process would not see it).
The ranks do not communicate while profiling.

A step that follows a wait computes more slowly than one that follows another step: while a
rank sleeps in a collective its core idles, and what it computes next finds colder caches (and,
in a virtual machine, a virtual CPU the host may have descheduled; how much: benchmarks/
README.md, "Behind the code"). So the profile also times whole steps after sleeping
``AFTER_WAIT_GAPS`` seconds (``after_wait_s``), and the predictor adds the extra for the wait
it predicts.
"""

from __future__ import annotations

import statistics

from ..config import RunConfig
from ..env import cpu_cores, resolve_device
from ..factories import Factories, validate
from ..launch import launch
from ..predict.step import Layer, Profile
from ..rank.layer_timing import profile_rank


def measure(
    cfg: RunConfig,
    *,
    world_size: int | None = None,
    model_fn=None,
    data_fn=None,
    loss_fn=None,
    optimizer_fn=None,
    repeats: int = 7,
    cancel=None,
) -> Profile:
    """The profile of ``cfg``'s model at ``cfg.global_batch / (world_size * cfg.accumulate)``
    samples per rank, on ``world_size`` (default ``cfg.world_size``) concurrent ranks."""
    fns = Factories(model_fn, data_fn, loss_fn, optimizer_fn)
    validate(cfg, fns)
    n = world_size or cfg.world_size
    kind = resolve_device(cfg.device, n)
    threads = cfg.threads or (max(1, cpu_cores() // n) if kind == "cpu" else 1)
    batch = max(1, cfg.global_batch // (n * cfg.accumulate))
    results = launch(
        profile_rank,
        n,
        args=(cfg, fns, batch, repeats),
        device=kind,
        threads=threads,
        timeout_s=cfg.timeout_s,
        cancel=cancel,
    )
    return average(results)


def flops_per_sample(cfg: RunConfig, model_fn=None, data_fn=None) -> tuple[float, float]:
    """(forward, backward) FLOPs of one sample through ``cfg``'s model, counted by torch's
    ``FlopCounterMode`` (matmuls and convolutions) on the meta device: from the shapes alone,
    nothing is allocated or computed, so a model too large to run is counted in milliseconds."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    fns = Factories(model_fn, data_fn)
    x = fns.dataset(cfg.replace(dataset_size=cfg.global_batch))[0][0]
    with torch.device("meta"):
        model = fns.model(cfg)
    inp = torch.empty((1, *x.shape), dtype=x.dtype, device="meta")
    with FlopCounterMode(display=False) as forward:
        out = model(inp)
    with FlopCounterMode(display=False) as backward:
        out.float().sum().backward()
    return float(forward.get_total_flops()), float(backward.get_total_flops())


def average(profiles: list[Profile]) -> Profile:
    """One profile from every rank's: the mean of each time."""
    first = profiles[0]

    def mean(get) -> float:
        return statistics.fmean(get(p) for p in profiles)

    def layer_mean(i: int, attr: str) -> float:
        return mean(lambda p: getattr(p.layers[i], attr))

    layers = tuple(
        Layer(
            layer.name,
            layer_mean(i, "forward_s"),
            layer_mean(i, "backward_s"),
            layer.grad_bytes,
            layer.activation_bytes,
            layer.flops,
            layer_mean(i, "forward_fixed_s"),
            layer_mean(i, "backward_fixed_s"),
        )
        for i, layer in enumerate(first.layers)
    )
    return Profile(
        first.batch,
        layers,
        mean(lambda p: p.optimizer_s),
        mean(lambda p: p.data_s),
        mean(lambda p: p.ddp_overhead_s),
        first.threads,
        first.device,
        first.source,
        first.comm_shares_core,
        tuple(
            (gap, statistics.fmean(p.after_wait_s[i][1] for p in profiles))
            for i, (gap, _) in enumerate(first.after_wait_s)
        ),
        # the widest any rank saw: a step waits for its slowest rank
        (min(p.compute_spread[0] for p in profiles), max(p.compute_spread[1] for p in profiles)),
        (min(p.comm_spread[0] for p in profiles), max(p.comm_spread[1] for p in profiles)),
    )
