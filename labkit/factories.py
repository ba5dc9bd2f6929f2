"""Bring your own model, data, loss and optimizer: the contract, checked before any rank starts.

    model_fn(cfg) -> nn.Module          (pipelines: an nn.Sequential, or a list of stage modules)
    data_fn(cfg) -> Dataset             (map-style: len() and [i] -> (inputs, target))
    loss_fn(cfg) -> loss module         (a mean over the batch, like nn.CrossEntropyLoss())
    optimizer_fn(cfg, params) -> torch.optim.Optimizer

Every factory is called exactly once per rank per run, in this order, from fixed RNG states:
seed -> model_fn; seed -> data_fn; loss_fn; then the wrapped model's optimizer_fn; then the
global RNG is reseeded with seed + rank. So a factory that draws from the global RNG (no
generator of its own) builds the same weights and data on every rank and in every strategy,
while dropout masks and augmentations differ from rank to rank, as they must: identical masks
on every rank would repeat the same noise N times instead of drawing N independent samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from .config import RunConfig
from .data import make_dataset
from .models import checkpoint_blocks, make_model
from .registry import STAGED


def default_loss(cfg: RunConfig) -> nn.Module:
    return nn.CrossEntropyLoss()


def default_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


@dataclass(frozen=True)
class Factories:
    """The four factories of a run; ``None`` means labkit's own (toy model and data, CE, SGD)."""

    model_fn: Callable | None = None
    data_fn: Callable | None = None
    loss_fn: Callable | None = None
    optimizer_fn: Callable | None = None

    def model(self, cfg: RunConfig) -> nn.Module:
        torch.manual_seed(cfg.seed)
        model = self.model_fn(cfg) if self.model_fn is not None else make_model(cfg)
        if cfg.strategy in STAGED and isinstance(model, (list, tuple, nn.ModuleList)):
            model = nn.Sequential(*model)  # a list of stage modules is a pipeline too
        return model

    def dataset(self, cfg: RunConfig) -> Dataset:
        torch.manual_seed(cfg.seed)  # independent of how much model_fn drew
        return self.data_fn(cfg) if self.data_fn is not None else make_dataset(cfg)

    def loss(self, cfg: RunConfig) -> nn.Module:
        return (self.loss_fn or default_loss)(cfg)

    def optimizer(self, cfg: RunConfig, params) -> torch.optim.Optimizer:
        return (self.optimizer_fn or default_optimizer)(cfg, params)

    @property
    def custom(self) -> bool:
        return any(
            f is not None for f in (self.model_fn, self.data_fn, self.loss_fn, self.optimizer_fn)
        )


def validate(cfg: RunConfig, fns: Factories) -> None:
    """Fail fast, in the caller, with the fix: misuse found here would otherwise surface on a
    rank after the reference run, or not at all (a one-output model under cross-entropy
    'trains' with loss 0)."""
    _callable("model_fn", fns.model_fn, nn.Module, "model_fn=lambda cfg: MyModel()")
    _callable("data_fn", fns.data_fn, (Dataset, DataLoader), "data_fn=lambda cfg: my_dataset")
    _callable("loss_fn", fns.loss_fn, nn.Module, "loss_fn=lambda cfg: nn.MSELoss()")
    if isinstance(fns.optimizer_fn, type) or isinstance(fns.optimizer_fn, torch.optim.Optimizer):
        raise TypeError(
            "optimizer_fn takes the config and the parameters and returns an "
            "optimizer: pass optimizer_fn=lambda cfg, params: "
            "torch.optim.Adam(params, lr=cfg.lr)"
        )
    _callable("optimizer_fn", fns.optimizer_fn, (), "")
    if not fns.custom:
        return  # labkit's own pieces fit each other
    model = fns.model(cfg)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model_fn returned a {type(model).__name__}, not an nn.Module: return "
            f"the model itself, e.g. model_fn=lambda cfg: MyModel()"
        )
    if cfg.strategy in STAGED:
        _check_cuttable(cfg, model)
    if cfg.activation_checkpointing:  # activation checkpointing cuts between blocks: say so here
        checkpoint_blocks(model)
    dataset = fns.dataset(cfg)
    _check_dataset(cfg, dataset)
    loss_fn = fns.loss(cfg)
    if getattr(loss_fn, "reduction", "mean") != "mean":
        raise ValueError(
            f"the loss has reduction={loss_fn.reduction!r}; data parallelism averages "
            f"each rank's gradient, which equals the global batch's only for a mean: "
            f"use reduction='mean' (the default)"
        )
    probe = 2 * cfg.groups_per_rank  # two samples (per token group of a mixture of experts)
    x, y = default_collate([dataset[i] for i in range(min(probe, len(dataset)))])
    with torch.no_grad():
        try:
            out = model(x)
        except Exception as exc:
            raise ValueError(
                f"the model cannot take a batch of this dataset's inputs (shape "
                f"{_shape(x)}): {type(exc).__name__}: {exc}. Make model_fn and "
                f"data_fn agree"
            ) from exc
        _check_loss(loss_fn, out, y)
    opt = fns.optimizer(cfg, model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_fn returned a {type(opt).__name__}, not a "
            f"torch.optim.Optimizer: e.g. lambda cfg, params: "
            f"torch.optim.SGD(params, lr=cfg.lr)"
        )


