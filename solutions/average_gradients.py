"""Notebook 01: averaging gradients by hand, what DDP does after backward."""

import torch
import torch.distributed as dist


def my_average_gradients(model: torch.nn.Module) -> None:
    """Make every parameter's ``.grad`` the mean over all ranks of that gradient."""
    n = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # the sum over ranks, on every rank
            p.grad /= n
