"""Lesson 03 (model parallelism): one pipeline stage's step in 1F1B's order, from send and recv.

The learner writes what one stage does with the micro-batches of a step, given its forward and
backward (``PipeStage``) and a send that posts a message and a receive that waits for one. The
grader runs it on 2 and 3 real ranks and holds it against three things from elsewhere: one
device training on the same micro-batches (the gradients), 1F1B's order as labkit's executor
runs it (``labkit.pipeline_schedules.stage_actions``; PipeDream-Flush, Narayanan et al. 2021,
arXiv:2006.09503) and the messages a pipeline needs, counted on the process group: one
activation forward and one gradient back per micro-batch and stage boundary.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..launch import launch
from ..pipeline_schedules import stage_actions
from ..wire import traffic
from ._core import CallLog, Feedback, Verdict, exercise

MICROBATCHES, ROWS, WIDTH = 4, 2, 6


def _stages(p: int) -> list[nn.Sequential]:
    """The whole model, one block per stage (every rank builds all of them from the seed, so
    its stage starts from the weights one device has)."""
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()).double() for _ in range(p)]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(MICROBATCHES * ROWS, WIDTH, generator=g, dtype=torch.float64)
    return x, torch.randn(MICROBATCHES * ROWS, WIDTH, generator=g, dtype=torch.float64)


class PipeStage:
    """One rank's stage, as the learner's step sees it.

    ``index`` (s), ``stages`` (P), ``microbatches`` (M); ``forward(m, x)`` runs micro-batch
    ``m`` through this stage (``x``: what stage s - 1 sent; None on stage 0, which reads the
    micro-batch itself) and returns its output (on the last stage, the loss); ``backward(m,
    dy)`` runs its backward (``dy``: the gradient stage s + 1 sent; None on the last stage) and
    returns the gradient of its input (None on stage 0); ``send(t, to)`` posts ``t`` to stage
    ``to`` and returns at once; ``recv(frm)`` waits for what stage ``frm`` sent and returns it.
    Every call is timed for the picture; a call out of order raises ``Feedback``."""

    def __init__(self, index: int, stages: int, module: nn.Module, x, y, expected: list):
        self.index, self.stages, self.microbatches = index, stages, MICROBATCHES
        self._module, self._x, self._y = module, x, y
        self._expected = expected  # [m]: (every boundary's activation, its gradient)
        self.wrong_inputs: list[tuple[str, int]] = []  # a message that was not the right one
        self._held: dict[int, tuple] = {}
        self._done: dict[str, set] = {"F": set(), "B": set()}
        self._sends: list = []
        self.events: list[dict] = []
        self.messages: list[dict] = []
        self.peak = 0

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    def _micro(self, m) -> int:
        if not isinstance(m, int) or not 0 <= m < self.microbatches:
            raise Feedback(
                f"stage {self.index} was asked for micro-batch {m!r}: they are 0 to "
                f"{self.microbatches - 1}."
            )
        return m

    def forward(self, m: int, x: torch.Tensor | None = None) -> torch.Tensor:
        s, m = self.index, self._micro(m)
        if m in self._done["F"]:
            raise Feedback(f"stage {s} ran the forward of micro-batch {m} twice.")
        if not self.first and x is None:
            raise Feedback(
                f"stage {s}'s forward of micro-batch {m} got no input: receive it from stage "
                f"{s - 1} first (stage.recv({s - 1})) and pass it in."
            )
        if not self.first and not _same(x, self._expected[m][0][s - 1]):
            self.wrong_inputs.append(("F", m))
        t0 = time.perf_counter()
        rows = slice(ROWS * m, ROWS * (m + 1))
        inp = self._x[rows] if self.first else x.detach().clone().requires_grad_()
        out = self._module(inp)
        if self.last:  # the mean loss over the step: each micro-batch's share is 1/M
            out = F.mse_loss(out, self._y[rows]) / self.microbatches
        self._held[m] = (inp, out)
        self.peak = max(self.peak, len(self._held))
        self._done["F"].add(m)
        self.events.append(self._event("F", m, t0))
        return out.detach()

    def backward(self, m: int, dy: torch.Tensor | None = None) -> torch.Tensor | None:
        s, m = self.index, self._micro(m)
        if m not in self._done["F"]:
            raise Feedback(f"stage {s} started backward of micro-batch {m} before its forward.")
        if m in self._done["B"]:
            raise Feedback(f"stage {s} ran the backward of micro-batch {m} twice.")
        if not self.last and dy is None:
            raise Feedback(
                f"stage {s}'s backward of micro-batch {m} got no gradient: receive it from "
                f"stage {s + 1} first (stage.recv({s + 1})) and pass it in."
            )
        if not self.last and not _same(dy, self._expected[m][1][s]):
            self.wrong_inputs.append(("B", m))
        t0 = time.perf_counter()
        inp, out = self._held.pop(m)
        out.backward(None if self.last else dy)
        self._done["B"].add(m)
        self.events.append(self._event("B", m, t0))
        return None if self.first else inp.grad.detach()

    def send(self, t: torch.Tensor, to: int) -> None:
        self._peer(to, "send to")
        t0 = time.perf_counter()
        self._sends.append(dist.isend(t.detach().contiguous(), to))
        self.messages.append(self._message("send", to, t0))

    def recv(self, frm: int) -> torch.Tensor:
        self._peer(frm, "receive from")
        buf = torch.empty(ROWS, WIDTH, dtype=torch.float64)
        t0 = time.perf_counter()
        dist.recv(buf, frm)
        self.messages.append(self._message("recv", frm, t0))
        return buf

    def _peer(self, other, what: str) -> None:
        if other not in (self.index - 1, self.index + 1) or not 0 <= other < self.stages:
            raise Feedback(
                f"stage {self.index} tried to {what} stage {other!r}: a stage talks only to its "
                f"neighbours, {self.index - 1} (activations come from it, gradients go back to "
                f"it) and {self.index + 1}."
            )

    def _event(self, kind: str, m: int, t0: float) -> dict:
        return {"kind": kind, "microbatch": m, "stage": self.index, "start": t0,
                "end": time.perf_counter()}  # fmt: skip

    def _message(self, kind: str, peer: int, t0: float) -> dict:
        return {"kind": kind, "peer": peer, "stage": self.index, "start": t0,
                "end": time.perf_counter()}  # fmt: skip

    def finish(self) -> None:
        for work in self._sends:
            work.wait()
        for kind, word in (("F", "forward"), ("B", "backward")):
            missing = sorted(set(range(self.microbatches)) - self._done[kind])
            if missing:
                raise Feedback(
                    f"stage {self.index} never ran the {word} of micro-batch(es) {missing}: "
                    f"every stage runs the forward and the backward of all {self.microbatches}."
                )


def _same(a, b: torch.Tensor) -> bool:
    return torch.is_tensor(a) and a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-12))


def _boundaries(p: int, x: torch.Tensor, y: torch.Tensor) -> list:
    """``[m]``: each stage's output for micro-batch m, and the loss's gradient with respect to
    it, on one device: what a stage must receive from its neighbours."""
    out = []
    for m in range(MICROBATCHES):
        rows, h, acts = slice(ROWS * m, ROWS * (m + 1)), x[ROWS * m : ROWS * (m + 1)], []
        for block in _stages(p):
            h = block(h)
            h.retain_grad()
            acts.append(h)
        (F.mse_loss(h, y[rows]) / MICROBATCHES).backward()
        out.append(([a.detach() for a in acts], [a.grad for a in acts]))
    return out


def _pipe_rank(ctx, fn) -> dict:
    p, s = ctx.world_size, ctx.rank
    blocks, (x, y) = _stages(p), _data()
    stage = PipeStage(s, p, blocks[s], x, y, _boundaries(p, x, y))
    log = CallLog()
    tally = traffic()
    tally.take()
    fn(stage)
    stage.finish()
    sent = tally.take()
    log.close()
    whole = nn.Sequential(*_stages(p))  # one device, every micro-batch: the mean loss
    F.mse_loss(whole(x), y).backward()
    pairs = list(zip(blocks[s].parameters(), whole[s].parameters()))
    grads = None
    if all(a.grad is not None for a, _ in pairs):
        grads = max(float((a.grad - b.grad).abs().max()) for a, b in pairs)
    return {
        "order": [(e["kind"], e["microbatch"]) for e in stage.events],
        "wrong_inputs": stage.wrong_inputs,
        "events": stage.events,
        "messages": stage.messages,
        "peak": stage.peak,
        "sends": sum(c["op"] == "send" for c in log.calls),
        "bytes": sent["comm_bytes"],
        "message_bytes": ROWS * WIDTH * 8,
        "grad_diff": grads,
    }


@exercise(
    "one_f_one_b",
    lesson="03",
    what="one pipeline stage's step in 1F1B's order, from send and recv",
    solution="my_one_f_one_b",
    on_hang=(
        "A stage waits in recv for a message its neighbour has not sent: the neighbour is "
        "itself waiting to receive (each forward receives from s - 1 and each backward from "
        "s + 1 before it can send anything). Follow 1F1B's order: warm-up forwards first."
    ),
)
def grade_one_f_one_b(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(stage)``: run one step of ``stage.microbatches`` micro-batches on this stage in
    1F1B's order: ``P - s - 1`` warm-up forwards, then one forward and one backward in turn,
    then the remaining backwards; each forward receives its input from s - 1 (not on stage 0)
    and sends its output to s + 1 (not on the last stage), each backward receives its gradient
    from s + 1 and sends the result to s - 1. Graded on 2 and 3 ranks: the gradients against
    one device's on the same micro-batches, the messages counted on the process group, and each
    stage's order against 1F1B's."""
    from ..plots.exercises import pipeline_timeline  # the caller's side only: ranks never draw

    name, details, figure = "one_f_one_b", {}, None
    for p in (2, 3):
        ranks = launch(_pipe_rank, p, args=(fn,), device="cpu", timeout_s=timeout_s)
        details[p] = ranks
        figure = _figure(ranks, p, pipeline_timeline)
        said = _pipe_wrong(ranks, p)
        if said:
            return Verdict(name, False, said, details, figure)
    return Verdict(
        name,
        True,
        f"On 2 and 3 stages the gradients equal one device's on the same {MICROBATCHES} "
        f"micro-batches (to 1e-9), each micro-batch crossed each boundary in 2 messages (its "
        f"activation forward, its gradient back), and every stage ran 1F1B's order, holding at "
        f"most P - s micro-batches (the picture: your 3 stages).",
        details,
        figure,
    )


