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

Equal computations still round differently (a sum over two ranks is not added in the order of
one): by about one float32 ulp a step. Training that is unstable at its learning rate amplifies
that every step, and after a few steps of a deep network with batch norm at a large learning rate
no float32 tolerance tells it from a real difference. So a row above ``tol`` in float32 is trained
again, single-device training too, in float64 (parameters, buffers and inputs cast to double on
every rank): rounding there is 2^-52 of a value instead of 2^-23, so whatever training amplifies
from it shrinks 2^29 (5e8) times, while a different computation (a batch statistic each rank takes
of its own shard, a gradient summed instead of averaged) differs as much as before. The float64
row is held to the same ``tol``, the verdict; the table's ``compared_in`` says which dtype gave it
and ``float32_diff`` keeps the float32 difference beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch
from torch import nn
from torch.utils.data import Dataset

from .. import registry
from ..config import RunConfig
from ..env import cpu_cores, resolve_device
from ..experiment import run
from ..factories import Factories
from ..registry import DATA_PARALLEL, PIPELINES

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


def in_float64(model_fn, data_fn):
    """``model_fn`` and ``data_fn`` in float64: the model's floating-point parameters and buffers,
    and every floating-point tensor a sample holds, cast to double (integer targets stay)."""

    def model(cfg: RunConfig) -> nn.Module:
        model = Factories(model_fn).model(cfg)
        for module in model if isinstance(model, (list, tuple)) else [model]:  # stages
            module.double()
        return model

    def data(cfg: RunConfig) -> Dataset:
        return _Float64(Factories(data_fn=data_fn).dataset(cfg))

    return model, data


class _Float64(Dataset):
    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return tuple(
            t.double() if torch.is_tensor(t) and t.is_floating_point() else t
            for t in self.dataset[i]
        )


COMPARE_IN = ("auto", "float32", "float64")


def check(
    base: RunConfig,
    strategies: Sequence[str],
    world_size: int = 2,
    *,
    steps: int = 5,
    tol: float = 1e-5,
    compare_in: str = "auto",
    model_fn=None,
    data_fn=None,
    loss_fn=None,
    optimizer_fn=None,
) -> pd.DataFrame:
    """Train each strategy ``steps`` steps from the same weights on the same global batches and
    compare its final parameters and buffers with single-device training's.

    ``compare_in="auto"`` compares in float32 and trains a row above ``tol`` again in float64,
    which gives its verdict (see the module's docstring); ``"float32"`` or ``"float64"``
    compares every row in that dtype alone. ``max_abs_diff`` and ``max_buffer_diff`` are in the
    row's ``compared_in`` dtype, ``ok`` is ``max_abs_diff <= tol``."""
    if compare_in not in COMPARE_IN:
        raise ValueError(f"compare_in must be one of {COMPARE_IN}, got {compare_in!r}")
    strategies = [s for s in strategies if s != registry.REFERENCE]
    if base.rebalance == "join":
        raise ValueError(
            "rebalance='join' trains uneven inputs: ranks that ran out stop "
            "contributing, so the global batches differ from single-device "
            "training's by design; check static or dynamic shares instead"
        )
    cfg = base.replace(steps=steps, warmup=0, deterministic=True)
    if cfg.experts and cfg.expert_groups is None:  # a mixture of experts' capacity is counted
        cfg = cfg.replace(expert_groups=world_size)  # per token group: single uses the ranks'
    for name in strategies:  # every config valid before anything runs
        config_for(cfg, name, world_size)
    if compare_in == "float64":
        _refuse_float64(cfg, strategies)
    model = Factories(model_fn).model(cfg)
    bn, rand = batch_stat_layers(model), random_layers(model)
    param_names = {n for n, _ in model.named_parameters()}
    kwargs = dict(
        data_fn=data_fn,
        loss_fn=loss_fn,
        optimizer_fn=optimizer_fn,
        model_fn=without_dropout(model_fn) if rand else model_fn,
    )
    plans = {name: _plan(cfg, name, world_size, bn, rand) for name in strategies}
    dtype = "float64" if compare_in == "float64" else "float32"
    diffs = _compare(cfg, plans, kwargs, dtype, param_names)
    rows = []
    for name, (run_cfg, adjust, why) in plans.items():
        diff, buffer_diff, oversubscribed = diffs[name]
        if oversubscribed:
            why.append(
                f"{run_cfg.ranks} ranks on {cpu_cores()} cores, oversubscribed: they take "
                f"turns on the cores, which changes their timing, not what they compute"
            )
        rows.append(
            {
                "strategy": name,
                "world_size": run_cfg.world_size,
                "steps": steps,
                "compared": "parameters + buffers" if buffer_diff is not None else "parameters",
                "adjustments": ", ".join(adjust) or "none",
                "float32_diff": diff if dtype == "float32" else float("nan"),
                "compared_in": dtype,
                "max_abs_diff": diff,
                "max_buffer_diff": 0.0 if buffer_diff is None else buffer_diff,
                "tol": tol,
                "ok": diff <= tol,
                "why": why,
            }
        )
    table = pd.DataFrame(rows)
    if compare_in == "auto" and not table["ok"].all():
        _again_in_float64(table, cfg, plans, kwargs, param_names, tol)
    table["why"] = table["why"].map("; ".join)
    return table


