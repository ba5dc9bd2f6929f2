"""Where every byte goes, per rank: the counts the training loop took (``labkit.rank.memory_meter``)
in tables, beside the calculator's prediction (``labkit.predict.memory``), and runs that measure
them.

Five categories, the ones the ZeRO paper (Rajbhandari et al., 2020, arXiv:1910.02054) reasons
with: ``params``, ``grads``, ``optimizer``, ``activations`` and ``rest`` (the batch, parameter
copies autograd saved, buffers). ``labkit.rank.memory_meter`` says exactly what each counts.
"""

from __future__ import annotations

import math

import pandas as pd
import torch
from torch import nn

from .. import experiment, registry
from ..models import make_model
from ..predict.memory import CATEGORIES, STRATEGIES, calculate
from ..rank.memory_meter import COLUMNS
from ..records import config_label, labels

# ---- tables ------------------------------------------------------------------------------------


def memory_table(records) -> pd.DataFrame:
    """Per run and rank: each category (MiB, the largest over measured steps), their sum, and
    the process high-water mark beside it (``peak_mem_bytes``: RSS on CPU, allocator on GPU)."""
    if "threads" not in records:
        records = records.assign(threads=1)
    records = records.assign(variant=records["variant"].fillna("") if "variant" in records else "")
    keys = ["strategy", "world_size", "threads", "variant", "rank"]
    t = records.groupby(keys, sort=False)[list(COLUMNS) + ["peak_mem_bytes"]].max().reset_index()
    out = pd.DataFrame({"run": labels(t), "rank": t["rank"].astype(int)})
    for c, col in zip(CATEGORIES, COLUMNS):
        out[f"{c}_mib"] = t[col] / 2**20
    out["counted_mib"] = t[list(COLUMNS)].sum(axis=1) / 2**20
    out["high_water_mib"] = t["peak_mem_bytes"] / 2**20
    return out


def predict(
    cfg,
    optimizer: str = "sgd_momentum",
    model: nn.Module | None = None,
    input_shape: tuple | None = None,
) -> pd.DataFrame:
    """The calculator's bytes per rank for a run of ``cfg`` (labkit's toy model, or yours with
    its one-sample ``input_shape``)."""
    _check_calculated([cfg.strategy])
    if model is None:
        model = make_model(cfg)
        input_shape = (3, 16, 16) if cfg.model == "cnn" else (cfg.in_features,)
    return calculate(
        model,
        input_shape=input_shape,
        classes=cfg.classes,
        global_batch=cfg.global_batch,
        strategy=cfg.strategy,
        world_size=cfg.ranks,
        precision=cfg.precision,
        optimizer=optimizer,
        checkpoint=cfg.activation_checkpointing,
        accumulate=cfg.accumulate,
        shard_size=cfg.shard_group if "shard_size" in registry.get(cfg.strategy).knobs else None,
    )


def calculator_error(records, cfg, optimizer: str = "sgd_momentum", **model) -> pd.DataFrame:
    """Counted against calculated, per rank and category: bytes and the relative error."""
    pred = predict(cfg, optimizer, **model).set_index("rank")
    got = records.groupby("rank")[list(COLUMNS)].max()
    rows = []
    for rank in got.index:
        for c, col in zip(CATEGORIES, COLUMNS):
            m, p = int(got.at[rank, col]), int(pred.at[rank, c])
            rows.append(
                {
                    "rank": int(rank),
                    "category": c,
                    "counted": m,
                    "calculated": p,
                    "error": (p - m) / m if m else (0.0 if p == 0 else math.inf),
                }
            )
    return pd.DataFrame(rows)


def adam(cfg, params) -> torch.optim.Adam:
    """The optimizer_fn for Adam runs (importable, so rank processes can load it)."""
    return torch.optim.Adam(params, lr=cfg.lr * 0.02)  # SGD's lr is too large for Adam


def measure(
    base,
    strategies=("ddp", "zero1", "fsdp"),
    world_sizes=(2,),
    optimizer: str = "sgd_momentum",
    on_result=None,
):
    """Run each strategy at each world size; return (records, calculator errors per run,
    rank and category). ``optimizer``: "sgd_momentum" (labkit's) or "adam"."""
    if optimizer not in ("sgd_momentum", "adam"):
        raise ValueError(f"optimizer must be sgd_momentum or adam, got {optimizer!r}")
    _check_calculated(strategies)
    cfgs = [
        base.replace(strategy=s, world_size=w)
        for s in strategies
        for w in ((1,) if registry.get(s).reference else world_sizes)
    ]
    results, errors = [], []
    for cfg in cfgs:
        res = experiment.run(cfg, optimizer_fn=adam if optimizer == "adam" else None)
        results.append(res)
        err = calculator_error(res.records, cfg, optimizer)
        errors.append(err.assign(run=config_label(cfg)))
        if on_result is not None:
            on_result(res)
    return experiment.combine(results), pd.concat(errors, ignore_index=True)


def _check_calculated(strategies) -> None:
    """Refuse, before anything runs, a strategy whose memory the calculator does not model."""
    other = [s for s in strategies if s not in STRATEGIES]
    if other:
        raise ValueError(
            f"the memory calculator models {', '.join(STRATEGIES)}; not {', '.join(other)}: "
            "choose among those"
        )
