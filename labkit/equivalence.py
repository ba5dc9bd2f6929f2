"""Is a strategy the same computation as single-device training? ``check`` answers honestly.

Two kinds of layers make data parallelism a *different* computation, and no tolerance fixes
that: batch-statistics layers (BatchNorm) normalise each rank's shard with the shard's own
mean and variance, not the global batch's; and random layers (Dropout) draw different masks on
every rank (as they must) than single-device training draws for the same samples. ``check``
inspects the model first, then compares what must hold:

* batch statistics: the data-parallel strategies run with synchronised batch norm
  (``RunConfig.sync_batchnorm``: ``nn.SyncBatchNorm`` on GPUs, ``labkit.rank.syncbn`` over gloo on
  CPU ranks), which computes the global batch's statistics and so must match to ``tol``;
* randomness: masks cannot match, so dropout is switched off in every run; with it off, the
  rest of the model must match to ``tol``.

Parameters *and* buffers (running statistics, counters) are compared. The table says, per
strategy, what was compared and which adjustment applied, and why.

Equal computations still round differently (a sum over two ranks is not summed in the order of
one), by ~1e-7 a step. Training that is unstable at the chosen learning rate amplifies that
every step (resnet18 on noise images at lr 0.05: 4e-7, 2e-5, 1e-3 after 1, 2, 3 steps); check a
few steps at a learning rate where the model trains smoothly.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import torch
from torch import nn

from . import registry
from .config import RunConfig
from .env import cpu_cores, resolve_device
from .experiment import run
from .factories import Factories
from .registry import DATA_PARALLEL, PIPELINES

_DROPOUT = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.FeatureAlphaDropout,
)


def batch_stat_layers(model: nn.Module) -> list[str]:
    """Layers whose training output depends on the batch's statistics."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def random_layers(model: nn.Module) -> list[str]:
    """Layers that draw random numbers in training: dropout, and attention dropout."""
    return [
        n
        for n, m in model.named_modules()
        if (isinstance(m, _DROPOUT) and m.p > 0)
        or (isinstance(m, nn.MultiheadAttention) and m.dropout > 0)
    ]


def without_dropout(model_fn):
    """``model_fn`` with every dropout probability set to 0 (the model is otherwise unchanged)."""

    def build(cfg: RunConfig) -> nn.Module:
        model = Factories(model_fn).model(cfg)
        for m in model.modules():
            if isinstance(m, _DROPOUT):
                m.p = 0.0
            elif isinstance(m, nn.MultiheadAttention):
                m.dropout = 0.0
        return model

    return build


def check(
    base: RunConfig,
    strategies: Sequence[str],
    world_size: int = 2,
    *,
    steps: int = 5,
    tol: float = 1e-5,
    model_fn=None,
    data_fn=None,
    loss_fn=None,
    optimizer_fn=None,
) -> pd.DataFrame:
    """Train each strategy ``steps`` steps from the same weights on the same global batches and
    compare its final parameters and buffers with single-device training's."""
    strategies = [s for s in strategies if s != "single"]
    if base.rebalance == "join":
        raise ValueError(
            "rebalance='join' trains uneven inputs: ranks that ran out stop "
            "contributing, so the global batches differ from single-device "
            "training's by design; check static or dynamic shares instead"
        )
    cfg = base.replace(steps=steps, warmup=0, deterministic=True)
    for name in strategies:  # every config valid before anything runs
        config_for(cfg, name, world_size)
    model = Factories(model_fn).model(cfg)
    bn, rand = batch_stat_layers(model), random_layers(model)
    kwargs = dict(
        data_fn=data_fn,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        model_fn=without_dropout(model_fn) if rand else model_fn,
    )
    ref = run(reference_config(cfg), **kwargs).params
    rows = []
    for name in strategies:
        run_cfg, adjust, why = config_for(cfg, name, world_size), [], []
        ws = run_cfg.world_size
        if rand:
            adjust.append("dropout off")
            why.append(
                f"{len(rand)} random layer(s) ({_few(rand)}): each rank draws its own "
                f"masks, single draws others for the same samples; compared with p=0"
            )
        if bn and name in DATA_PARALLEL and ws > 1:
            run_cfg = run_cfg.replace(sync_batchnorm=True)
            kind = resolve_device(cfg.device, ws)
            adjust.append(
                "sync batchnorm (nn.SyncBatchNorm)"
                if kind == "cuda"
                else "sync batchnorm (labkit.rank.syncbn over gloo)"
            )
            why.append(
                f"{len(bn)} batch-norm layer(s) ({_few(bn)}): per-rank batch statistics "
                f"differ from the global batch's; synchronised, they are the same"
            )
        elif bn and name in PIPELINES and cfg.microbatches > 1 and name != "model_parallel":
            why.append(
                f"batch norm normalises each micro-batch on its own, single the whole "
                f"batch: not the same computation at M={cfg.microbatches} (use M=1, or "
                f"LayerNorm/GroupNorm)"
            )
        result = run(run_cfg, **kwargs)
        got = result.params
        if result.records["oversubscribed"].any():
            why.append(
                f"{run_cfg.ranks} ranks on {cpu_cores()} cores, oversubscribed: they take "
                f"turns on the cores, which changes their timing, not what they compute"
            )
        if set(got) != set(ref):
            raise AssertionError(
                f"{name} returned state {sorted(set(got) ^ set(ref))} that "
                f"single does not have (or lacks it)"
            )
        param_names = {n for n, _ in model.named_parameters()}
        rows.append(
            {
                "strategy": name,
                "world_size": ws,
                "steps": steps,
                "compared": "parameters + buffers" if len(got) > len(param_names) else "parameters",
                "adjustments": ", ".join(adjust) or "none",
                "max_abs_diff": _max_diff(got, ref),
                "max_buffer_diff": _max_diff(got, ref, set(got) - param_names),
                "tol": tol,
                "why": "; ".join(why),
            }
        )
        rows[-1]["ok"] = rows[-1]["max_abs_diff"] <= tol
    table = pd.DataFrame(rows)
    table["noise_floor"] = float("nan")
    if not table["ok"].all():  # is it the strategy, or training amplifying rounding?
        table = _judge_against_noise(table, cfg, ref, kwargs, steps, tol)
    return table


