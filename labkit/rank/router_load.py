"""The router's load, each step: what every mixture-of-experts block of the model routed.

A watch participant (``labkit.rank.watch``) that any loop training a model with
``labkit.moe.MoE`` blocks gets, whatever the strategy: single-device training and expert
parallelism record the same columns, so the drops of the two can be compared token for token.
Per record (this rank's tokens, one list per MoE block, one count per expert):

* ``expert_routed``: assignments the router made to each expert (before the capacity);
* ``expert_dropped``: of those, the ones over the expert's capacity in their group;
* ``tokens_dropped``: their sum over blocks and experts;
* ``aux_loss_value``: Switch's balancing loss, the mean over blocks (1: an even load).
"""

from __future__ import annotations

import math

from torch import nn

from ..moe import MoE, moe_layers


class RouterLoad:
    def __init__(self, layers: list[MoE]):
        self.layers = layers

    @classmethod
    def of(cls, model: nn.Module) -> RouterLoad | None:
        """The participant for ``model``, None where it has no MoE block."""
        layers = moe_layers(model)
        return cls(layers) if layers else None

    def step_start(self, i: int) -> None:  # what ran before the step (a calibration) is not its
        for layer in self.layers:
            layer.empty_tally()

    def step_end(self, i: int, rec: dict) -> None:
        held = [layer.empty_tally() for layer in self.layers]
        rec["expert_routed"] = [h["routed"] for h in held]
        rec["expert_dropped"] = [h["dropped"] for h in held]
        rec["tokens_dropped"] = sum(sum(h["dropped"]) for h in held)
        aux = [h["aux"] for h in held if not math.isnan(h["aux"])]
        rec["aux_loss_value"] = sum(aux) / len(aux) if aux else math.nan
