"""Samples that cost different amounts: variable-length sequences, and cost-aware sharding.

A batch of sequences is padded to its longest one, so a rank's compute grows with
``samples x longest length`` in its shard, not with its number of samples. Splitting every
global batch into equal *counts* at random (what ``DistributedSampler`` does) gives one rank the
long tail and the others padding to wait with. Cost-aware sharding sorts the global batch by
length and cuts it into contiguous pieces of equal padded cost (a greedy fill under a bound
found by bisection): ranks with long sequences get fewer of them. The update is unchanged:
the same samples are trained, only which rank trains which differs (weight each rank's loss by
its sample count, as ``labkit.rank.balancer`` does, and the gradient is the global batch's).
"""

from __future__ import annotations

import time

import pandas as pd
import torch
from torch import nn
from torch.utils.data import Dataset


class VariableLengthTokens(Dataset):
    """Token sequences with long-tailed lengths (log-normal, clipped); the label says whether
    more than half the tokens are in the lower half of the vocabulary. Seeded, in memory."""

    def __init__(
        self, size: int = 2048, vocab: int = 64, min_len: int = 4, max_len: int = 128, seed: int = 0
    ):
        g = torch.Generator().manual_seed(seed)
        raw = torch.exp(torch.randn(size, generator=g) * 0.8 + 3.0)  # median ~20
        self.lengths = raw.round().clamp(min_len, max_len).long()
        self.tokens = [torch.randint(1, vocab, (int(n),), generator=g) for n in self.lengths]
        self.labels = torch.tensor(
            [int((t < vocab // 2).float().mean() > 0.5) for t in self.tokens]
        )
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.tokens[i], self.labels[i]


def pad(samples) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate sequences into one batch padded to the longest (token 0 is padding)."""
    seqs, labels = zip(*samples)
    return nn.utils.rnn.pad_sequence(list(seqs), batch_first=True), torch.stack(list(labels))


class TokenMLP(nn.Module):
    """Embed, a per-token MLP (its cost grows with every padded token), mean over real tokens."""

    def __init__(self, vocab: int = 64, dim: int = 64, classes: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x != 0).unsqueeze(-1).float()
        h = self.mlp(self.embed(x)) * mask
        return self.head(h.sum(1) / mask.sum(1).clamp(min=1))


def padded_cost(lengths) -> int:
    """Tokens a batch computes once padded: samples x the longest."""
    return len(lengths) * max(lengths) if len(lengths) else 0


def shard(lengths, world_size: int, policy: str = "random") -> list[list[int]]:
    """Positions of one global batch (``lengths[i]`` each) for every rank.

    ``random``: equal counts in the batch's (already shuffled) order, as DistributedSampler
    splits it. ``cost``: sorted by length, cut into ``world_size`` contiguous pieces whose
    padded costs are as equal as a contiguous cut allows (bisection on the largest cost, each
    piece filled greedily up to it)."""
    n = len(lengths)
    if policy == "random":
        per = [n // world_size + (r < n % world_size) for r in range(world_size)]
        starts = [sum(per[:r]) for r in range(world_size)]
        return [list(range(s, s + c)) for s, c in zip(starts, per)]
    if policy != "cost":
        raise ValueError(f"policy must be random or cost, got {policy!r}")
    order = sorted(range(n), key=lambda i: -lengths[i])  # longest first

    def cut(bound: float) -> list[list[int]] | None:
        pieces, cur = [], []
        for i in order:
            if cur and (len(cur) + 1) * lengths[cur[0]] > bound:
                pieces.append(cur)
                cur = []
            cur.append(i)
        pieces.append(cur)
        return pieces if len(pieces) <= world_size else None

    lo, hi = max(lengths), padded_cost(lengths)
    while hi - lo > 1:  # the smallest bound that needs <= world_size cuts
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cut(mid) else (mid, hi)
    pieces = cut(hi)
    while len(pieces) < world_size:  # more ranks than needed: split the biggest piece
        big = max(range(len(pieces)), key=lambda p: len(pieces[p]))
        half = len(pieces[big]) // 2
        if half == 0:
            pieces.append([])
            continue
        pieces[big : big + 1] = [pieces[big][:half], pieces[big][half:]]
    return pieces


def measure(
    dataset: VariableLengthTokens,
    world_size: int = 2,
    global_batch: int = 64,
    steps: int = 8,
    policies=("random", "cost"),
    seed: int = 0,
    repeats: int = 3,
) -> pd.DataFrame:
    """Per (policy, step, rank): samples, real and padded tokens, and the measured forward +
    backward seconds of that rank's shard.

    Each rank's shard is timed here, one after another, on this process (median of
    ``repeats``): the comparison is between shards, without another process on the core. The
    step a policy would take is the slowest rank's time (``step_table``)."""
    torch.manual_seed(seed)
    model, loss_fn = TokenMLP(dataset.vocab), nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=g).tolist()
    rows = []
    for step in range(steps):
        idx = order[step * global_batch : (step + 1) * global_batch]
        lengths = [int(dataset.lengths[i]) for i in idx]
        for policy in policies:
            for rank, part in enumerate(shard(lengths, world_size, policy)):
                mine = [lengths[p] for p in part]
                x, y = pad([dataset[idx[p]] for p in part]) if part else (None, None)
                rows.append(
                    {
                        "policy": policy,
                        "step": step,
                        "rank": rank,
                        "samples": len(part),
                        "tokens": sum(mine),
                        "padded_tokens": padded_cost(mine),
                        "compute_s": _time(model, loss_fn, x, y, repeats) if part else 0.0,
                    }
                )
    return pd.DataFrame(rows)


def _time(model, loss_fn, x, y, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first one warms the allocator up
        t = time.perf_counter()
        loss_fn(model(x), y).backward()
        times.append(time.perf_counter() - t)
    model.zero_grad(set_to_none=True)
    return sorted(times[1:])[len(times[1:]) // 2]


def step_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Per policy: the median step (slowest rank), the imbalance (slowest / mean rank compute,
    median over steps; 1.0 is perfect) and the share of padded tokens that are padding."""
    per_step = rows.groupby(["policy", "step"]).agg(
        step_s=("compute_s", "max"),
        mean_s=("compute_s", "mean"),
        tokens=("tokens", "sum"),
        padded=("padded_tokens", "sum"),
    )
    per_step["imbalance"] = per_step["step_s"] / per_step["mean_s"]
    per_step["padding_share"] = 1 - per_step["tokens"] / per_step["padded"]
    out = per_step.groupby("policy").agg(
        step_ms=("step_s", "median"),
        imbalance=("imbalance", "median"),
        padding_share=("padding_share", "median"),
    )
    out["step_ms"] *= 1e3
    return out.reset_index()
