"""Where every byte goes: memory per rank by category, counted from live tensor storage.

Five categories, the ones the ZeRO paper (Rajbhandari et al., 2020, arXiv:1910.02054) reasons
with:

* ``params``: this rank's parameter storage (FSDP: its shard; DDP and ZeRO-1: all of it);
* ``grads``: gradient storage just before the optimizer step (FSDP: the sharded gradients);
* ``optimizer``: tensors in the optimizer's state after a step (momentum, Adam's two moments;
  ZeRO-1 and FSDP: this rank's partition);
* ``activations``: what autograd saved for backward during one micro-batch's forward (seen
  through ``torch.autograd.graph.saved_tensors_hooks``), still alive when forward ends,
  excluding parameters and the input batch. The largest over a step's micro-batches;
* ``rest``: the batch itself, parameter *copies* autograd saved (autocast's bf16/fp16 casts
  of the weights, FSDP's gathered parameters still alive when forward ends), and the model's
  buffers (BatchNorm's running statistics).

Counting is by storage: every tensor is resolved to its ``untyped_storage()`` (views of one
buffer count once), DTensors to their local shard, and a storage is weighed by ``nbytes()``
when counted, so a buffer FSDP freed after forward weighs 0. On CPU this is exact. What no
Python object exposes is left out and shows only in the process high-water mark
(``peak_mem_bytes``, beside these columns): DDP's flat gradient buckets (one more gradient-sized
buffer), allocator caching, the interpreter and libraries. On a GPU the same counts are read,
and ``peak_mem_bytes`` is the CUDA allocator's peak (``torch.cuda.max_memory_allocated``).

Activation checkpointing (``RunConfig.checkpoint``) lives here too: ``checkpoint_blocks`` makes
each block of an ``nn.Sequential`` save only its input and recompute the rest during backward.
The calculator that predicts these columns is ``labkit.predict.memory`` (re-exported below).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    import pandas as pd

from .predict.memory import CATEGORIES  # the calculator's, so both name the same five

COLUMNS = tuple(f"mem_{c}_bytes" for c in CATEGORIES)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def storages(tensors: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The distinct storages behind ``tensors``, keyed by address (views of one buffer once)."""
    out = {}
    for t in tensors:
        if torch.is_tensor(t):
            s = local(t).untyped_storage()
            if s.nbytes():
                out[s.data_ptr()] = s
    return out


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum(s.nbytes() for s in storages(tensors).values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (ZeroRedundancyOptimizer: this rank's partition)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO wraps the real optimizer
    return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]


def _is_param_copy(t: torch.Tensor) -> bool:
    """A leaf that trains (an FSDP-gathered parameter), or a cast of one (autocast's copy)."""
    if t._base is not None:  # addmm saves the weight copy transposed: a view
        t = t._base
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    return (
        fn is not None
        and type(fn).__name__ == "ToCopyBackward0"
        and any(type(n).__name__ == "AccumulateGrad" for n, _ in fn.next_functions if n)
    )


class MemoryMeter:
    """Counts the five categories during one rank's training loop (see the module docstring).

    ``meter.begin(i)`` at each step; ``with meter.forward(x, y): loss = ...``; ``meter.grads()``
    after the last backward; ``meter.step()`` after the optimizer step; ``meter.columns()`` ->
    the record's columns. Counting happens at one step only, ``at_step`` (the training loop
    picks the last warm-up step, or the first measured one without warm-up), and every record
    carries its counts: the categories are the same at every step of a run, while the saved-
    tensor hooks cost ~15 us per saved tensor (measured here), enough to slow a small model's
    measured steps by a third if they ran on every step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, at_step: int = 0):
        self.model, self.optimizer, self.at_step = model, optimizer, at_step
        self.values = dict.fromkeys(CATEGORIES, 0)
        self.buffers, self.active = 0, True

    def begin(self, step: int) -> None:
        self.active = step == self.at_step

    @contextmanager
    def forward(self, *batch: torch.Tensor):
        """Watch what autograd saves during one micro-batch's forward; weigh it when it ends."""
        if not self.active:
            yield
            return
        skip = set(storages(self.model.parameters())) | set(storages(batch))
        acts: dict[int, torch.UntypedStorage] = {}
        copies: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor):
            s = local(t).untyped_storage()
            if s.data_ptr() not in skip and s.nbytes():
                (copies if _is_param_copy(t) else acts)[s.data_ptr()] = s
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        # weighed now, after autocast's cast cache and FSDP's reshard have released what they
        # release: a storage resized to 0 weighs 0
        copies = {k: s for k, s in copies.items() if k not in acts}
        v = self.values
        v["activations"] = max(v["activations"], sum(s.nbytes() for s in acts.values()))
        rest = sum(s.nbytes() for s in copies.values()) + storage_bytes(batch)
        v["rest"] = max(v["rest"], rest)

    def grads(self) -> None:
        if self.active:
            self.values["grads"] = storage_bytes(p.grad for p in self.model.parameters())

    def step(self) -> None:
        if not self.active:
            return
        self.values["params"] = storage_bytes(self.model.parameters())
        self.values["optimizer"] = storage_bytes(optimizer_tensors(self.optimizer))
        self.buffers = storage_bytes(self.model.buffers())

    def columns(self) -> dict:
        out = {f"mem_{c}_bytes": int(b) for c, b in self.values.items()}
        out["mem_rest_bytes"] += self.buffers
        return out


