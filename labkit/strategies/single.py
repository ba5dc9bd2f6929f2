"""Single device: the reference every other strategy is checked against."""

from __future__ import annotations

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    data = data_iter(cfg, fns, rank=0, world_size=1)
    return train_loop(cfg, ctx, model, data, fns=fns)