def _callable(name: str, fn, instance_of, example: str) -> None:
    if fn is None:
        return
    if instance_of and isinstance(fn, instance_of):
        raise TypeError(
            f"{name} takes a factory, not a {type(fn).__name__}: every rank builds its "
            f"own copy by calling it with the config. Pass {example}"
        )
    if not callable(fn):
        raise TypeError(f"{name} must be a function of the config, got {type(fn).__name__}")


def _check_cuttable(cfg: RunConfig, model: nn.Module) -> None:
    if not isinstance(model, nn.Sequential):
        raise TypeError(
            f"{cfg.strategy} cuts the model into stages between consecutive blocks, so it needs "
            f"an nn.Sequential, got {type(model).__name__}. Either return "
            f"nn.Sequential(block1, block2, ...) from model_fn (each block a module whose output "
            f"is the next one's only input), or return a list of stage modules"
        )
    if len(model) < cfg.stages:
        raise ValueError(
            f"the model has {len(model)} blocks, too few for {cfg.stages} stages: "
            f"lower stages or split the model into more blocks"
        )


def _check_dataset(cfg: RunConfig, dataset) -> None:
    if isinstance(dataset, DataLoader):
        raise TypeError(
            "data_fn returned a DataLoader: return its Dataset instead (labkit builds "
            "each rank's loader with a DistributedSampler, so ranks get disjoint "
            "shards of every global batch)"
        )
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"data_fn returned a {type(dataset).__name__}; labkit needs a map-style "
            f"Dataset (len() and dataset[i] -> (inputs, target)), e.g. "
            f"torch.utils.data.TensorDataset(x, y)"
        )
    if len(dataset) < cfg.global_batch:
        raise ValueError(
            f"the dataset has {len(dataset)} samples, fewer than one global batch "
            f"({cfg.global_batch}): lower global_batch or return more samples"
        )
    item = dataset[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise TypeError(
            f"dataset[0] is a {type(item).__name__}; labkit expects (inputs, target) "
            f"pairs, like TensorDataset(x, y)"
        )


def _check_loss(loss_fn, out, y) -> None:
    if (
        isinstance(loss_fn, nn.CrossEntropyLoss)
        and torch.is_tensor(out)
        and out.dim() >= 1
        and out.shape[-1] == 1
    ):
        raise ValueError(
            "the model outputs one value per sample, and cross-entropy over one "
            "class is always 0, so nothing would train. For regression pass "
            "loss_fn=lambda cfg: nn.MSELoss(); for classification give the model "
            "one output per class"
        )
    try:
        loss = loss_fn(out, y)
    except Exception as exc:
        raise ValueError(
            f"the loss cannot compare the model's output (shape {_shape(out)}) with "
            f"the dataset's targets (shape {_shape(y)}, {getattr(y, 'dtype', '?')}): "
            f"{type(exc).__name__}: {exc}. Pass a loss_fn that fits, e.g. "
            f"lambda cfg: nn.MSELoss() for float targets"
        ) from exc
    if not (torch.is_tensor(loss) and loss.numel() == 1):
        raise ValueError(
            f"the loss returned {_shape(loss)}, not one number: use a loss that "
            f"reduces over the batch (reduction='mean')"
        )


def _shape(t) -> str:
    return str(tuple(t.shape)) if torch.is_tensor(t) else type(t).__name__
