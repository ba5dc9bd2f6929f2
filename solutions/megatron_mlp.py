"""Notebook 12: Megatron's MLP on two ranks: a column-parallel fc1, a row-parallel fc2, f and g."""

import torch
import torch.distributed as dist
import torch.nn.functional as F


class F_(torch.autograd.Function):
    """f: identity forward; all-reduce backward (every rank's features give part of dL/dx)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class G(torch.autograd.Function):
    """g: all-reduce forward (sum the partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def my_megatron_mlp(x, w1, b1, w2, b2):
    """fc2(gelu(fc1(x))) from this rank's shards, whole on every rank."""
    hidden = F.gelu(F.linear(F_.apply(x), w1, b1))  # this rank's hidden features
    return G.apply(F.linear(hidden, w2)) + b2  # partial sums, summed; the bias once