def _figure(ranks: list[dict], p: int, draw: Callable):
    t0 = min((e["start"] for res in ranks for e in res["events"] + res["messages"]), default=0)

    def shifted(key: str) -> list[dict]:  # every rank's times from the first start (one clock)
        return [
            {**e, "start": e["start"] - t0, "end": e["end"] - t0} for r in ranks for e in r[key]
        ]

    return draw(
        shifted("events"),
        shifted("messages"),
        f"Your step on {p} stages: computes, waits in recv, sends",
    )


def _order_text(order: list) -> str:
    return " ".join(f"{k}{m}" for k, m in order)


def _pipe_wrong(ranks: list[dict], p: int) -> str | None:
    """What differs, in the learner's words; None if nothing does."""
    M = MICROBATCHES
    # a wrong activation spoils every gradient after it: the first stage that received one
    # forward, else the last stage that received a wrong gradient, is nearest the cause
    for s, res in enumerate(ranks):
        bad = [m for kind, m in res["wrong_inputs"] if kind == "F"]
        if bad:
            return (
                f"On {p} stages stage {s}'s forward of micro-batch {bad[0]} got an input that "
                f"is not stage {s - 1}'s output for micro-batch {bad[0]}: each stage sends on "
                "what its forward returned, and the micro-batches arrive in the order they "
                "were sent."
            )
    for s, res in reversed(list(enumerate(ranks))):
        bad = [m for kind, m in res["wrong_inputs"] if kind == "B"]
        if bad:
            return (
                f"On {p} stages stage {s}'s backward of micro-batch {bad[0]} got a gradient "
                f"other than the loss's gradient with respect to its output for micro-batch "
                f"{bad[0]}: stage {s + 1} must send back what its backward of that micro-batch "
                "returned."
            )
    for s, res in enumerate(ranks):
        if res["grad_diff"] is None or res["grad_diff"] > 1e-9:
            return (
                f"On {p} stages stage {s}'s gradients differ from one device's on the same "
                f"micro-batches (by {res['grad_diff'] if res['grad_diff'] is not None else 'all'}"
                "): each forward must get what stage s - 1's forward of the same micro-batch "
                "returned, and each backward what stage s + 1's backward of it returned."
            )
    sends = sum(res["sends"] for res in ranks)
    per = sends / (M * (p - 1))
    if sends != 2 * M * (p - 1):
        return (
            f"Correct, but you sent {per:g} messages per micro-batch between two neighbouring "
            f"stages ({sends} on {p} stages, {M} micro-batches); 1F1B sends 2: the activation "
            "forward, its gradient back."
        )
    sent, want = sum(res["bytes"] for res in ranks), 2 * M * (p - 1) * ranks[0]["message_bytes"]
    if sent != want:
        return (
            f"Correct, but your stages sent {sent} bytes in all where 1F1B's messages carry "
            f"{want} (2 x {M} micro-batches x {p - 1} boundaries x {ranks[0]['message_bytes']} "
            "bytes, one micro-batch's activation or gradient)."
        )
    orders = [res["order"] for res in ranks]
    if orders == [stage_actions("1f1b", p, M, s) for s in range(p)]:
        return None
    if orders == [stage_actions("gpipe", p, M, s) for s in range(p)]:
        return (
            f"Correct, but all forwards before any backward: that is GPipe. Stage 0 held "
            f"{ranks[0]['peak']} micro-batches' activations at once; 1F1B holds at most P - s "
            f"({p} on stage 0): after P - s - 1 warm-up forwards, each forward is followed by "
            "the oldest backward."
        )
    if all(res["peak"] == 1 for res in ranks):
        return (
            "Correct, but every stage finished a micro-batch's backward before the next "
            "forward, so the stages took turns: while one worked, the others waited (the naive "
            "split's bubble). 1F1B runs P - s - 1 forwards first, so that every stage has "
            "work, then one forward and one backward in turn."
        )
    for s, order in enumerate(orders):
        want = stage_actions("1f1b", p, M, s)
        if order != want:
            return (
                f"Correct, but on {p} stages stage {s} ran {_order_text(order)} where 1F1B runs "
                f"{_order_text(want)}; it held {ranks[s]['peak']} micro-batches at once, 1F1B "
                f"at most P - s = {p - s}."
            )
    return None