# Rounding-level: one float32 ulp (2^-23) of each initial weight, relative.
NUDGE = 2.0**-23


def _judge_against_noise(table, cfg, ref, kwargs, steps, tol) -> pd.DataFrame:
    """The noise floor: single-device training again from weights nudged by one float32 ulp;
    how far it ends from the reference is how far rounding alone carries after ``steps`` steps.
    A row above ``tol`` but within twice that floor cannot be told from rounding: it passes, and
    says so; a row above both fails, and says the floor it was compared with."""
    nudged = run(reference_config(cfg), **{**kwargs, "model_fn": _nudged(kwargs["model_fn"])})
    nudged = nudged.params
    floor = _max_diff(nudged, ref)
    table["noise_floor"] = floor
    for i, row in table[~table["ok"]].iterrows():
        if floor > tol and row["max_abs_diff"] <= 2 * floor:
            note = (
                f"training amplifies rounding: single-device training from weights nudged by "
                f"one float32 ulp ends {floor:.2g} from itself after {steps} steps, and this is "
                f"within 2x of that; to check more tightly, use fewer steps or a smaller lr"
            )
            table.loc[i, "ok"] = True
        else:
            note = f"differs beyond rounding (the noise floor after {steps} steps is {floor:.2g})"
        table.loc[i, "why"] = "; ".join(filter(None, [row["why"], note]))
    return table


def _nudged(model_fn):
    def build(cfg):
        model = Factories(model_fn).model(cfg)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * p.abs() * NUDGE)
        return model

    return build


def reference_config(cfg: RunConfig) -> RunConfig:
    """Plain single-device training on the whole global batch: no accumulation (a strategy's
    accumulate=k must reach the same parameters), no compression, no tensor split or sharding
    and no load balancing (any shares of the global batch must reach the same parameters)."""
    return cfg.replace(
        strategy="single",
        world_size=1,
        accumulate=1,
        comm_hook="none",
        tp=None,
        sequence_parallel=False,
        shard_size=None,
        sync_every_microstep=False,
        slowdown=(),
        skew=0.0,
        rebalance="static",
    )


def config_for(cfg: RunConfig, name: str, world_size: int) -> RunConfig:
    """``cfg`` for strategy ``name`` in one check of several: the tensor-parallel degree is a
    knob of the strategies that split layers (the shard size, of hsdp alone), so one that does
    not take it drops it (``check --strategies dp_tp,dp_pp --tp 2 --stages 2``)."""
    knobs = registry.get(name).knobs
    layout = {} if "tp" in knobs else dict(tp=None, sequence_parallel=False)
    if "shard_size" not in knobs:
        layout["shard_size"] = None
    return cfg.replace(
        strategy=name, world_size=world_size_for(name, world_size, cfg.stages), **layout
    )


def world_size_for(name: str, world_size: int, stages: int) -> int:
    """The ranks ``check`` runs ``name`` on: a pipeline has one per stage, the rest
    ``world_size``."""
    if name == "single":
        return 1
    return stages if name in PIPELINES else world_size


def _max_diff(got: dict, ref: dict, keys=None) -> float:
    keys = ref.keys() if keys is None else keys
    diffs = [(got[k].double() - ref[k].double()).abs().max().item() for k in keys if ref[k].numel()]
    return max(diffs, default=0.0)


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", +{len(names) - n} more" if len(names) > n else "")
