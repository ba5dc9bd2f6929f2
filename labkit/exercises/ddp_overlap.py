"""Lesson 02 (DDP in practice): buckets of gradients all-reduced while backward still runs.

DDP (Li et al. 2020, "PyTorch Distributed", arXiv:2006.15704) groups the parameters into
buckets in the reverse of their order in the model (backward produces the last layer's
gradients first), and starts one asynchronous all-reduce per bucket the moment its last gradient
is ready, so the communication of the late layers overlaps the backward of the early ones; the
optimizer step waits for them all. The learner writes that side: the hooks, the buckets, the
all-reduce per bucket, the wait and the division before the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..launch import launch
from ._core import CallLog, Feedback, Verdict, exercise

BUCKET_SIZE = 3  # parameters per bucket (DDP caps a bucket by bytes, bucket_cap_mb)
STEPS = 3
_RELEASE = "labkit_exercise_rank0_waits"  # set when rank 0 first waits, or returned without


def _model() -> nn.Sequential:
    """Four Linears of different widths: every parameter a different size, so a bucket is known
    by its size on the wire."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(),
        nn.Linear(4, 3),
    ).double()  # fmt: skip


def buckets(params: list, size: int = BUCKET_SIZE) -> list[list]:
    """DDP's grouping: ``size`` parameters a bucket, from the last parameter to the first."""
    back = list(params)[::-1]
    return [back[i : i + size] for i in range(0, len(back), size)]


def _sizes(groups: list[list]) -> list[int]:
    return [sum(p.numel() for p in g) for g in groups]


def _release_on_first_wait(store) -> None:
    """Rank 0 tells the other ranks when it first waits for a collective (``Work.wait`` or a
    future's ``wait``), so that they start their backward only then (see ``_bucket_rank``)."""
    released = []

    def wrap(cls) -> None:
        original = cls.wait

        def wait(self, *args, **kwargs):
            if not released:
                released.append(True)
                store.set(_RELEASE, "1")
            return original(self, *args, **kwargs)

        cls.wait = wait

    wrap(dist.Work)
    wrap(torch._C.Future)
    return released


def _bucket_rank(ctx, fn) -> dict:
    n, r = ctx.world_size, ctx.rank
    model, single = _model(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(single.parameters(), lr=0.1)
    store = dist.distributed_c10d._get_default_store()
    released = _release_on_first_wait(store) if r == 0 else None
    log = CallLog(keep_work=True)
    log.phase = "setup"
    finish = fn(model, BUCKET_SIZE)
    if not callable(finish):
        raise Feedback(
            "my_bucketed_ddp must return finish, the function the loop calls after backward "
            f"and before the step; it returned {type(finish).__name__}."
        )
    g = torch.Generator().manual_seed(1)
    steps = []
    for step in range(STEPS):
        x = torch.randn(4 * n, 5, generator=g, dtype=torch.float64)
        y = torch.randn(4 * n, 3, generator=g, dtype=torch.float64)
        mine = slice(4 * r, 4 * (r + 1))
        if step == 0 and r > 0:
            # The other ranks start their first backward only once rank 0 waits for a collective
            # (or has returned without waiting): rank 0's all-reduces cannot complete before
            # then, so a finish() that returns without waiting is caught every time, not when
            # the collectives happen to be slow. A wait this cannot see costs the timeout.
            try:
                store.wait([_RELEASE], timedelta(seconds=5))
            except RuntimeError:
                pass
        opt.zero_grad()
        calls_before, works_before = len(log.calls), len(log.works)
        log.phase = "backward"
        t0 = time.perf_counter()
        F.mse_loss(model(x[mine]), y[mine]).backward()
        t1 = time.perf_counter()
        local = [p.grad.detach().clone() for p in model.parameters()]
        log.phase = "finish"
        finish()
        t2 = time.perf_counter()
        in_flight = sum(not w.is_completed() for w in log.works[works_before:])
        if step == 0 and r == 0:
            store.set(_RELEASE, "1")
        ref.zero_grad()
        F.mse_loss(single(x), y).backward()
        mine_g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        want_g = torch.cat([p.grad.reshape(-1) for p in single.parameters()])
        local_g = torch.cat([t.reshape(-1) for t in local])
        calls = [
            {
                "op": c["op"],
                "numel": c["numel"],
                "phase": c["phase"],
                "issued": c["t"] - t0,
                "done": None if c["done"] is None else c["done"] - t0,
            }
            for c in log.calls[calls_before:]
        ]
        steps.append(
            {
                "backward": t1 - t0,
                "finish": t2 - t0,
                "calls": calls,
                "in_flight": in_flight,
                "grad_ratio": float(mine_g.norm() / want_g.norm()),
                "grad_diff": float((mine_g - want_g).abs().max()),
                "local_diff": float((mine_g - local_g).abs().max()),
            }
        )
        opt.step(), ref.step()
    log.close()
    return {
        "steps": steps,
        "buckets": _sizes(buckets(model.parameters())),
        "forward_buckets": _sizes(_forward_buckets(list(model.parameters()))),
        "param_diff": max(
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), single.parameters())
        ),
        "waited": None if released is None else bool(released),
    }


def _forward_buckets(params: list) -> list[list]:
    """The buckets in forward order, in the order their all-reduces can start: the one with
    the last parameters first (it is ready first), the first layer's last."""
    return [params[i : i + BUCKET_SIZE] for i in range(0, len(params), BUCKET_SIZE)][::-1]


