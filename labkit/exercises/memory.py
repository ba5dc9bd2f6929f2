"""Lesson 08 (memory and precision): ZeRO-1's optimizer step, the state sharded.

ZeRO stage 1 (Rajbhandari et al. 2020, arXiv:1910.02054) keeps each rank's 1/n of the optimizer
state; each rank updates the parameters it owns and the others receive them from it, which
costs what an all-gather of the parameters costs: each rank sends (n-1)/n of them a step, all
ranks together (n-1) times the parameters' bytes. The grader counts what the learner's step
sent on the process group (``labkit.wire``) against that, and what each rank kept."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..launch import launch
from ..wire import traffic
from ._core import Verdict, exercise


def _zero1_rank(ctx, fn, steps: int) -> dict:
    n, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 4), (6,), (3, 6), (3,), (5,)]
    start = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    mine = [t.clone() for t in start]
    ref = [t.clone().requires_grad_() for t in start]
    sgd = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    state: dict = {}
    tally, sent = traffic(), []
    for _ in range(steps):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]  # averaged
        for p, grad in zip(mine, grads):
            p.grad = grad.clone()
        tally.take()
        fn(mine, state, 0.1, 0.9)
        sent.append(tally.take()["comm_bytes"])
        for p, grad in zip(ref, grads):
            p.grad = grad.clone()
        sgd.step()
    return {
        "diff": [float((a - b.detach()).abs().max()) for a, b in zip(mine, ref)],
        "state_keys": sorted(state),
        "owned": [i for i in range(len(shapes)) if i % n == r],
        "state_bytes": sum(
            t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t)
        ),
        "param_bytes": sum(t.numel() * t.element_size() for t in start),
        "sent_per_step": sum(sent) / len(sent),
    }


@exercise(
    "zero1_step",
    lesson="08",
    what="ZeRO-1's optimizer step, its state sharded",
    solution="my_zero1_step",
)
def grade_zero1_step(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(params, state, lr, momentum)``: one SGD-with-momentum step where rank r owns the
    parameters ``i % n == r``: it keeps the momentum of those only (``state[i]``), updates
    them, and every parameter then reaches every rank from its owner. Graded on 2 and 3 ranks
    over 3 steps against ``torch.optim.SGD`` on every parameter."""
    from ..plots.exercises import zero1_bytes  # the caller's side only: ranks never draw

    name, details = "zero1_step", {}
    for n in (2, 3):
        ranks = launch(_zero1_rank, n, args=(fn, 3), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        figure = zero1_bytes(ranks, ranks[0]["param_bytes"])
        said = _zero1_wrong(ranks, n)
        if said:
            return Verdict(name, False, said, details, figure)
    sent = sum(res["sent_per_step"] for res in ranks)
    return Verdict(
        name,
        True,
        "On 2 and 3 ranks, three steps equal torch's SGD with momentum on every rank, while "
        "each rank kept the momentum of its own parameters only, and the ranks sent "
        f"{sent:g} bytes a step on 3 ranks: (n-1) x the parameters' {ranks[0]['param_bytes']} "
        "bytes, what an all-gather of them costs.",
        details,
        figure,
    )


def _zero1_wrong(ranks: list[dict], n: int) -> str | None:
    """What differs, in the learner's words; None if nothing does."""
    for r, res in enumerate(ranks):
        extra = sorted(set(res["state_keys"]) - set(res["owned"]))
        if extra:
            return (
                f"On {n} ranks rank {r} kept momentum for parameters {extra}, which it does "
                "not own: ZeRO-1's saving is that each rank keeps only its 1/n of the "
                "optimizer state."
            )
        wrong = [i for i, d in enumerate(res["diff"]) if d > 1e-9]
        if not wrong:
            continue
        if set(wrong) <= set(range(len(res["diff"]))) - set(res["owned"]):
            return (
                f"On {n} ranks rank {r}'s own parameters are right, but {wrong} (owned by "
                "other ranks) are not: after each rank updates its own, broadcast every "
                "parameter from its owner (dist.broadcast(p, src=i % n))."
            )
        return (
            f"On {n} ranks rank {r}'s parameters {wrong} differ from SGD with momentum: "
            "buf = momentum * buf + grad (buf = grad at the first step), then p -= lr * buf."
        )
    sent, psi = sum(res["sent_per_step"] for res in ranks), ranks[0]["param_bytes"]
    if sent > (n - 1) * psi * (1 + 1e-9):
        return (
            f"Correct, but on {n} ranks the ranks sent {sent:g} bytes a step, "
            f"{sent / psi:.2f}x the parameters' {psi} bytes, where sending each parameter "
            f"from its owner costs (n-1)x = {(n - 1) * psi} (what an all-gather costs): did "
            "you all-reduce the parameters? Broadcast each from its owner."
        )
    return None
