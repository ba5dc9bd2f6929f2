"""Tensor parallelism in one process: column and row slices of a linear against the dense one,
what cannot be split refused with the fix, and the transformer factory.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.config import RunConfig
from labkit.data import make_dataset
from labkit.models import make_model, mlp
from labkit.strategies import tp

B, S, H, HEADS = 4, 16, 64, 4  # batch, sequence, hidden, heads for the per-layer checks


# ---- one Linear, split: in process, ranks simulated by slices -----------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_column_and_row_slices_of_a_linear_give_the_dense_output_and_gradients(t):
    # equal to float rounding (1e-6): a reduction over a differently shaped tensor may add in
    # another order (the bias gradient differed by 2.4e-7), so bitwise equality is not promised
    torch.manual_seed(0)
    dense = nn.Linear(8, 12)
    x = torch.randn(5, 8, requires_grad=True)
    up = torch.randn(5, 12)  # dL/dY, the same on every rank
    (dense(x) * up).sum().backward()

    # column split: rank r holds output features r; its output is a slice of Y
    ws = [tp.shard(dense.weight, 0, r, t).requires_grad_() for r in range(t)]
    bs = [tp.shard(dense.bias, 0, r, t).requires_grad_() for r in range(t)]
    xs = [x.detach().clone().requires_grad_() for _ in range(t)]  # f: the whole X on each rank
    ys = [F.linear(xr, w, b) for xr, w, b in zip(xs, ws, bs)]
    for r, y in enumerate(ys):
        (y * up.chunk(t, 1)[r]).sum().backward()
    torch.testing.assert_close(torch.cat(ys, 1), dense(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.cat([w.grad for w in ws]), dense.weight.grad, rtol=0, atol=1e-6
    )
    torch.testing.assert_close(torch.cat([b.grad for b in bs]), dense.bias.grad, rtol=0, atol=1e-6)
    # each rank's dL/dX is partial: f's backward all-reduce sums them into the dense one
    torch.testing.assert_close(sum(xr.grad for xr in xs), x.grad, rtol=0, atol=1e-6)

    # row split: rank r holds input features r and gets X's slice r; the partial outputs sum
    ws = [tp.shard(dense.weight, 1, r, t).requires_grad_() for r in range(t)]
    bias = dense.bias.detach().clone().requires_grad_()
    xs = [xr.detach().clone().requires_grad_() for xr in x.chunk(t, 1)]
    partial = [F.linear(xr, w) for xr, w in zip(xs, ws)]
    y = sum(partial) + bias  # g, then the bias once
    (y * up).sum().backward()
    torch.testing.assert_close(y, dense(x), rtol=0, atol=1e-6)
    torch.testing.assert_close(
        torch.cat([w.grad for w in ws], 1), dense.weight.grad, rtol=0, atol=0
    )
    torch.testing.assert_close(bias.grad, dense.bias.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([xr.grad for xr in xs], 1), x.grad, rtol=0, atol=1e-6)


def test_a_feature_count_the_degree_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="cannot split 10 features over 4"):
        tp.shard(torch.zeros(10, 3), 0, 0, 4)


def test_what_cannot_be_split_is_refused_with_the_fix():
    from labkit.strategies import tp_dtensor

    dropout = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1)), nn.Linear(8, 2))
    for parallelize in (tp.parallelize, tp_dtensor.parallelize):  # before any collective
        with pytest.raises(ValueError, match="dropout .* set p=0"):
            parallelize(dropout, None)
        with pytest.raises(ValueError, match="only the transformer"):
            parallelize(mlp(4, 8, 2, 2), None, sequence_parallel=True)
    with pytest.raises(ValueError, match="an MLP built like labkit's"):
        tp.parallelize(nn.Sequential(nn.Conv1d(1, 1, 1), nn.Linear(2, 2)), None)


# ---- the model and data behind it -----------------------------------------------------------


def test_transformer_factory_is_seeded_shaped_and_its_data_learnable():
    cfg = RunConfig(model="transformer", seed=0, in_features=8, width=32, depth=2, classes=5)
    cfg = cfg.replace(dataset_size=256, heads=4, seq_len=8)
    model, again = make_model(cfg), make_model(cfg)
    assert len(model) == cfg.depth + 2  # embedding, blocks, head: pipeline-cuttable
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n
    data = make_dataset(cfg)
    assert torch.equal(data.y, make_dataset(cfg).y)
    x, y = data.x, data.y
    assert model(x[:3]).shape == (3, cfg.classes)
    assert y.unique().numel() == cfg.classes
    # order matters: the same vectors in reverse order get another class in most sequences
    assert (data.teacher(x.flip(1)) != y).float().mean() > 0.5
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = None
    for _ in range(60):
        loss = F.cross_entropy(model(x), y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first, (first, loss.item())
