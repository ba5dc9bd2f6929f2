"""Lesson 07 (load balancing): the shadow all-reduce of ``Join``, for uneven inputs.

Ranks with different numbers of batches: the one that runs out would leave the others waiting in
their next all-reduce for ever. Under ``torch.distributed.algorithms.Join`` it calls its
joinable's ``JoinHook.main_hook`` once for every step the others still take, and that hook must
issue the collective they issue, contributing nothing. The learner writes that hook for labkit's
own joinable (``labkit.rank.join.JoinableSync``: each rank all-reduces every gradient times its
samples, then its sample count, in one flat message, and divides by the total); the grader
trains ranks with 2 and 4, then 1, 3 and 2 batches under ``Join`` and compares with one device
training on the union of the batches that each step had.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms import Join, JoinHook

from ..launch import LaunchTimeout, RankError, launch
from ..rank.join import JoinableSync
from ._core import CallLog, Verdict, exercise, read_logs, waiting

BATCHES = {2: (2, 4), 3: (1, 3, 2)}  # batches per rank: uneven
ROWS = 4


class _LearnersShadow(JoinHook):
    """``JoinableSync``'s join hook with the learner's ``main_hook``."""

    def __init__(self, sync: JoinableSync, fn: Callable, log: CallLog):
        self.sync, self.fn, self.log = sync, fn, log

    def main_hook(self) -> None:
        self.log.phase = "shadow"
        self.fn(self.sync)
        self.log.phase = "join"  # Join's own count of the ranks still training, next


class _Graded(JoinableSync):
    def __init__(self, model, fn, log):
        super().__init__(model, torch.device("cpu"))
        self.fn, self.log = fn, log

    def join_hook(self, **kwargs) -> JoinHook:
        return _LearnersShadow(self, self.fn, self.log)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _batches(n: int) -> list[list[tuple]]:
    """``[rank][step]``: every rank's own batches, from one seed."""
    g = torch.Generator().manual_seed(3)
    return [
        [
            (torch.randn(ROWS, 5, generator=g, dtype=torch.float64),
             torch.randn(ROWS, 2, generator=g, dtype=torch.float64))
            for _ in range(BATCHES[n][r])
        ]
        for r in range(n)
    ]  # fmt: skip


def _join_rank(ctx, fn, logs: list[str]) -> dict:
    n, r = ctx.world_size, ctx.rank
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = CallLog(path=logs[r])
    sync = _Graded(model, fn, log)
    data = _batches(n)
    log.phase = "join"
    try:
        with Join([sync]):
            for x, y in data[r]:
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                log.phase = "join"
                sync.notify()
                log.phase = "gradients"
                sync.reduce(ROWS)
                log.phase = "join"
                opt.step()
    finally:
        log.close()
    # one device, each step on the union of the batches the ranks still had; a rank that
    # joined stopped stepping: it holds what one device held after as many steps
    single = _model()
    ref = torch.optim.SGD(single.parameters(), lr=0.1)
    for step in range(BATCHES[n][r]):
        batch = [data[q][step] for q in range(n) if step < BATCHES[n][q]]
        x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
        ref.zero_grad()
        F.mse_loss(single(x), y).backward()
        ref.step()
    return {
        "param_diff": max(
            float((a - b).detach().abs().max())
            for a, b in zip(model.parameters(), single.parameters())
        ),
        "numel": sync.numel(),
        "dtype": str(sync.dtype).replace("torch.", ""),
    }


def _mismatch(logs: list[list[dict]]) -> str | None:
    """The first turn in which the ranks' collectives differ, in words, None if none does."""
    what = {
        "gradients": "its gradients and sample count",
        "join": "Join's count of the ranks still training",
        "shadow": "your shadow",
    }
    for k in range(max(len(log) for log in logs)):
        turn = [log[k] if k < len(log) else None for log in logs]
        kinds = {(c["op"], c["numel"], c["dtype"]) for c in turn if c is not None}
        if len(kinds) > 1 or None in turn:
            said = [
                f"rank {r} " + ("had stopped" if c is None else
                                f"{c['op'].replace('allreduce', 'all-reduced')} {c['numel']} "
                                f"{c['dtype']} element{'s' * (c['numel'] != 1)} "
                                f"({what.get(c['phase'], c['phase'])})")
                for r, c in enumerate(turn)
            ]  # fmt: skip
            return ", while ".join(said)
    return None


