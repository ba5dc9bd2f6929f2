"""Predict a pipeline step from a compute profile: the profile's layers split into stages, each
hand-off a point-to-point message of one micro-batch's activations, and the schedule simulator of
``labkit.predict.schedule`` (not a second one) for the bubble."""

from __future__ import annotations

from collections.abc import Sequence

from ..models import even_bounds  # the split labkit's pipelines use
from ..registry import Strategy
from .collectives import CollectiveModel
from .profile import Profile, StepPrediction
from .schedule import ScheduleCosts
from .schedule import predict_step as simulate_pipeline


def predict_pipeline(
    profile: Profile,
    network: CollectiveModel,
    strategy: Strategy,
    stages: int,
    global_batch: int,
    microbatches: int,
    bounds: Sequence[int] | None,
) -> StepPrediction:
    """One step of ``strategy``'s schedule on ``stages`` ranks (the model-parallel schedule runs
    the whole batch as one micro-batch): the busiest stage's compute, and its wait (bubble and
    hand-offs) as exposed time."""
    if strategy.schedule == "model_parallel":
        microbatches = 1
    layers = profile.at_batch(global_batch / microbatches).layers
    if bounds is None:
        bounds = even_bounds(len(layers), stages)
    bounds = list(bounds)
    ends = bounds[1:] + [len(layers)]
    parts = [layers[a:b] for a, b in zip(bounds, ends)]
    mb = global_batch / microbatches
    hop = tuple(network.time("p2p", part[-1].activation_bytes * mb, 2) for part in parts[:-1])
    costs = ScheduleCosts(
        tuple(sum(x.forward_s for x in p) for p in parts),
        tuple(sum(x.backward_s for x in p) for p in parts),
        hop,
    )
    sim = simulate_pipeline(strategy.schedule, microbatches, costs)
    busiest = max(range(stages), key=lambda s: costs.forward_s[s] + costs.backward_s[s])
    compute = microbatches * (costs.forward_s[busiest] + costs.backward_s[busiest])
    fwd_share = costs.forward_s[busiest] / max(
        1e-12, costs.forward_s[busiest] + costs.backward_s[busiest]
    )
    idle = sim["span_s"] - compute  # the busiest stage's wait: bubble + hops
    return StepPrediction(
        strategy.name,
        stages,
        global_batch,
        profile.data_s * microbatches,
        compute * fwd_share,
        compute * (1 - fwd_share),
        profile.optimizer_s / stages,
        comm_total_s=sum(hop) * 2 * microbatches,
        exposed_s=max(0.0, idle),
        comm_bytes=0.0,
        bubble=sim["bubble"],
    )
