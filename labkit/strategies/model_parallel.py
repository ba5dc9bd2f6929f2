"""Model parallelism: the model cut into P stages, one micro-batch (the whole global batch).

With stages on separate ranks (always on CPU), stage s receives its input from rank s-1, runs
forward, sends the output on, and in backward sends the input's gradient back: exactly the
pipeline code in pipeline.py with M=1, so only one stage ever works at a time and each idles
(P-1)/P of the step. That idle time is what micro-batching (pipeline_gpipe, pipeline_1f1b)
recovers. The classic form, all stages in one process on cuda:0..P-1, runs when this process
is alone and sees at least P GPUs (``run_one_process``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..models import even_bounds, split
from ..rank.loop import build_model, data_iter, train_loop
from . import pipeline


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    cfg = cfg.replace(microbatches=1, pipeline_impl="scratch")
    if ctx.world_size == 1 and cfg.stages > 1:
        if torch.cuda.device_count() < cfg.stages:
            raise ValueError(
                f"model_parallel in one process needs {cfg.stages} GPUs, found "
                f"{torch.cuda.device_count()}: launch {cfg.stages} ranks instead "
                f"(world_size == stages) to run the stages as CPU processes"
            )
        return run_one_process(cfg, ctx, fns)
    return pipeline.run(cfg, ctx, fns)


class SplitModel(nn.Module):
    """Blocks of one model on cuda:0..P-1; forward hops the activation from device to device."""

    def __init__(self, model: nn.Sequential, bounds: list[int], out_device: torch.device):
        super().__init__()
        self.out_device = out_device  # where the targets and the loss live
        self.model = model  # keeps whole-model parameter names
        self.stages = split(model, bounds)
        self.devices = [torch.device("cuda", i) for i in range(len(bounds))]
        for stage, device in zip(self.stages, self.devices):
            stage.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device))
        return x.to(self.out_device)


def run_one_process(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    """Every stage in this one process, stage s on cuda:s (needs P GPUs)."""
    model = build_model(cfg, ctx, fns)
    split_model = SplitModel(model, even_bounds(len(model), cfg.stages), ctx.device)
    data = data_iter(cfg, fns, rank=0, world_size=1)
    out = train_loop(cfg, ctx, split_model, data, fns=fns)
    out["notes"].append(f"one process, stages on cuda:0..{cfg.stages - 1}")
    return out
