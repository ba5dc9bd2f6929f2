"""Models the tests need that labkit did not write."""

import torch
from torch import nn


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
