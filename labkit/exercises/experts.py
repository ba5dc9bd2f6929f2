"""Lesson 15 (mixture of experts): expert parallelism's dispatch and combine by all-to-all."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..launch import launch
from ..wire import traffic
from ._core import Verdict, exercise

_MOE_EXPERTS, _MOE_ROWS, _MOE_HIDDEN = 6, 12, 4  # 6 experts: 3 per rank on 2 ranks, 2 on 3


def _moe_rank(ctx, fn) -> dict:
    from torch import nn

    from ..strategies.ep import owned

    n, r, e_all = ctx.world_size, ctx.rank, _MOE_EXPERTS
    torch.manual_seed(0)  # every rank builds every expert alike, and keeps its own
    experts = {e: nn.Linear(_MOE_HIDDEN, _MOE_HIDDEN).double() for e in range(e_all)}
    g = torch.Generator().manual_seed(100 + r)
    x = torch.randn(_MOE_ROWS, _MOE_HIDDEN, generator=g, dtype=torch.float64)
    expert = torch.randint(0, e_all, (_MOE_ROWS,), generator=g)
    expert[torch.rand(_MOE_ROWS, generator=g) < 0.25] = -1  # dropped by the capacity
    with torch.no_grad():
        want = torch.stack(
            [experts[int(e)](row) if e >= 0 else torch.zeros_like(row) for row, e in zip(x, expert)]
        )
        tally = traffic()
        tally.take()  # count only what the learner's function sends
        got = fn(x.clone(), expert.clone(), {e: experts[e] for e in owned(r, n, e_all)}, e_all)
        sent = tally.take()
    kept = expert[expert >= 0]
    arriving = torch.bincount(kept, minlength=e_all)
    dist.all_reduce(arriving)  # rows every rank routes to each expert: what mine compute
    return {
        "x": x,
        "expert": expert,
        "want": want,
        "got": got.detach() if torch.is_tensor(got) else got,
        "payload": sent["comm_payload_bytes"],
        "kept": len(kept),
        "computed": int(sum(arriving[e] for e in owned(r, n, e_all))),
    }


@exercise(
    "moe_dispatch",
    lesson="15",
    what="a mixture of experts' all-to-all dispatch",
    solution="my_moe_dispatch",
)
def grade_moe_dispatch(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(x, expert, experts_here, num_experts)``: expert parallelism's dispatch and combine.
    Row t of ``x`` goes to the rank owning expert ``expert[t]`` (rank q owns experts q E/N ..
    (q+1) E/N - 1; -1: dropped by the capacity, never sent, its output zero), is computed there
    by ``experts_here[e]``, and comes back to row t. Graded on 2 and 3 ranks against every
    expert run in place, then the bytes handed to the process group against the rows kept."""
    name, details, row_bytes = "moe_dispatch", {}, _MOE_HIDDEN * 8
    for n in (2, 3):
        ranks = launch(_moe_rank, n, args=(fn,), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        for r, res in enumerate(ranks):
            wrong = _moe_wrong(res, r, n)
            if wrong:
                return Verdict(name, False, wrong, details)
            # what the kept rows need: the counts (E int64), the rows out, the outputs back
            need = _MOE_EXPERTS * 8 + (res["kept"] + res["computed"]) * row_bytes
            extra, dropped = res["payload"] - need, int((res["expert"] < 0).sum())
            if dropped and extra >= dropped * row_bytes:
                return Verdict(
                    name,
                    False,
                    f"The outputs are right, but on {n} ranks rank {r} handed the process group "
                    f"{extra:,} bytes more than its kept rows need: its {dropped} dropped rows "
                    f"(expert -1) travelled too. A dropped row is not sent at all.",
                    details,
                )
    return Verdict(
        name,
        True,
        "On 2 and 3 ranks every row came back computed by its expert on the expert's rank, "
        "dropped rows stayed home as zeros, and only the kept rows travelled: counts, then "
        "rows, then outputs back.",
        details,
    )


def _moe_wrong(res: dict, r: int, n: int) -> str | None:
    """The learner's words for what is wrong with one rank's rows, None if right."""
    got, want, expert = res["got"], res["want"], res["expert"]
    if not torch.is_tensor(got) or got.shape != want.shape:
        shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
        return (
            f"On {n} ranks rank {r} returned {shape}; return one row per row of x, "
            f"{tuple(want.shape)}, zero where the expert is -1."
        )
    got = got.to(want.dtype)
    if torch.allclose(got, want, rtol=0, atol=1e-9):
        return None
    dropped = expert < 0
    if dropped.any() and got[dropped].abs().max() > 0:
        return (
            f"On {n} ranks rank {r}'s dropped rows (expert -1) came back non-zero: the capacity "
            f"dropped them, so they are not sent and their output is zero (the residual carries "
            f"the token on). Keep only the rows with expert >= 0."
        )
    kept = ~dropped
    near = torch.cdist(got[kept], want[kept]) <= 1e-9  # each output is some kept row's
    if near.any(1).all() and near.any(0).all():
        return (
            f"On {n} ranks rank {r} got every output it should, but in other rows: they come "
            f"back in the order you sent them (sorted by expert). Un-permute: put the output "
            f"of sent row i back at the row it came from, y[order] = back."
        )
    bad = [int(t) for t in torch.nonzero((got - want).abs().amax(1) > 1e-9).flatten()]
    return (
        f"On {n} ranks rank {r}'s rows {bad} differ from their experts' outputs (row {bad[0]}: "
        f"expert {int(expert[bad[0]])}). Sort the kept rows by expert, exchange the counts per "
        f"expert first (all_to_all_single), send the rows with split sizes = rows per "
        f"destination rank, and receive with the counts that came back."
    )
