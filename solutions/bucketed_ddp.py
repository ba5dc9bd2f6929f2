"""Lesson 02: DDP's buckets: each bucket's all-reduce started during backward, the moment its
last gradient is ready; the step waits for them all."""

import torch
import torch.distributed as dist


def my_bucketed_ddp(model, bucket_size):
    """Register the hooks that all-reduce the gradients bucket by bucket during backward;
    return ``finish``, which waits for them and averages (called before the step)."""
    n = dist.get_world_size()
    params = list(model.parameters())[::-1]  # backward produces the last layer's first
    buckets = [params[i : i + bucket_size] for i in range(0, len(params), bucket_size)]
    bucket_of = {p: b for b, bucket in enumerate(buckets) for p in bucket}
    ready = [0] * len(buckets)
    in_flight = []  # (work, flat gradients, bucket)

    def hook(p):
        b = bucket_of[p]
        ready[b] += 1
        if ready[b] == len(buckets[b]):  # the bucket's last gradient: start its all-reduce
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[b]])
            in_flight.append((dist.all_reduce(flat, async_op=True), flat, buckets[b]))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for work, flat, bucket in in_flight:
            work.wait()
            flat /= n
            offset = 0
            for q in bucket:
                q.grad.copy_(flat[offset : offset + q.numel()].view_as(q))
                offset += q.numel()
        in_flight.clear()
        ready[:] = [0] * len(buckets)

    return finish
