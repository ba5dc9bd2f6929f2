"""Notebook 15: a mixture of experts' dispatch and combine by all-to-all (expert parallelism)."""

import torch
import torch.distributed as dist


def my_moe_dispatch(x, expert, experts_here, num_experts):
    """Row t of ``x`` computed by expert ``expert[t]`` on the rank that owns it (zero where
    ``expert[t]`` is -1), the rows back in their places."""
    n = dist.get_world_size()
    per = num_experts // n
    kept = torch.nonzero(expert >= 0).flatten()  # dropped rows are never sent
    order = kept[torch.argsort(expert[kept], stable=True)]  # permute: sorted by expert (= rank)
    counts = torch.bincount(expert[order], minlength=num_experts)
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts)  # 1. the counts: rows per expert, to its owner
    arriving = arriving.view(n, per)  # [i, l]: rows from rank i for my l-th expert
    send, recv = counts.view(n, per).sum(1).tolist(), arriving.sum(1).tolist()
    rows = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(rows, x[order], recv, send)  # 2. the rows
    first = dist.get_rank() * per  # my experts are first .. first + per - 1
    which = first + torch.arange(per).repeat(n).repeat_interleave(arriving.flatten())
    out = torch.empty_like(rows)
    for e, module in experts_here.items():  # 3. my experts, each on its rows
        out[which == e] = module(rows[which == e])
    back = x.new_empty(len(order), x.shape[1])
    dist.all_to_all_single(back, out, send, recv)  # 4. the outputs, back the way they came
    y = torch.zeros_like(x)
    y[order] = back  # 5. un-permute
    return y
