"""A labkit checkpoint written as one rank of a run writes it, for the resume tests."""

from __future__ import annotations

import torch
from torch import nn

from labkit.rank import resume


def save_checkpoint(folder, cfg, step=3, model=None):
    """Save ``model`` (a fresh nn.Linear(4, 2) by default), an SGD optimizer with momentum and
    this process's RNG state as step ``step`` of a 1-rank run of ``cfg``; the file's path."""
    model = model or nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return resume.save(
        folder,
        step=step,
        epoch=0,
        offset=0,
        world_size=1,
        cfg=cfg,
        model=model,
        optimizer=opt,
        rng=[resume.rng_state()],
    )
