"""Notebook 08: ZeRO-1's optimizer step, the momentum sharded across ranks."""

import torch.distributed as dist


def my_zero1_step(params, state, lr, momentum):
    """SGD with momentum where rank r owns params[i] for i % n == r: update those, keeping
    their momentum only, then every parameter reaches every rank from its owner."""
    rank, n = dist.get_rank(), dist.get_world_size()
    for i, p in enumerate(params):
        if i % n != rank:
            continue
        buf = state.get(i)
        state[i] = buf = p.grad.clone() if buf is None else buf.mul_(momentum).add_(p.grad)
        p.sub_(lr * buf)
    for i, p in enumerate(params):
        dist.broadcast(p, src=i % n)
