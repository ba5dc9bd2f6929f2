"""Single device: the reference every other strategy is checked against."""
from __future__ import annotations

from ..config import RunConfig
from ..dist import RankContext
from .common import build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, model_fn=None, data_fn=None) -> dict:
    model = build_model(cfg, ctx, model_fn)
    data, _ = data_iter(cfg, data_fn, rank=0, world_size=1, batch_size=cfg.global_batch)
    return train_loop(cfg, ctx, model, data, strategy="single")
