"""nn.DataParallel: one process, the model replicated onto every visible GPU on each forward.

Each step scatters the batch, copies the weights to every GPU, runs the replicas in threads,
gathers the outputs on the first GPU and reduces gradients there. It is a single process (the GIL
and the first GPU become bottlenecks) and it cannot span machines, which is why PyTorch recommends
DistributedDataParallel even on one machine.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from ..rank.loop import build_model, data_iter, train_loop


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    model = build_model(cfg, ctx, fns)
    gpus = torch.cuda.device_count() if ctx.device.type == "cuda" else 0
    notes = []
    if gpus == 0:
        notes.append(
            "DataParallel found no GPU, so it runs the whole batch on one CPU device, "
            "exactly like single: it only splits work across GPUs. On CPU (and across "
            "machines) use DDP, one process per rank."
        )
        dp_model = nn.DataParallel(model)
        if dp_model.device_ids:  # CPU asked for on a machine with GPUs: DataParallel moved the
            dp_model.device_ids = []  # model to cuda:0; take its own no-GPU path instead
            model.to(ctx.device)
    else:
        used = min(cfg.world_size, gpus)
        if used < cfg.world_size:
            notes.append(
                f"world_size={cfg.world_size} but only {gpus} GPU(s): DataParallel uses {used}."
            )
        dp_model = nn.DataParallel(model, device_ids=list(range(used)))
    data = data_iter(cfg, fns, rank=0, world_size=1)
    out = train_loop(cfg, ctx, dp_model, data, fns=fns)
    out["notes"] += notes
    return out
