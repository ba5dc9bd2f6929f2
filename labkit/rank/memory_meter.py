"""Where every byte goes: memory per rank by category, counted from live tensor storage.

Five categories, the ones the ZeRO paper (Rajbhandari et al., 2020, arXiv:1910.02054) reasons
with:

* ``params``: this rank's parameter storage (FSDP: its shard; DDP and ZeRO-1: all of it);
* ``grads``: gradient storage just before the optimizer step (FSDP: the sharded gradients);
* ``optimizer``: tensors in the optimizer's state after a step (momentum, Adam's two moments;
  ZeRO-1 and FSDP: this rank's partition);
* ``activations``: what autograd saved for backward during each micro-batch's forward (seen
  through ``torch.autograd.graph.saved_tensors_hooks``), still alive when forward ends,
  excluding parameters and the input batch, held until that micro-batch's backward: the most
  held at once in a step (one rule for the shared loop and the pipeline schedules);
* ``rest``: the batch itself, parameter *copies* autograd saved (autocast's bf16/fp16 casts
  of the weights, FSDP's gathered parameters still alive when forward ends), and the model's
  buffers (BatchNorm's running statistics).

Counting is by storage: every tensor is resolved to its ``untyped_storage()`` (views of one
buffer count once; a storage is known by its identity, ``storage_key``, not its address, which
is 0 for every tensor without data, as in a dry run), DTensors to their local shard, and a
storage is weighed by ``nbytes()`` when counted, so a buffer FSDP freed after forward weighs 0.
On CPU this is exact. What no Python object exposes is left out and shows only in the process
high-water mark (``peak_mem_bytes``, beside these columns): DDP's flat gradient buckets (one
more gradient-sized buffer), allocator caching, the interpreter and libraries. On a GPU the same
counts are read, and ``peak_mem_bytes`` is the CUDA allocator's peak
(``torch.cuda.max_memory_allocated``).

The calculator that predicts these columns is ``labkit.predict.memory``; the tables that read
them are ``labkit.labs.memory``.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager

import torch
from torch import nn

from ..predict.memory import (
    CATEGORIES,  # the calculator's, so both name the same five
    view_root,  # the one reader of torch's private Tensor._base
)

COLUMNS = tuple(f"mem_{c}_bytes" for c in CATEGORIES)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), any other tensor itself."""
    if not hasattr(t, "to_local"):
        return t
    with torch.no_grad():  # the shard itself, not an autograd view of it
        return t.to_local()


def storage_key(s: torch.UntypedStorage) -> int:
    """A storage's identity: the address of torch's ``StorageImpl`` behind it (``_cdata``, as in
    torch 2.14), the same for every view of one buffer while it lives. Not ``data_ptr()``: that
    is 0 for every storage without data (the meta device, ``FakeTensorMode``: a dry run)."""
    return s._cdata


def storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, torch.UntypedStorage]:
    """The distinct storages behind ``tensors``, keyed by identity (views of one buffer once)."""
    out = {}
    for t in tensors:
        if torch.is_tensor(t):
            s = local(t).untyped_storage()
            if s.nbytes():
                out[storage_key(s)] = s
    return out


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    return sum(s.nbytes() for s in storages(tensors).values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's state (ZeroRedundancyOptimizer: this rank's partition)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeRO wraps the real optimizer
    return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]


def _is_param_copy(t: torch.Tensor) -> bool:
    """A leaf that trains (an FSDP-gathered parameter), or a cast of one (autocast's copy)."""
    t = view_root(t)  # addmm saves the weight copy transposed: a view
    if t.is_leaf:
        return t.requires_grad
    fn = t.grad_fn
    return (
        fn is not None
        and type(fn).__name__ == "ToCopyBackward0"
        and any(type(n).__name__ == "AccumulateGrad" for n, _ in fn.next_functions if n)
    )


