"""Graded exercises: the learner writes the algorithm, a grader runs it on real ranks.

A lesson gives a function to fill in (its signature, a docstring, and a body that raises
``NotImplementedError``); ``check(name, fn)`` launches real rank processes, runs the learner's
function where labkit's own would run, compares with what it must equal (torch's collective,
single-device training) and, where the lesson is about cost, counts the bytes it sent on the
process group against the formula. It answers in a learner's words: what passed, and for a
failure what differs, with a message of its own for each common wrong answer. It never hangs:
a rank still waiting after the timeout is named, with the call it waits in.

The reference solutions live in ``solutions/`` at the top of the repository (no lesson imports
them); ``tests/ranks/test_exercises.py`` holds that a blank answer gets "not written yet", every
solution passes, and each catalogued wrong answer gets its own message.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .launch import LaunchTimeout, RankError, launch
from .predict.collectives import coefficients
from .wire import traffic


@dataclass
class Verdict:
    """What the grader found: ``passed`` (None: not written yet), the ``message`` for the
    learner, and the ``details`` it measured (per world size: errors, bytes, calls)."""

    exercise: str
    passed: bool | None
    message: str
    details: dict = field(default_factory=dict)

    def __str__(self) -> str:
        mark = {True: "PASSED", False: "NOT YET", None: "NOT WRITTEN YET"}[self.passed]
        return f"{self.exercise}: {mark}. {self.message}"

    def _repr_markdown_(self) -> str:
        mark = {True: "✅ passed", False: "❌ not yet", None: "✏️ not written yet"}[self.passed]
        return f"**{self.exercise}: {mark}.** {self.message}"


def check(name: str, fn: Callable, *, timeout_s: float = 30.0) -> Verdict:
    """Grade the learner's ``fn`` for exercise ``name`` (one of ``EXERCISES``) on real ranks."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}: choose one of {', '.join(EXERCISES)}")
    if not callable(fn):
        raise TypeError(f"check({name!r}, fn) needs your function, got {type(fn).__name__}")
    grader, _lesson, _what = EXERCISES[name]
    try:
        return grader(fn, timeout_s)
    except LaunchTimeout as exc:
        return Verdict(name, False, _hung(exc))
    except RankError as exc:
        if "NotImplementedError" in exc.traceback:
            return Verdict(
                name,
                None,
                "Fill in the function's body (it still raises "
                "NotImplementedError), then run this cell again.",
            )
        return Verdict(name, False, _raised(exc), {"traceback": exc.traceback})


def _hung(exc: LaunchTimeout) -> str:
    """Which rank waited, in which call of the learner's code."""
    waits = []
    for rank, stack in sorted(exc.stacks.items()):
        calls = re.findall(r"in (\w+)\n", stack + "\n")
        comm = next((c for c in reversed(calls) if c in _COMM_CALLS), None)
        waits.append(f"rank {rank} in {comm or 'an unknown call'}")
    return (
        f"Your function never finished: after {exc.timeout_s:g} s "
        f"{', '.join(waits) or 'every rank'} was still waiting. A receive waits for the matching "
        "send on the other rank: if every rank first waits to receive, nobody sends. Post the "
        "send without waiting for it (dist.isend, or dist.batch_isend_irecv for both), then "
        "receive."
    )


_COMM_CALLS = {
    "recv",
    "send",
    "wait",
    "all_reduce",
    "barrier",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "irecv",
    "isend",
    "batch_isend_irecv",
    "all_to_all_single",
}


def _raised(exc: RankError) -> str:
    last = exc.traceback.strip().splitlines()[-1] if exc.traceback.strip() else "it died"
    return f"Rank {exc.rank} raised an error: {last}. The full traceback is in `verdict.details`."


# ---- ring all-reduce from send and recv (notebook 06) ---------------------------------------


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


# ---- averaging gradients by hand (notebook 01) ----------------------------------------------


