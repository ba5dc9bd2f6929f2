"""The pipeline schedules: the order in which each stage runs its forwards and backwards.

One definition, read by the executor that runs it (``labkit.strategies.pipeline``) and by the
simulator that predicts its bubble (``labkit.predict.schedule``), so a prediction is of the
schedule that ran. It sits below both in the layers: the order is a fact about the schedule,
neither a strategy nor a prediction.

* GPipe (Huang et al. 2019, arXiv:1811.06965): every stage runs all M forwards, then all M
  backwards, and holds the activations of all M micro-batches until their backward.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): stage s runs P - s - 1
  forwards to fill the pipe below it, then alternates one forward and one backward, then
  drains; it holds at most P - s micro-batches. The same bubble as GPipe, less memory.
* model parallelism: GPipe's order with one micro-batch.
"""

from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "model_parallel")


def stage_actions(
    schedule: str, stages: int, microbatches: int, stage: int
) -> list[tuple[str, int]]:
    """The order in which one stage runs its forwards ("F", m) and backwards ("B", m)."""
    M = microbatches
    if schedule in ("gpipe", "model_parallel"):  # all forwards, then all backwards
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}: choose {', '.join(SCHEDULES)}")
    # 1F1B: enough forwards to fill the pipe below this stage, then alternate, then drain.
    warmup = min(stages - stage - 1, M)
    actions = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", m) for m in range(M - warmup, M)]