def _plan(cfg: RunConfig, name: str, world_size: int, bn: list, rand: list):
    """``name``'s config in this check, the adjustments made to it and why."""
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
    elif bn and name in PIPELINES and cfg.microbatches > 1 and _micro_batched(name):
        why.append(
            f"batch norm normalises each micro-batch on its own, single the whole "
            f"batch: not the same computation at M={cfg.microbatches} (use M=1, or "
            f"LayerNorm/GroupNorm)"
        )
    return run_cfg, adjust, why


def _compare(cfg: RunConfig, plans: dict, kwargs: dict, dtype: str, param_names: set) -> dict:
    """Single-device training, then each planned strategy, in ``dtype``: per strategy, its
    largest difference from single over parameters and buffers, over buffers alone (None when
    the model has none), and whether its ranks were oversubscribed."""
    if dtype == "float64":
        model_fn, data_fn = in_float64(kwargs["model_fn"], kwargs["data_fn"])
        kwargs = {**kwargs, "model_fn": model_fn, "data_fn": data_fn}
    ref = run(reference_config(cfg), **kwargs).params
    out = {}
    for name, (run_cfg, _, _) in plans.items():
        result = run(run_cfg, **kwargs)
        got = result.params
        if set(got) != set(ref):
            raise AssertionError(
                f"{name} returned state {sorted(set(got) ^ set(ref))} that "
                f"single does not have (or lacks it)"
            )
        buffers = set(got) - param_names
        out[name] = (
            _max_diff(got, ref),
            _max_diff(got, ref, buffers) if buffers else None,
            bool(result.records["oversubscribed"].any()),
        )
    return out


def _again_in_float64(table, cfg, plans, kwargs, param_names, tol) -> None:
    """The rows above ``tol`` in float32, trained again with single in float64, which gives
    their verdict: rounding amplified by training shrinks 2^29 times there, a different
    computation does not. Rows that cannot run in float64 keep float32's verdict, saying why."""
    failed = table.index[~table["ok"]]
    reasons = {i: _float64_blocked(cfg, table.loc[i, "strategy"]) for i in failed}
    blocked = {i: reason for i, reason in reasons.items() if reason}
    for i, reason in blocked.items():
        table.loc[i, "why"].append(f"not compared in float64: {reason}")
    again = [i for i in failed if i not in blocked]
    if not again:
        return
    names = {table.loc[i, "strategy"]: i for i in again}
    diffs = _compare(cfg, {n: plans[n] for n in names}, kwargs, "float64", param_names)
    for name, i in names.items():
        f32 = table.loc[i, "float32_diff"]
        diff, buffer_diff, _ = diffs[name]
        table.loc[i, ["compared_in", "max_abs_diff", "max_buffer_diff", "ok"]] = [
            "float64",
            diff,
            0.0 if buffer_diff is None else buffer_diff,
            diff <= tol,
        ]
        if not (math.isfinite(f32) and math.isfinite(diff)):
            note = (
                f"training diverged ({f32:.2g} apart in float32, {diff:.2g} in float64: a "
                f"parameter is not finite): no verdict; lower the learning rate"
            )
        elif diff <= tol:
            note = (
                f"training amplifies rounding: {f32:.2g} apart in float32, {diff:.2g} in "
                f"float64, where rounding is 2^29 times finer: the same computation"
            )
        else:
            note = (
                f"differs beyond rounding: {f32:.2g} apart in float32 and still {diff:.2g} in "
                f"float64, where rounding is 2^29 times finer"
            )
        table.loc[i, "why"].append(note)
    table["ok"] = table["ok"].astype(bool)