def _average_rank(ctx, fn, steps: int) -> dict:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    single = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    single.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(single.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    out = {"grad_ratio": [], "local_ratio": [], "param_diff": []}
    for _ in range(steps):
        x = torch.randn(8 * ctx.world_size, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (8 * ctx.world_size,), generator=g)
        mine = slice(8 * ctx.rank, 8 * (ctx.rank + 1))  # this rank's share of the global batch
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        local = [p.grad.clone() for p in model.parameters()]
        fn(model)
        nn.functional.cross_entropy(single(x), y).backward()  # the global batch on one device
        mine_g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        want_g = torch.cat([p.grad.reshape(-1) for p in single.parameters()])
        local_g = torch.cat([t.reshape(-1) for t in local])
        out["grad_ratio"].append(float(mine_g.norm() / want_g.norm()))
        out["local_ratio"].append(float((mine_g - local_g).abs().max()))
        opt.step(), ref.step()
        opt.zero_grad(), ref.zero_grad()
        out["param_diff"].append(
            max(
                float((a - b).detach().abs().max())
                for a, b in zip(model.parameters(), single.parameters())
            )
        )
    return out


def grade_average_gradients(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(model)``: after each rank's backward on its share of the batch, make every
    parameter's ``.grad`` the average over the ranks (DDP's job, by hand). Graded on 2 and 3
    ranks over 3 SGD steps against one device training on the whole batch."""
    name, details = "average_gradients", {}
    for n in (2, 3):
        ranks = launch(_average_rank, n, args=(fn, 3), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        for r, res in enumerate(ranks):
            if res["param_diff"][-1] <= 1e-9:
                continue
            ratio = res["grad_ratio"][0]
            if abs(ratio - n) < 1e-6:
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r}'s gradients are {n}x single's: "
                    "you summed them; divide by the world size.",
                    details,
                )
            if res["local_ratio"][0] == 0.0:
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r} kept its own gradients: "
                    "nothing was exchanged, so the ranks' models drift "
                    "apart. All-reduce each p.grad.",
                    details,
                )
            return Verdict(
                name,
                False,
                f"On {n} ranks rank {r}'s parameters differ from single-device training by "
                f"{res['param_diff'][-1]:.3g} after {len(res['param_diff'])} steps (the first "
                f"step's gradient is {ratio:.3g}x single's in size). Every rank must end with "
                f"the mean over ranks of every parameter's gradient.",
                details,
            )
    return Verdict(
        name,
        True,
        "On 2 and 3 ranks, three steps with your averaging equal one device training on the "
        "whole batch (to 1e-9): that is all DDP promises.",
        details,
    )


# ---- Megatron's MLP: a column- then a row-parallel Linear, with f and g (notebook 12) --------


def _mlp_rank(ctx, fn) -> dict:
    from torch import nn

    t, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 16).double(), nn.Linear(16, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    dense = fc2(nn.functional.gelu(fc1(x)))
    dense.square().sum().backward()
    rows = slice(16 // t * r, 16 // t * (r + 1))  # fc1: this rank's output features
    w1 = fc1.weight.detach()[rows].clone().requires_grad_()
    b1 = fc1.bias.detach()[rows].clone().requires_grad_()
    w2 = fc2.weight.detach()[:, rows].clone().requires_grad_()  # fc2: the same features, in
    b2 = fc2.bias.detach().clone().requires_grad_()
    mine = x.detach().clone().requires_grad_()
    out = fn(mine, w1, b1, w2, b2)
    out.square().sum().backward()

    def diff(a, b):
        return None if a is None else float((a - b).abs().max())

    return {
        "out": diff(out.detach(), dense.detach()),
        "x_summed": diff(out.detach(), fc2(nn.functional.gelu(fc1(t * x))).detach()),
        "bias_off": diff(out.detach() - (t - 1) * fc2.bias.detach(), dense.detach()),
        "x_grad": diff(mine.grad, x.grad),
        "x_grad_ratio": None if mine.grad is None else float(mine.grad.norm() / x.grad.norm()),
        "w1_grad": diff(w1.grad, fc1.weight.grad[rows]),
        "w2_grad": diff(w2.grad, fc2.weight.grad[:, rows]),
        "b2_grad": diff(b2.grad, fc2.bias.grad),
    }


def grade_megatron_mlp(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(x, w1, b1, w2, b2)``: the MLP ``fc2(gelu(fc1(x)))`` on this rank's shards (``w1``,
    ``b1``: fc1's rows for this rank's hidden features; ``w2``: fc2's columns for the same
    features; ``b2``: fc2's whole bias), with ``f`` before fc1 and ``g`` after fc2, returning
    the whole output on every rank. Graded on 2 ranks: the output and the gradients of x, w1,
    w2 and b2 against the dense MLP's."""
    name = "megatron_mlp"
    ranks = launch(_mlp_rank, 2, args=(fn,), device="cpu", timeout_s=timeout_s)
    details = {2: ranks}
    tol = 1e-9
    for r, res in enumerate(ranks):
        if res["out"] > tol:
            if res["bias_off"] <= tol:
                return Verdict(
                    name,
                    False,
                    f"Rank {r}'s output is off by fc2's bias: every rank "
                    "added b2 before the sum, so it was counted twice. Add it once, "
                    "after g.",
                    details,
                )
            if res["x_summed"] <= tol:
                return Verdict(
                    name,
                    False,
                    f"Rank {r}'s output is the MLP of x summed over the ranks: f all-reduced x "
                    "on its way in. f is the identity forward (x is already whole everywhere).",
                    details,
                )
            return Verdict(
                name,
                False,
                f"Rank {r}'s output differs from the dense MLP's (by "
                f"{res['out']:.3g}): each rank holds only a partial sum after fc2. g "
                "must all-reduce it forward.",
                details,
            )
        for grad in ("w1_grad", "w2_grad", "b2_grad"):
            if res[grad] is None:
                return Verdict(
                    name,
                    False,
                    f"{grad[:2]} got no gradient on rank {r}: compute "
                    "with the tensors you were given (no .detach(), no copies).",
                    details,
                )
        if res["x_grad"] is None or res["x_grad"] > tol:
            ratio = res["x_grad_ratio"]
            if ratio is not None and abs(ratio - 2) < 1e-6:
                why = (
                    "twice what it should be: g all-reduced the gradient on the way back "
                    "too. g is the identity backward."
                )
            else:
                why = (
                    "only this rank's part: each rank's hidden features contribute to "
                    "dL/dx. f must all-reduce it backward."
                )
            return Verdict(
                name, False, f"The output is right, but rank {r}'s gradient of x is {why}", details
            )
        if max(res["w1_grad"], res["w2_grad"], res["b2_grad"]) > tol:
            return Verdict(
                name,
                False,
                f"The output and dL/dx are right, but rank {r}'s weight "
                "gradients differ from the dense MLP's slices: check what g hands "
                "back in backward.",
                details,
            )
    return Verdict(
        name,
        True,
        "On 2 ranks the output and every gradient equal the dense MLP's: "
        "one all-reduce forward (g), one backward (f), nothing else.",
        details,
    )


# ---- ZeRO-1's step: the optimizer state sharded (notebook 08) ----------------------------------


def _zero1_rank(ctx, fn, steps: int) -> dict:
    n, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(0)
    shapes = [(6, 4), (6,), (3, 6), (3,), (5,)]
    start = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    mine = [t.clone() for t in start]
    ref = [t.clone().requires_grad_() for t in start]
    sgd = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    state: dict = {}
    for _ in range(steps):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]  # averaged
        for p, grad in zip(mine, grads):
            p.grad = grad.clone()
        fn(mine, state, 0.1, 0.9)
        for p, grad in zip(ref, grads):
            p.grad = grad.clone()
        sgd.step()
    return {
        "diff": [float((a - b.detach()).abs().max()) for a, b in zip(mine, ref)],
        "state_keys": sorted(state),
        "owned": [i for i in range(len(shapes)) if i % n == r],
    }


