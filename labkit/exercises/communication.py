"""Lesson 06 (communication): the ring all-reduce, written from send and recv."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..launch import launch
from ..predict.collectives import coefficients
from ..wire import traffic
from ._core import Verdict, exercise


def _ring_rank(ctx, fn, numel: int) -> dict:
    torch.manual_seed(ctx.rank)
    x = torch.randn(numel, dtype=torch.float64)
    want = x.clone()
    dist.all_reduce(want)
    tally = traffic()
    tally.take()  # count only what the learner's function sends
    mine = x.clone()
    out = fn(mine)
    got = out if torch.is_tensor(out) else mine
    sent = tally.take()
    return {
        "x": x,
        "want": want,
        "got": got.detach().to(torch.float64).reshape(-1),
        "calls": sent["comm_calls"],
        "bytes": sent["comm_bytes"],
        "payload_bytes": x.numel() * x.element_size(),
    }


@exercise(
    "ring_all_reduce",
    lesson="06",
    what="a ring all-reduce from send and recv",
    solution="my_ring_all_reduce",
)
def grade_ring_all_reduce(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(x)``: sum ``x`` (1-D, a multiple of the world size) over every rank in place, from
    ``dist.send``/``dist.recv`` (or their ``i`` forms) to the two neighbours. Graded on 2 and 3
    ranks: the sum against ``dist.all_reduce``'s, then the bytes each rank sent against the
    ring's 2(n-1)/n of ``x``."""
    name, details = "ring_all_reduce", {}
    for n in (2, 3):
        ranks = launch(_ring_rank, n, args=(fn, 12 * n), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        wrong = _ring_wrong(ranks, n)
        if wrong:
            return Verdict(name, False, wrong, details)
        per_rank = max(r["bytes"] for r in ranks) / ranks[0]["payload_bytes"]
        ring = coefficients("all_reduce", n)[1]
        if min(r["calls"] for r in ranks) <= 1:
            return Verdict(
                name,
                False,
                "The sums are right, but each rank made at most one call "
                "on the process group: did you call dist.all_reduce? Build "
                "it from dist.send and dist.recv to your neighbours.",
                details,
            )
        if per_rank > ring * 1.0001:
            return Verdict(
                name,
                False,
                f"The sums are right, but on {n} ranks each rank sent {per_rank:.2f}x its data "
                f"where a ring sends 2(n-1)/n = {ring:.2f}x: send one chunk (1/n of x) per "
                f"step, not the whole tensor.",
                details,
            )
    return Verdict(
        name,
        True,
        "On 2 and 3 ranks every rank ends with the sum torch's all-reduce gives, and sends "
        "2(n-1)/n of its data, the least any all-reduce can.",
        details,
    )


def _ring_wrong(ranks: list[dict], n: int) -> str | None:
    """The learner's words for what is wrong with one world size's sums, None if right."""
    for r, res in enumerate(ranks):
        got, want, x = res["got"], res["want"], res["x"]
        if got.shape != want.shape:
            return f"Rank {r} returned {tuple(got.shape)} elements, x has {tuple(want.shape)}."
        if torch.allclose(got, want, rtol=0, atol=1e-9):
            continue
        if torch.allclose(got, x, rtol=0, atol=1e-12):
            return (
                f"On {n} ranks rank {r} still holds its own values: nothing was summed into x. "
                "Work on views of x (x.view(n, -1) or x.chunk(n)) and add what arrives "
                "with +=."
            )
        if torch.allclose(got * n, want, rtol=0, atol=1e-9):
            return f"On {n} ranks rank {r} holds the mean: an all-reduce sums (do not divide)."
        chunks = [
            c
            for c, (a, b) in enumerate(zip(got.view(n, -1), want.view(n, -1)))
            if torch.allclose(a, b, rtol=0, atol=1e-9)
        ]
        return (
            f"On {n} ranks rank {r}'s chunks {chunks or 'none'} hold the full sum, the others do "
            f"not (largest difference {float((got - want).abs().max()):.3g}). In step s of the "
            f"reduce-scatter rank r sends chunk (r - s) % n to rank r + 1 and adds what arrives "
            f"into chunk (r - s - 1) % n; after n - 1 steps, the all-gather passes the finished "
            f"chunks round the same way."
        )
    return None