class MemoryMeter:
    """Counts the five categories during one rank's training loop (see the module docstring),
    for the shared loop and the pipeline loop alike.

    ``meter.begin(i)`` at each step; ``with meter.forward(x, y, key=m): loss = ...`` around each
    micro-batch's forward (``x, y``: the data it was handed, counted as ``rest``; a pipeline
    stage's received activations are not data); ``meter.backward_done(m)`` once its backward
    freed them; ``meter.grads()`` before the optimizer step; ``meter.step()`` after it;
    ``meter.columns()`` -> the record's columns. What a micro-batch saved is held from its
    forward to its backward, so ``activations`` is the most held at once: one micro-batch's
    under gradient accumulation (each backward frees its forward's before the next one), all M
    under GPipe, at most P - stage under 1F1B.

    The categories are counted at one step only, ``at_step`` (the training loop picks the last
    warm-up step, or the first measured one without warm-up), and every record carries their counts:
    they are the same at every step of a run, while the saved-tensor hooks cost time for every
    tensor autograd saves, enough to slow a small model's measured steps visibly if they ran on
    every step (benchmarks/README.md, "Behind the code"). With ``every_step`` (a pipeline, whose
    schedule is the lesson) the micro-batches held at once are followed at every step:
    ``peaks()``."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        at_step: int = 0,
        every_step: bool = False,
    ):
        self.model, self.optimizer, self.at_step = model, optimizer, at_step
        self.every_step = every_step
        self.values = dict.fromkeys(CATEGORIES, 0)
        self.buffers = 0
        self.counting = self.watching = True  # until begin(): one step, counted
        self.held: dict[object, int] = {}  # micro-batch -> bytes its forward saved
        self.peak_bytes = self.peak_count = 0

    def begin(self, step: int) -> None:
        self.counting = step == self.at_step
        self.watching = self.counting or self.every_step
        self.held.clear()
        self.peak_bytes = self.peak_count = 0

    @contextmanager
    def forward(self, *batch: torch.Tensor | None, key: object = None):
        """Watch what autograd saves during one micro-batch's forward; weigh it when it ends."""
        if not self.watching:
            yield
            return
        # the storages themselves, held until forward ends: a key of one that was freed could
        # come back as a new activation's (an address reused), which would then not be counted
        skip = {**storages(self.model.parameters()), **storages(batch)}
        acts: dict[int, torch.UntypedStorage] = {}
        copies: dict[int, torch.UntypedStorage] = {}

        def pack(t: torch.Tensor):
            s = local(t).untyped_storage()
            key = storage_key(s)
            if key not in skip and s.nbytes():
                (copies if _is_param_copy(t) else acts)[key] = s
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        # weighed now, after autocast's cast cache and FSDP's reshard have released what they
        # release: a storage resized to 0 weighs 0
        copies = {k: s for k, s in copies.items() if k not in acts}
        self.held[key] = sum(s.nbytes() for s in acts.values())
        self.peak_count = max(self.peak_count, len(self.held))
        self.peak_bytes = max(self.peak_bytes, sum(self.held.values()))
        if self.counting:
            v = self.values
            v["activations"] = max(v["activations"], self.peak_bytes)
            rest = sum(s.nbytes() for s in copies.values()) + storage_bytes(batch)
            v["rest"] = max(v["rest"], rest)

    def backward_done(self, key: object = None) -> None:
        """Micro-batch ``key``'s backward ran: what its forward saved is freed."""
        self.held.pop(key, None)

    def grads(self) -> None:
        if self.counting:
            self.values["grads"] = storage_bytes(p.grad for p in self.model.parameters())

    def step(self) -> None:
        if not self.counting:
            return
        self.values["params"] = storage_bytes(self.model.parameters())
        self.values["optimizer"] = storage_bytes(optimizer_tensors(self.optimizer))
        self.buffers = storage_bytes(self.model.buffers())

    def columns(self) -> dict:
        out = {f"mem_{c}_bytes": int(b) for c, b in self.values.items()}
        out["mem_rest_bytes"] += self.buffers
        return out

    def peaks(self) -> dict:
        """This step's micro-batches held at once, and their bytes (``every_step``)."""
        return {"activations_peak": self.peak_count, "activation_bytes_peak": self.peak_bytes}
