"""labkit.rank.syncbn: batch norm over the global batch on CPU ranks equals BatchNorm on one
device.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_syncbn.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from labkit import launch
from labkit.rank.syncbn import SyncBatchNorm


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
