"""One place for prediction: every lab asks this package what theory or a cost model expects,
and shows it beside what was measured.

``schedule``: an event simulation of pipeline schedules (naive, GPipe, 1F1B) from per-stage
forward/backward costs and per-boundary hand-off times: the predicted timeline, step time and
bubble. The communication lab's step-time predictor builds on it.

``memory``: bytes per rank by category (parameters, gradients, optimizer state, activations,
the rest) for a model, batch, precision, optimizer, strategy and world size: the memory lab's
calculator (``labkit.memory.predict`` applies it to a run's config).
"""

from .schedule import (
    ScheduleCosts,
    bubble_per_stage,
    costs_from_steps,
    predict_step,
    simulate,
    stage_actions,
)

__all__ = [
    "ScheduleCosts",
    "bubble_per_stage",
    "costs_from_steps",
    "predict_step",
    "simulate",
    "stage_actions",
]
