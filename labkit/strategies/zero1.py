"""ZeRO stage 1: DDP for the gradients, the optimizer state partitioned across ranks.

``torch.distributed.optim.ZeroRedundancyOptimizer`` gives each rank the optimizer state of
about 1/N of the parameters (whole tensors, greedily balanced by size). Every rank still holds
all parameters and, after DDP's all-reduce, all gradients; each updates only its partition and
then broadcasts it, so every rank ends the step with the same full parameters. Memory per rank
(ZeRO paper, Rajbhandari et al. 2020): params + grads + optimizer/N instead of params + grads +
optimizer. Communication per step: DDP's all-reduce of the gradients, plus the broadcast of
every parameter from the rank that owns it (``comm_bytes`` counts both payloads).
"""

from __future__ import annotations

from torch.distributed.optim import ZeroRedundancyOptimizer

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from . import ddp


def zero_optimizer(cfg: RunConfig, fns: Factories):
    """Wrap the run's optimizer (yours or labkit's) in ZeroRedundancyOptimizer: its class and
    hyper-parameters are read from one instance built the usual way (it holds no state yet)."""

    def make(params):
        params = list(params)
        plain = fns.optimizer(cfg, params)
        return ZeroRedundancyOptimizer(params, optimizer_class=type(plain), **plain.defaults)

    return make


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    return ddp.run(cfg, ctx, fns, strategy="zero1", make_optimizer=zero_optimizer(cfg, fns))