def _float64_blocked(cfg: RunConfig, name: str) -> str:
    """Why ``name`` cannot be compared in float64 under ``cfg`` ('' when it can)."""
    if cfg.precision != "fp32":
        return (
            f"precision={cfg.precision!r} computes in 16 bits under autocast, which leaves "
            f"float64 tensors alone, so a float64 run would not check what runs"
        )
    return registry.get(name).float32_only


def _refuse_float64(cfg: RunConfig, strategies: Sequence[str]) -> None:
    for name in strategies:
        reason = _float64_blocked(cfg, name)
        if reason:
            raise ValueError(f"{name} cannot be compared in float64: {reason}")


def reference_config(cfg: RunConfig) -> RunConfig:
    """Plain single-device training on the whole global batch: no accumulation (a strategy's
    accumulate=k must reach the same parameters), no compression, no tensor split or sharding
    and no load balancing (any shares of the global batch must reach the same parameters)."""
    return cfg.replace(
        strategy=registry.REFERENCE,
        world_size=1,
        accumulate=1,
        comm_hook="none",
        tp=None,
        sequence_parallel=False,
        shard_size=None,
        ep=None,
        **_NO_CONTEXT_SPLIT,
        sync_every_microstep=False,
        slowdown=(),
        skew=0.0,
        rebalance="static",
    )


# no sequence split: the cp knobs at their defaults (a strategy that does not split the sequence)
_NO_CONTEXT_SPLIT = {
    "cp": None,
    "cp_layout": RunConfig.__dataclass_fields__["cp_layout"].default,
}


def config_for(cfg: RunConfig, name: str, world_size: int) -> RunConfig:
    """``cfg`` for strategy ``name`` in one check of several: the tensor-parallel degree is a
    knob of the strategies that split layers (the shard size, of hsdp alone), so one that does
    not take it drops it (``check --strategies dp_tp,dp_pp --tp 2 --stages 2``)."""
    knobs = registry.get(name).knobs
    layout = {} if "tp" in knobs else dict(tp=None, sequence_parallel=False)
    if "shard_size" not in knobs:
        layout["shard_size"] = None
    if "cp" not in knobs:  # the context-parallel degree and placement, of the cp strategies
        layout.update(_NO_CONTEXT_SPLIT)
    if "ep" not in knobs:  # the expert-parallel degree, of ep alone
        layout["ep"] = None
    return cfg.replace(
        strategy=name, world_size=world_size_for(name, world_size, cfg.stages), **layout
    )


def world_size_for(name: str, world_size: int, stages: int) -> int:
    """The ranks ``check`` runs ``name`` on: a pipeline has one per stage, the rest
    ``world_size``."""
    if registry.get(name).reference:
        return 1
    return stages if name in PIPELINES else world_size


def _max_diff(got: dict, ref: dict, keys=None) -> float:
    keys = ref.keys() if keys is None else keys
    diffs = [(got[k].double() - ref[k].double()).abs().max().item() for k in keys if ref[k].numel()]
    return max(diffs, default=0.0)


def _micro_batched(name: str) -> bool:
    """A pipeline whose schedule splits the batch (model parallelism runs it whole)."""
    return registry.get(name).schedule != "model_parallel"


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", +{len(names) - n} more" if len(names) > n else "")
