"""One place for prediction: every lab asks this package what theory or a cost model expects,
and shows it beside what was measured.

``schedule``: an event simulation of pipeline schedules (naive, GPipe, 1F1B) from per-stage
forward/backward costs and per-boundary hand-off times: the predicted timeline, step time and
bubble. The communication lab's step-time predictor builds on it.

``memory``: bytes per rank by category (parameters, gradients, optimizer state, activations,
the rest) for a model, batch, precision, optimizer, strategy and world size: the memory lab's
calculator (``labkit.labs.memory.predict`` applies it to a run's config), and for large transformers
under any tensor x pipeline x data layout with ZeRO (``transformer_layout``).

``layout``: the layout advisor: every dp x tp x pp x ZeRO x micro-batch x recompute layout of a
large transformer on a published cluster, memory from ``memory``, the step from the same alpha-beta
and bubble models, ranked; checked against Megatron-LM's published SC'21 configurations.
"""

from .schedule import (
    ScheduleCosts,
    bubble_per_stage,
    costs_from_steps,
    predict_step,
    simulate,
)

__all__ = [
    "ScheduleCosts",
    "bubble_per_stage",
    "costs_from_steps",
    "predict_step",
    "simulate",
]