def grade_zero1_step(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(params, state, lr, momentum)``: one SGD-with-momentum step where rank r owns the
    parameters ``i % n == r``: it keeps the momentum of those only (``state[i]``), updates
    them, and every parameter then reaches every rank from its owner. Graded on 2 and 3 ranks
    over 3 steps against ``torch.optim.SGD`` on every parameter."""
    name, details = "zero1_step", {}
    for n in (2, 3):
        ranks = launch(_zero1_rank, n, args=(fn, 3), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        for r, res in enumerate(ranks):
            extra = sorted(set(res["state_keys"]) - set(res["owned"]))
            if extra:
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r} kept momentum for parameters "
                    f"{extra}, which it does not own: ZeRO-1's saving is that each rank "
                    "keeps only its 1/n of the optimizer state.",
                    details,
                )
            wrong = [i for i, d in enumerate(res["diff"]) if d > 1e-9]
            if not wrong:
                continue
            if set(wrong) <= set(range(len(res["diff"]))) - set(res["owned"]):
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r}'s own parameters are right, "
                    f"but {wrong} (owned by other ranks) are not: after each rank "
                    "updates its own, broadcast every parameter from its owner "
                    "(dist.broadcast(p, src=i % n)).",
                    details,
                )
            return Verdict(
                name,
                False,
                f"On {n} ranks rank {r}'s parameters {wrong} differ from "
                "SGD with momentum: buf = momentum * buf + grad (buf = grad at the "
                "first step), then p -= lr * buf.",
                details,
            )
    return Verdict(
        name,
        True,
        "On 2 and 3 ranks, three steps equal torch's SGD with momentum on "
        "every rank, while each rank kept the momentum of its own parameters only.",
        details,
    )


# ---- local SGD's averaging round (notebook 09) ------------------------------------------------


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


# ---- a mixture of experts' dispatch and combine by all-to-all (notebook 15) -------------------

_MOE_EXPERTS, _MOE_ROWS, _MOE_HIDDEN = 6, 12, 4  # 6 experts: 3 per rank on 2 ranks, 2 on 3


def _moe_rank(ctx, fn) -> dict:
    from torch import nn

    from .strategies.ep import owned

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


EXERCISES: dict[str, tuple[Callable, str, str]] = {
    "average_gradients": (grade_average_gradients, "01", "average gradients by hand"),
    "ring_all_reduce": (grade_ring_all_reduce, "03", "ring all-reduce from send and recv"),
    "zero1_step": (grade_zero1_step, "05", "ZeRO-1's optimizer step, its state sharded"),
    "local_sgd_average": (grade_local_sgd_average, "06", "local SGD's averaging round"),
    "megatron_mlp": (grade_megatron_mlp, "09", "Megatron's MLP: column, row, f and g"),
    "moe_dispatch": (grade_moe_dispatch, "15", "a mixture of experts' all-to-all dispatch"),
}