@exercise(
    "join_shadow",
    lesson="07",
    what="Join's shadow all-reduce for uneven inputs",
    solution="my_shadow",
)
def grade_join_shadow(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(sync)``: on a rank that has run out of batches, once for every step the others
    still take, issue the all-reduce they issue (``sync.numel()`` elements of ``sync.dtype``:
    every gradient times its samples, then the sample count), contributing nothing. Graded on
    ranks with 2 and 4, then 1, 3 and 2 batches under ``Join``, against one device training
    each step on the union of the batches the ranks still had."""
    name, details = "join_shadow", {}
    with tempfile.TemporaryDirectory(prefix="labkit-join-") as tmp:
        for n in (2, 3):
            paths = [os.path.join(tmp, f"{n}-{r}.jsonl") for r in range(n)]
            try:
                ranks = launch(_join_rank, n, args=(fn, paths), device="cpu", timeout_s=timeout_s)
            except (LaunchTimeout, RankError) as exc:
                said = _stopped(exc, read_logs(paths), n)
                if said is None:
                    raise
                return Verdict(name, False, said, {n: {"logs": read_logs(paths)}})
            logs = read_logs(paths)
            details[n] = {"ranks": ranks, "logs": logs}
            said = _join_wrong(ranks, logs, n)
            if said:
                return Verdict(name, False, said, details)
    return Verdict(
        name,
        True,
        "On ranks with 2 and 4, then 1, 3 and 2 batches, the ranks that had run out matched "
        "every all-reduce of the others with zeros, and each rank holds what one device holds "
        "after as many steps on the batches each step had (to 1e-9).",
        details,
    )


def _stopped(exc, logs: list[list[dict]], n: int) -> str | None:
    """Why the ranks hung or gloo stopped them, from what each had issued; None when the error
    is not the collectives' (``check`` reports it as it is)."""
    if isinstance(exc, RankError) and "NotImplementedError" in exc.traceback:
        return None
    if isinstance(exc, LaunchTimeout):
        how = f"after {exc.timeout_s:g} s {waiting(exc)} was still waiting"
    elif "match" in (exc.stderr_tail or ""):
        how = (
            f"gloo stopped rank {exc.rank}: the bytes in one all-reduce did not match (a size "
            "or a dtype)"
        )
    else:
        return None
    if not any(c["phase"] == "shadow" for log in logs for c in log):
        head = "The rank that ran out of batches issued no all-reduce in its hook"
    else:
        head = "The ranks' all-reduces stopped matching"
    return (
        f"{head}: on {n} ranks {_mismatch(logs) or 'the ranks issued different collectives'}; "
        f"{how}. Each time its hook is called, a joined rank must issue the all-reduce the "
        "others issue: sync.numel() elements of sync.dtype, all zeros."
    )


def _join_wrong(ranks: list[dict], logs: list[list[dict]], n: int) -> str | None:
    want = ranks[0]["numel"]
    for r, log in enumerate(logs):
        shadows = [c for c in log if c["phase"] == "shadow"]
        if any(c["op"] != "allreduce" for c in shadows):
            return (
                f"On {n} ranks rank {r}'s hook issued {', '.join(c['op'] for c in shadows)}: "
                "the others all-reduce, so a joined rank all-reduces too."
            )
        if any(c["nonzero"] for c in shadows):
            return (
                f"On {n} ranks rank {r} contributed non-zero values after joining: a rank "
                "with no batch left adds nothing, neither gradients nor samples. "
                "All-reduce torch.zeros(sync.numel(), dtype=sync.dtype)."
            )
    for r, res in enumerate(ranks):
        if res["param_diff"] > 1e-9:
            return (
                f"On {n} ranks rank {r}'s parameters differ by {res['param_diff']:.3g} from "
                "one device's trained on the batches each step had: each shadow all-reduce must be "
                f"{want} zeros ({ranks[0]['dtype']}), once per hook call."
            )
    return None
