"""What every grader shares: the verdict, the registry of exercises, ``check``, the messages for
a hung or crashed answer, the reference solutions, and a log of the calls a rank's group is
handed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..launch import LaunchTimeout, RankError

# where the reference answers live: the repository's top level, beside labkit/ (not installed
# with the package: a learner reads them in the repository, after trying)
SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"
SOLUTIONS_ENV = "LABKIT_SOLUTIONS"  # =1: a blank is graded as the shipped solution instead


class Feedback(Exception):
    """Raised on a rank by a grader's helper (a pipeline stage asked to run a backward before
    its forward): its message is the learner's answer, as it stands."""


@dataclass
class Verdict:
    """What the grader found: ``passed`` (None: not written yet), the ``message`` for the
    learner, the ``details`` it measured (per world size: errors, bytes, calls) and, where a
    picture of the learner's run teaches, a plotly ``figure`` of it (shown under the message
    when the verdict is a cell's result)."""

    exercise: str
    passed: bool | None
    message: str
    details: dict = field(default_factory=dict)
    figure: Any = None
    graded: str = "yours"  # or "solution": LABKIT_SOLUTIONS=1 graded the shipped one

    def __str__(self) -> str:
        mark = {True: "PASSED", False: "NOT YET", None: "NOT WRITTEN YET"}[self.passed]
        return f"{self.exercise}: {mark}. {self.message}"

    def _repr_markdown_(self) -> str:
        mark = {True: "✅ passed", False: "❌ not yet", None: "✏️ not written yet"}[self.passed]
        return f"**{self.exercise}: {mark}.** {self.message}"

    def _ipython_display_(self):  # a verdict as a cell's last line: the message, its picture
        from IPython.display import Markdown, display

        display(Markdown(self._repr_markdown_()))
        if self.figure is not None:
            display(self.figure)


@dataclass(frozen=True)
class Exercise:
    """One graded fill-in: its grader, the lesson that teaches it (the notebook's number), what
    the learner writes, the reference function's name in ``solutions/<name>.py``, and what to
    say when the ranks hang (after which ranks wait where)."""

    name: str
    grade: Callable[[Callable, float], Verdict]
    lesson: str
    what: str
    solution: str
    on_hang: str
    explain: Callable[[RankError], str | None] | None = None


EXERCISES: dict[str, Exercise] = {}

_HANG = (
    "A receive waits for the matching send on the other rank: if every rank first waits to "
    "receive, nobody sends. Post the send without waiting for it (dist.isend, or "
    "dist.batch_isend_irecv for both), then receive."
)


def exercise(
    name: str,
    *,
    lesson: str,
    what: str,
    solution: str,
    on_hang: str = _HANG,
    explain: Callable[[RankError], str | None] | None = None,
) -> Callable:
    """Register the decorated ``grade(fn, timeout_s) -> Verdict`` as exercise ``name``.

    ``explain(exc)`` may turn a rank's error into the learner's words (a shape that does not
    fit), else the grader quotes the error's last line."""

    def register(grade: Callable) -> Callable:
        if name in EXERCISES:
            raise ValueError(f"exercise {name!r} is registered twice")
        EXERCISES[name] = Exercise(name, grade, lesson, what, solution, on_hang, explain)
        return grade

    return register


def check(name: str, fn: Callable, *, timeout_s: float = 30.0) -> Verdict:
    """Grade the learner's ``fn`` for exercise ``name`` (one of ``EXERCISES``) on real ranks.

    With ``LABKIT_SOLUTIONS=1`` in the environment, a blank (a body that still raises
    ``NotImplementedError``) is graded as the shipped solution instead, and the verdict says
    so: the lessons then run end to end with every fill-in answered."""
    if name not in EXERCISES:
        raise ValueError(f"unknown exercise {name!r}: choose one of {', '.join(EXERCISES)}")
    if not callable(fn):
        raise TypeError(f"check({name!r}, fn) needs your function, got {type(fn).__name__}")
    ex = EXERCISES[name]
    verdict = _grade(ex, fn, timeout_s)
    if verdict.passed is None and os.environ.get(SOLUTIONS_ENV) == "1":
        verdict = _grade(ex, solution(name), timeout_s)
        verdict.graded = "solution"
        verdict.message = (
            f"(Graded the shipped solution, {SOLUTIONS_ENV}=1: yours is not written yet.) "
            + verdict.message
        )
    return verdict


_BLANK = (
    "Fill in the function's body (it still raises NotImplementedError), then run this cell again."
)


def _grade(ex: Exercise, fn: Callable, timeout_s: float) -> Verdict:
    try:
        return ex.grade(fn, timeout_s)
    except NotImplementedError:  # a grader that tries the function here first
        return Verdict(ex.name, None, _BLANK)
    except LaunchTimeout as exc:
        return Verdict(ex.name, False, hung(exc, ex.on_hang))
    except RankError as exc:
        if "NotImplementedError" in exc.traceback:
            return Verdict(ex.name, None, _BLANK)
        said = feedback(exc)
        if said is None and ex.explain is not None:
            said = ex.explain(exc)
        return Verdict(ex.name, False, said or raised(exc), {"traceback": exc.traceback})


