"""Lesson 01: DDP by hand: rank 0's model on every rank, each rank's share of every epoch, and
the mean gradient at every step."""

import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler


def my_ddp_by_hand(model, optimizer, dataset, epochs):
    """Train ``model`` for ``epochs`` epochs as DDP would, by hand, on this rank."""
    n = dist.get_world_size()
    for t in [*model.parameters(), *model.buffers()]:  # buffers too: they shape the forward
        dist.broadcast(t.data, src=0)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # this rank's share
    loader = DataLoader(dataset, batch_size=4, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new order each epoch (seed + epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= n
            optimizer.step()
