"""Uneven inputs inside a rank: ``ddp_naive``'s gradient all-reduce, joinable.

When ranks hold different numbers of batches, the rank that runs out would leave the others
waiting in their next all-reduce forever. ``torch.distributed.algorithms.Join`` lets it *shadow*
their collectives (answer them with zeros) until every rank is done. ``JoinableSync`` is the
from-scratch twin of ``DistributedDataParallel.join()`` for the hand-written all-reduce
(``rebalance="join"``); ``labkit.labs.uneven`` shows the hang and the fix from a notebook.
"""

from __future__ import annotations

import functools
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms import Join, Joinable, JoinHook

from ..dist import all_reduce_flat

# ---- join: uneven inputs, with a Joinable written by hand ----------------------------------------


class JoinableSync(Joinable):
    """``ddp_naive``'s gradient all-reduce, joinable: averaged over the samples of the ranks
    still training, and shadowed (zeros all-reduced in the same order) by ranks that ran out.

    ``notify()`` tells the join context this rank is still training (an all-reduce that the
    joined ranks answer; timed, it is this rank's wait for the others); ``reduce(samples)``
    all-reduces the sample count, then each gradient times this rank's samples, and divides by
    the total: the sample-weighted mean gradient over the ranks still training (what DDP's
    ``join(divide_by_initial_world_size=False)`` does when every rank's batch is the same
    size; DDP's default divides by the initial world size instead)."""

    def __init__(self, model: nn.Module, device: torch.device):
        super().__init__()
        self.model, self.device = model, device

    def notify(self) -> float:
        t = time.perf_counter()
        Join.notify_join_context(self)
        return time.perf_counter() - t

    def reduce(self, samples: int) -> None:
        n = torch.tensor([float(samples)], dtype=self.dtype, device=self.device)
        grads = []
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.mul_(samples))
        all_reduce_flat([*grads, n])
        for g in grads:
            g.div_(n)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of one ``reduce`` message: the parameters' promoted with float32 (a sample
        count is exact there; bf16 would round 1001 samples to 1000)."""
        return functools.reduce(
            torch.promote_types, (p.dtype for p in self.model.parameters()), torch.float32
        )

    def numel(self) -> int:
        """Elements of one ``reduce`` message: every parameter's, and the sample count."""
        return sum(p.numel() for p in self.model.parameters()) + 1

    def join_hook(self, **kwargs) -> JoinHook:
        return _Shadow(self)

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return dist.group.WORLD


class _Shadow(JoinHook):
    """What a rank that ran out of data does for each step the others still take."""

    def __init__(self, sync: JoinableSync):
        self.sync = sync

    def main_hook(self) -> None:  # no gradients, no samples from me
        dist.all_reduce(
            torch.zeros(self.sync.numel(), dtype=self.sync.dtype, device=self.sync.device)
        )


def join_context(sync: JoinableSync | None):
    """``Join([sync])`` for a joinable sync (``rebalance="join"``), else nothing."""
    return nullcontext() if sync is None else Join([sync])