def solution(name: str) -> Callable:
    """The shipped reference answer to exercise ``name``, ready to send to ranks (by value:
    ``solutions/`` is not a package the ranks could import)."""
    import cloudpickle

    path = SOLUTIONS / f"{name}.py"
    if name not in EXERCISES or not path.exists():
        raise ValueError(
            f"no solution {path} for exercise {name!r}: the solutions ship with the "
            f"repository (git clone it), not with an installed labkit"
        )
    spec = importlib.util.spec_from_file_location(f"labkit_solution_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # cloudpickle sends by value only modules it can find there
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return getattr(module, EXERCISES[name].solution)


# ---- a hung or crashed answer, in the learner's words ------------------------------------------

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


def waiting(exc: LaunchTimeout) -> str:
    """ "rank 0 in recv, rank 1 in all_reduce": where each rank still running waited."""
    waits = []
    for rank, stack in sorted(exc.stacks.items()):
        calls = re.findall(r"in (\w+)\n", stack + "\n")
        comm = next((c for c in reversed(calls) if c in _COMM_CALLS), None)
        waits.append(f"rank {rank} in {comm or 'an unknown call'}")
    return ", ".join(waits) or "every rank"


def hung(exc: LaunchTimeout, advice: str = _HANG) -> str:
    """Which rank waited, in which call of the learner's code, and what usually causes it."""
    return (
        f"Your function never finished: after {exc.timeout_s:g} s {waiting(exc)} was still "
        f"waiting. {advice}"
    )


def feedback(exc: RankError) -> str | None:
    """The message of a ``Feedback`` a grader's helper raised on a rank, None if it was not."""
    found = re.findall(r"Feedback: (.*)$", exc.traceback.strip(), flags=re.M)
    return found[-1][:1].upper() + found[-1][1:] if found else None


def raised(exc: RankError) -> str:
    """A rank's error: its last line, or what gloo said when it aborted the rank."""
    tail = exc.stderr_tail or ""
    if "doesn't match expected size" in tail or "collective mismatch" in tail:
        return (
            f"Rank {exc.rank} was stopped by gloo: the ranks called collectives that do not "
            "match (the same call, with different sizes or types, or different calls in the "
            "same turn). Every rank must issue the same collectives in the same order."
        )
    last = exc.traceback.strip().splitlines()[-1] if exc.traceback.strip() else "it died"
    return f"Rank {exc.rank} raised an error: {last}. The full traceback is in `verdict.details`."


# ---- what a rank's group was handed -----------------------------------------------------------

HOOK_ID = 0x36A  # beside labkit.wire's counting hook (0x1AB), never in its place


class CallLog:
    """Every operation the world group is handed on this rank, in order: a process-group
    pre-hook (as ``labkit.wire`` counts bytes) records its kind, elements, dtype, peer, whether
    any element is non-zero, the time it was issued, and ``phase``, a label the grader sets
    around the code it runs (its own collectives, the learner's). With ``keep_work`` the
    post-hook keeps each operation's work and, where it has a future, the time it completed.
    With ``path`` each call is also written as a line to a file, which survives a rank that
    gloo aborts."""

    def __init__(self, path: str | None = None, keep_work: bool = False):
        self.phase, self.calls, self.works, self._open = "", [], [], {}
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115
        self._keep = keep_work
        pg = dist.group.WORLD
        pg.register_pre_hook(HOOK_ID, self._pre)
        if keep_work:
            pg.register_post_hook(HOOK_ID, self._post)

    def _pre(self, args) -> None:
        tensors = list(args.input_tensors) or list(args.output_tensors)
        call = {
            "op": str(args.name).rsplit(".", 1)[-1].lower(),
            "numel": sum(t.numel() for t in tensors),
            "dtype": str(tensors[0].dtype).replace("torch.", "") if tensors else "",
            "peer": int(args.root),
            "nonzero": bool(any(bool(t.ne(0).any()) for t in args.input_tensors)),
            "phase": self.phase,
            "t": time.perf_counter(),
            "done": None,
        }
        self.calls.append(call)
        if self._keep:
            self._open[args.op_id] = call
        if self._file is not None:
            self._file.write(json.dumps(call) + "\n")

    def _post(self, args) -> None:
        call = self._open.pop(args.op_id, None)
        if call is None:
            return
        self.works.append(args.work)
        try:
            future = args.work.get_future()
        except (RuntimeError, AttributeError):  # gloo's point-to-point work has no future
            return
        future.add_done_callback(lambda _: call.__setitem__("done", time.perf_counter()))

    def close(self) -> None:
        pg = dist.group.WORLD
        pg.unregister_pre_hook(HOOK_ID)
        if self._keep:
            pg.unregister_post_hook(HOOK_ID)
        if self._file is not None:
            self._file.close()


def read_logs(paths: list[str]) -> list[list[dict]]:
    """The calls each rank's ``CallLog`` wrote to its file, in rank order."""
    logs = []
    for path in paths:
        try:
            with open(path) as f:
                logs.append([json.loads(line) for line in f if line.strip()])
        except FileNotFoundError:
            logs.append([])
    return logs


def diff(a: torch.Tensor | None, b: torch.Tensor) -> float | None:
    """The largest absolute difference (None where ``a`` is missing: no gradient)."""
    return None if a is None else float((a.detach() - b.detach()).abs().max())
