"""labkit.rank.syncbn: batch norm over the global batch on CPU ranks equals BatchNorm on one
device.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_syncbn.py."""

from __future__ import annotations

import torch
from torch import nn

from labkit.labs.equivalence import batch_stat_layers
from labkit.rank.syncbn import SyncBatchNorm, convert_sync_batchnorm


def test_convert_swaps_every_batchnorm_and_keeps_its_state():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.Sequential(nn.Flatten(), nn.BatchNorm1d(4 * 6 * 6)),
    )
    model[1].running_mean.fill_(0.5)
    assert batch_stat_layers(model) == ["1", "2.1"]
    converted = convert_sync_batchnorm(model, "cpu")
    assert isinstance(converted[1], SyncBatchNorm) and isinstance(converted[2][1], SyncBatchNorm)
    assert converted[1].running_mean.eq(0.5).all()
    converted.eval()  # not distributed, or in eval: plain BatchNorm
    assert converted(torch.randn(2, 3, 8, 8)).shape == (2, 4 * 6 * 6)