@exercise(
    "bucketed_ddp",
    lesson="02",
    what="DDP's buckets: all-reduces started during backward",
    solution="my_bucketed_ddp",
    on_hang=(
        "Every rank must start the same all-reduces in the same order: if one rank waits for "
        "a bucket another never starts, both wait for ever."
    ),
)
def grade_bucketed_ddp(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(model, bucket_size) -> finish``: register hooks (``register_post_accumulate_grad_
    hook``) that all-reduce the gradients in buckets of ``bucket_size`` parameters, in reverse
    order, each bucket's all-reduce started asynchronously when its last gradient is ready;
    ``finish()``, called after backward and before the step, waits for them and divides by the
    world size. Graded on 2 and 3 ranks over 3 SGD steps against one device on the whole
    batch; then when each all-reduce started (during backward?), how many there were (one per
    bucket?) and what each carried (the buckets, in the order backward fills them?)."""
    from ..plots.exercises import bucket_timeline  # the caller's side only: ranks never draw

    name, details = "bucketed_ddp", {}
    for n in (2, 3):
        ranks = launch(_bucket_rank, n, args=(fn,), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        said = _bucket_wrong(ranks, n)
        figure = bucket_timeline([res["steps"][-1] for res in ranks], step=STEPS)
        if said:
            return Verdict(name, False, said, details, figure)
    first = min(c["issued"] for c in ranks[0]["steps"][-1]["calls"])
    return Verdict(
        name,
        True,
        f"On 2 and 3 ranks, three steps equal one device training on the whole batch (to "
        f"1e-9), and every bucket's all-reduce started during backward: "
        f"{len(ranks[0]['buckets'])} all-reduces a step, one per bucket, the first "
        f"{1e3 * (ranks[0]['steps'][-1]['backward'] - first):.2f} ms before backward returned "
        f"on rank 0 (the picture: your last step).",
        details,
        figure,
    )


def _bucket_wrong(ranks: list[dict], n: int) -> str | None:
    """What differs, in the learner's words, None if nothing does."""
    want = ranks[0]["buckets"]
    for r, res in enumerate(ranks):
        for i, st in enumerate(res["steps"]):
            if st["in_flight"]:
                return (
                    f"On {n} ranks rank {r}'s finish() returned at step {i + 1} while "
                    f"{st['in_flight']} of its all-reduces were still in flight, so the step "
                    "would use gradients not yet summed. Wait for each bucket's work "
                    "(work.wait()) before dividing and copying back."
                )
    for r, res in enumerate(ranks):
        for i, st in enumerate(res["steps"]):
            reduces = [c for c in st["calls"] if c["op"] == "allreduce"]
            if st["grad_diff"] <= 1e-9:
                continue
            if not reduces and i > 0 and res["steps"][0]["calls"]:
                return (
                    f"On {n} ranks rank {r} issued {len(res['steps'][0]['calls'])} all-reduces "
                    f"at step 1 but none at step {i + 1}, so its gradients were its own: does "
                    "every step start with empty buckets (reset what counts the gradients that "
                    "arrived, in finish())?"
                )
            if not reduces:
                return (
                    f"On {n} ranks rank {r} issued no all-reduce at step {i + 1}: nothing was "
                    "exchanged. Register the hook on every parameter, and start a bucket's "
                    "all-reduce when its last gradient arrives."
                )
            if abs(st["grad_ratio"] - n) < 1e-6:
                return (
                    f"On {n} ranks rank {r}'s gradients are {n}x one device's on the whole "
                    "batch: they were summed; divide by the world size in finish()."
                )
            if st["local_diff"] <= 1e-12:
                return (
                    f"On {n} ranks rank {r}'s gradients after finish() are still its own: the "
                    "summed buckets never reached p.grad. Copy each bucket's result back into "
                    "its parameters' .grad."
                )
            return (
                f"On {n} ranks rank {r}'s gradients after finish() at step {i + 1} differ from "
                f"one device's on the whole batch by {st['grad_diff']:.3g} (their size is "
                f"{st['grad_ratio']:.3g}x). Does every step start with empty buckets?"
            )
    for r, res in enumerate(ranks):
        for st in res["steps"]:
            reduces = [c for c in st["calls"] if c["op"] == "allreduce"]
            late = [c for c in reduces if c["issued"] >= st["backward"]]
            if reduces and len(late) == len(reduces):
                return (
                    "Correct, but every all-reduce started after backward: nothing overlapped. "
                    "Start each bucket's all-reduce from the hook, when its last gradient "
                    "arrives, with async_op=True; finish() only waits."
                )
            if late:
                return (
                    f"Correct, but on {n} ranks rank {r} started {len(late)} of its "
                    f"{len(reduces)} all-reduces after backward: start every bucket's from the "
                    "hook, when its last gradient arrives."
                )
            if len(reduces) != len(want):
                return (
                    f"Correct, but rank {r} issued {len(reduces)} all-reduces a step; buckets "
                    f"of {BUCKET_SIZE} parameters make {len(want)}: one all-reduce per bucket, "
                    "of its gradients flattened into one tensor (torch.cat), so each pays one "
                    "latency, not one per parameter."
                )
            sizes = [c["numel"] for c in reduces]
            if sizes == res["forward_buckets"]:
                return (
                    "Correct, but your buckets follow the model's forward order: the first "
                    "bucket holds the first layer, whose gradients backward produces last, so "
                    "it can only start at the very end. Fill the buckets from the last "
                    "parameter backwards (reversed(list(model.parameters())))."
                )
            if sizes != want:
                return (
                    f"Correct, but your all-reduces carried {sizes} elements; buckets of "
                    f"{BUCKET_SIZE} parameters taken from the last parameter backwards carry "
                    f"{want}, in that order."
                )
    return None
