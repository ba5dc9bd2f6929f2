"""Mixed precision as a knob of the shared loop: ``torch.autocast`` and, for fp16, a GradScaler.

Under autocast the parameters, their gradients and the optimizer state stay fp32 (the "master
weights"); matrix multiplies run on bf16/fp16 casts of weights and inputs, and the activations
they save are 16-bit. bf16 keeps fp32's 8 exponent bits (same range, 8 bits of mantissa: about
2-3 significant digits), so it needs no loss scaling. fp16 has 5 exponent bits: small gradients
underflow to 0 unless the loss is scaled up before backward and the gradients scaled down
before the step; a step whose gradients overflowed (inf/nan) is skipped and the scale halved.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Amp:
    """One rank's precision: the autocast context, the backward and the (scaled) step."""

    def __init__(self, precision: str, device: torch.device):
        self.precision, self.device_type = precision, torch.device(device).type
        self.dtype = DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(self.device_type) if precision == "fp16" else None

    def autocast(self):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer step; with a scaler, also whether it was skipped (inf/nan gradients)."""
        if self.scaler is None:
            optimizer.step()
            return {}
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # unscales, skips the step if any gradient is inf/nan
        self.scaler.update()  # halves the scale after a skip, grows it slowly
        after = self.scaler.get_scale()
        return {"amp_scale": before, "amp_skipped": int(after < before)}
