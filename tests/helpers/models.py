"""Models the tests need that labkit did not write, and the data sets they train on."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


class CentreEachBatch(nn.Module):
    """Subtracts the batch's own mean: a batch statistic that is not a BatchNorm, so a rank that
    sees half the batch computes something else than one device seeing all of it."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


def centred_mlp(cfg):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(cfg.in_features, cfg.width), CentreEachBatch(), nn.ReLU(),
        nn.Linear(cfg.width, cfg.classes),
    )  # fmt: skip


def vectors(cfg):
    g = torch.Generator().manual_seed(cfg.seed)
    return TensorDataset(
        torch.randn(128, 32, generator=g), torch.randint(0, 10, (128,), generator=g)
    )


def global_rng_data(cfg):  # no generator: draws from torch's global RNG
    return TensorDataset(torch.randn(256, 32), torch.randint(0, 10, (256,)))


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
