"""Lesson 09 (synchronous and asynchronous training): local SGD's averaging round."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..launch import launch
from ._core import Verdict, exercise


def _local_sgd_rank(ctx, fn, rounds: int, period: int) -> dict:
    from torch import nn

    n, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    model = nn.Linear(6, 3).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + r)  # each rank its own data: the copies drift apart
    out = {"before": [], "after": [], "mean": [], "spread": []}
    for _ in range(rounds):
        for _ in range(period):  # local steps
            x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,))
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step(), opt.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(n)]
        dist.all_gather(every, flat)
        fn(model)
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        mean = torch.stack(every).mean(0)
        out.setdefault("first_mean", mean)
        out["before"].append(flat)
        out["after"].append(after)
        out["mean"].append(float((after - mean).abs().max()))
        out["spread"].append(float((torch.stack(every) - mean).abs().max()))
    out["mine_ratio"] = float(
        (out["after"][0] - out["before"][0]).abs().max() / max(out["spread"][0], 1e-30)
    )
    out["sum_off"] = float((out["after"][0] - n * out.pop("first_mean")).abs().max())
    return out


@exercise(
    "local_sgd_average",
    lesson="09",
    what="local SGD's averaging round",
    solution="my_average_parameters",
)
def grade_local_sgd_average(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(model)``: local SGD's averaging round: every parameter replaced, on every rank, by
    its mean over the ranks. Graded on 2 and 3 ranks whose copies drifted apart over 3 local
    steps, three rounds, against the mean gathered beforehand."""
    name, details = "local_sgd_average", {}
    for n in (2, 3):
        ranks = launch(_local_sgd_rank, n, args=(fn, 3, 3), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        for r, res in enumerate(ranks):
            if max(res["mean"]) <= 1e-12:
                continue
            if res["mine_ratio"] == 0.0:
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r}'s parameters did not change: "
                    "its copy keeps drifting from the others'. Replace each parameter "
                    "by its mean over the ranks.",
                    details,
                )
            if res["sum_off"] <= 1e-12:
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r} holds the sum of the copies: divide by the world size.",
                    details,
                )
            return Verdict(
                name,
                False,
                f"On {n} ranks rank {r}'s parameters are off the mean of "
                f"the copies by {res['mean'][0]:.3g}: every rank must end the round "
                "with the same, averaged, parameters (an all-reduce, not a reduce to "
                "one rank).",
                details,
            )
    return Verdict(
        name,
        True,
        "On 2 and 3 ranks every round leaves every rank the mean of the "
        "copies, which had drifted apart over the local steps.",
        details,
    )
