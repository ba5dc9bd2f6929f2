"""labkit.rank.syncbn: batch norm over the global batch on CPU ranks equals BatchNorm on one
device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import launch
from labkit.labs.equivalence import batch_stat_layers
from labkit.rank.syncbn import SyncBatchNorm, convert_sync_batchnorm


def _bn_inputs(shape):
    g = torch.Generator().manual_seed(0)
    x = 3 * torch.randn(*shape, generator=g) + 1.5  # off-centre, not unit scale
    target = torch.randn(*shape, generator=g)
    return x, target


def _init(bn):
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 1.5, bn.num_features))
        bn.bias.copy_(torch.linspace(-0.2, 0.2, bn.num_features))
    return bn


def _step(bn, x, target, steps=2):
    """Two training forwards (the running stats move twice), gradients of the second."""
    for _ in range(steps):
        x = x.detach().requires_grad_()
        bn.zero_grad()
        y = bn(x)
        (y * target).mean().backward()
    return y.detach(), x.grad


def sync_rank(ctx, shape):
    x, target = _bn_inputs(shape)
    world, rank = ctx.world_size, ctx.rank
    bn = _init(SyncBatchNorm(shape[1]))
    y, dx = _step(bn, x.chunk(world)[rank], target.chunk(world)[rank])
    grads = torch.cat([bn.weight.grad, bn.bias.grad])
    dist.all_reduce(grads)  # what DDP does: average over ranks
    return {
        "y": y,
        "dx": dx / world,  # each rank's loss is a mean over its shard only
        "grads": grads / world,
        "running": torch.cat([bn.running_mean, bn.running_var]),
        "tracked": int(bn.num_batches_tracked),
    }


@pytest.mark.parametrize("shape", [(16, 4), (8, 3, 5, 5)])
def test_sync_batchnorm_on_two_ranks_equals_batchnorm_on_the_global_batch(shape):
    x, target = _bn_inputs(shape)
    bn = _init(nn.BatchNorm1d(shape[1]) if len(shape) == 2 else nn.BatchNorm2d(shape[1]))
    y, dx = _step(bn, x, target)
    results = launch(sync_rank, 2, args=(shape,), device="cpu", timeout_s=60)
    torch.testing.assert_close(torch.cat([r["y"] for r in results]), y, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat([r["dx"] for r in results]), dx, atol=1e-5, rtol=0)
    for r in results:
        torch.testing.assert_close(
            r["grads"], torch.cat([bn.weight.grad, bn.bias.grad]), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            r["running"], torch.cat([bn.running_mean, bn.running_var]), atol=1e-5, rtol=0
        )
        assert r["tracked"] == int(bn.num_batches_tracked) == 2


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