# ---- activation checkpointing ------------------------------------------------------------------


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing per block: each child of an ``nn.Sequential`` keeps only its
    input for backward and recomputes its inside then (``torch.utils.checkpoint``, non-reentrant:
    the first block's input needs no gradient). Parameter names are unchanged."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"checkpoint=True checkpoints each block of an nn.Sequential; the model "
            f"is a {type(model).__name__}: return nn.Sequential(block1, block2, ...) "
            f"from model_fn, or set checkpoint=False"
        )
    for block in model:
        block.forward = _checkpointed(block.forward)
    return model


def _checkpointed(forward):
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


# ---- tables ------------------------------------------------------------------------------------


def memory_table(records) -> pd.DataFrame:
    """Per run and rank: each category (MiB, the largest over measured steps), their sum, and
    the process high-water mark beside it (``peak_mem_bytes``: RSS on CPU, allocator on GPU)."""
    import pandas as pd

    from .experiment import _labels

    if "threads" not in records:
        records = records.assign(threads=1)
    records = records.assign(variant=records["variant"].fillna("") if "variant" in records else "")
    keys = ["strategy", "world_size", "threads", "variant", "rank"]
    t = records.groupby(keys, sort=False)[list(COLUMNS) + ["peak_mem_bytes"]].max().reset_index()
    out = pd.DataFrame({"run": _labels(t), "rank": t["rank"].astype(int)})
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
    from .models import make_model
    from .predict.memory import calculate

    if model is None:
        model = make_model(cfg)
        input_shape = (3, 16, 16) if cfg.model == "cnn" else (cfg.in_features,)
    strategy = "ddp" if cfg.strategy in ("ddp_naive", "dp") else cfg.strategy
    return calculate(
        model,
        input_shape=input_shape,
        classes=cfg.classes,
        global_batch=cfg.global_batch,
        strategy=strategy,
        world_size=cfg.ranks,
        precision=cfg.precision,
        optimizer=optimizer,
        checkpoint=cfg.checkpoint,
        accumulate=cfg.accumulate,
    )


def calculator_error(records, cfg, optimizer: str = "sgd_momentum", **model) -> pd.DataFrame:
    """Counted against calculated, per rank and category: bytes and the relative error."""
    import pandas as pd

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
    import pandas as pd

    from . import experiment

    if optimizer not in ("sgd_momentum", "adam"):
        raise ValueError(f"optimizer must be sgd_momentum or adam, got {optimizer!r}")
    cfgs = [
        base.replace(strategy=s, world_size=1 if s == "single" else w)
        for s in strategies
        for w in ((1,) if s == "single" else world_sizes)
    ]
    results, errors = [], []
    for cfg in cfgs:
        res = experiment.run(cfg, optimizer_fn=adam if optimizer == "adam" else None)
        results.append(res)
        err = calculator_error(res.records, cfg, optimizer)
        errors.append(err.assign(run=experiment.config_label(cfg)))
        if on_result is not None:
            on_result(res)
    return experiment.combine(results), pd.concat(errors, ignore_index=True)


def __getattr__(name):  # the calculator lives with the other predictions
    if not name.startswith("__"):
        from .predict import memory as calc

        if hasattr(calc, name):
            return getattr(calc, name)
    raise AttributeError(f"module 'labkit.memory' has no attribute {name!r}")
