"""Lesson 07: Join's shadow all-reduce: what a rank that ran out of batches issues for every
step the others still take."""

import torch
import torch.distributed as dist


def my_shadow(sync):
    """The all-reduce the ranks still training issue (every gradient times its samples, then
    the sample count, in one message), with nothing in it: no gradients, no samples."""
    dist.all_reduce(torch.zeros(sync.numel(), dtype=sync.dtype, device=sync.device))
