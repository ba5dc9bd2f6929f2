"""check() with models labkit did not write: batch norm, dropout, a transformer, resnet18, and
resnet18 with faults check cannot see by inspection.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_equivalence.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from labkit import RunConfig
from labkit.labs import equivalence
from labkit.labs.equivalence import batch_stat_layers, random_layers, without_dropout

BASE = RunConfig(strategy="ddp", world_size=2, global_batch=32, dataset_size=128, timeout_s=180)


def vectors(cfg):
    g = torch.Generator().manual_seed(cfg.seed)
    return TensorDataset(
        torch.randn(128, 32, generator=g), torch.randint(0, 10, (128,), generator=g)
    )


def bn_mlp(cfg):
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))


def dropout_mlp(cfg):
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10))


class TinyTransformer(nn.Module):
    def __init__(self, dropout: float | None):
        super().__init__()
        kw = {} if dropout is None else {"dropout": dropout}  # None: PyTorch's default, 0.1
        layer = nn.TransformerEncoderLayer(16, nhead=2, dim_feedforward=32, batch_first=True, **kw)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def test_inspection_names_batch_statistics_and_randomness():
    assert batch_stat_layers(bn_mlp(None)) == ["1"] and random_layers(bn_mlp(None)) == []
    assert random_layers(dropout_mlp(None)) == ["2"]
    assert len(random_layers(TinyTransformer(None))) >= 3  # dropouts and attention
    assert random_layers(TinyTransformer(0.0)) == []
    quiet = without_dropout(lambda cfg: TinyTransformer(None))(BASE)
    assert random_layers(quiet) == []


def test_float64_runs_cast_the_model_and_the_inputs_not_the_targets():
    model_fn, data_fn = equivalence.in_float64(bn_mlp, vectors)
    model, (x, y) = model_fn(BASE), data_fn(BASE)[0]
    assert {t.dtype for t in model.state_dict().values()} == {torch.float64, torch.int64}
    assert x.dtype == torch.float64 and y.dtype == torch.int64
    assert torch.equal(x.float(), vectors(BASE)[0][0])  # the same samples, widened


def resnet18(cfg, **kw):
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10, **kw)
