"""Graded exercises: the learner writes the algorithm, a grader runs it on real ranks.

A lesson gives a function to fill in (its signature, a docstring, and a body that raises
``NotImplementedError``); ``check(name, fn)`` launches real rank processes, runs the learner's
function where labkit's own would run, compares with what it must equal (torch's collective or
module, single-device training, the schedule's own order) and, where the lesson is about cost,
counts the calls and bytes on the process group (``labkit.wire``) against the formula. It
answers in a learner's words: what passed, and for a failure what differs, with a message of its
own for each common wrong answer, and where it teaches, a picture of the learner's run
(``Verdict.figure``). It never hangs: a rank still waiting after the timeout is named, with the
call it waits in.

One module per lesson topic registers its graders with ``@exercise(name, lesson=..., what=...,
solution=...)``; adding an exercise is a module (or a function in one) and its import below.
The reference solutions live in ``solutions/`` at the top of the repository, one file per
exercise (no lesson imports them); ``LABKIT_SOLUTIONS=1`` makes ``check`` grade the shipped
solution where the learner's body is still blank, so the lessons run end to end with every
fill-in answered. ``tests/ranks/test_exercises.py`` holds that a blank gets "not written yet",
every solution passes, and each catalogued wrong answer gets its own message.
"""

from __future__ import annotations

from . import (  # noqa: F401  (each registers its graders)
    communication,
    data_parallel,
    ddp_overlap,
    experts,
    load_balancing,
    long_sequences,
    memory,
    pipeline,
    sync_async,
    tensor_parallel,
)
from ._core import EXERCISES, SOLUTIONS_ENV, Exercise, Feedback, Verdict, check, solution

__all__ = ["check", "Verdict", "EXERCISES", "Exercise", "Feedback", "solution", "SOLUTIONS_ENV"]
