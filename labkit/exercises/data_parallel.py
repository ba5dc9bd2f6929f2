"""Lesson 01 (data parallelism): averaging gradients by hand, then the whole of DDP by hand: the
broadcast of rank 0's model (parameters and buffers), each rank's share of every epoch
(``DistributedSampler`` and its ``set_epoch``), and the averaged gradients."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from ..launch import launch
from ._core import Verdict, diff, exercise


def _average_rank(ctx, fn, steps: int) -> dict:
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    single = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double()
    single.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(single.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    out = {"grad_ratio": [], "local_ratio": [], "param_diff": []}
    for _ in range(steps):
        x = torch.randn(8 * ctx.world_size, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (8 * ctx.world_size,), generator=g)
        mine = slice(8 * ctx.rank, 8 * (ctx.rank + 1))  # this rank's share of the global batch
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        local = [p.grad.clone() for p in model.parameters()]
        fn(model)
        nn.functional.cross_entropy(single(x), y).backward()  # the global batch on one device
        mine_g = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        want_g = torch.cat([p.grad.reshape(-1) for p in single.parameters()])
        local_g = torch.cat([t.reshape(-1) for t in local])
        out["grad_ratio"].append(float(mine_g.norm() / want_g.norm()))
        out["local_ratio"].append(float((mine_g - local_g).abs().max()))
        opt.step(), ref.step()
        opt.zero_grad(), ref.zero_grad()
        out["param_diff"].append(
            max(
                float((a - b).detach().abs().max())
                for a, b in zip(model.parameters(), single.parameters())
            )
        )
    return out


@exercise(
    "average_gradients",
    lesson="01",
    what="average gradients by hand",
    solution="my_average_gradients",
)
def grade_average_gradients(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(model)``: after each rank's backward on its share of the batch, make every
    parameter's ``.grad`` the average over the ranks (DDP's job, by hand). Graded on 2 and 3
    ranks over 3 SGD steps against one device training on the whole batch."""
    name, details = "average_gradients", {}
    for n in (2, 3):
        ranks = launch(_average_rank, n, args=(fn, 3), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        for r, res in enumerate(ranks):
            if res["param_diff"][-1] <= 1e-9:
                continue
            ratio = res["grad_ratio"][0]
            if abs(ratio - n) < 1e-6:
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r}'s gradients are {n}x single's: "
                    "you summed them; divide by the world size.",
                    details,
                )
            if all(other["local_ratio"][0] == 0.0 for other in ranks):
                return Verdict(
                    name,
                    False,
                    f"On {n} ranks rank {r} kept its own gradients: "
                    "nothing was exchanged, so the ranks' models drift "
                    "apart. All-reduce each p.grad.",
                    details,
                )
            return Verdict(
                name,
                False,
                f"On {n} ranks rank {r}'s parameters differ from single-device training by "
                f"{res['param_diff'][-1]:.3g} after {len(res['param_diff'])} steps (the first "
                f"step's gradient is {ratio:.3g}x single's in size). Every rank must end with "
                f"the mean over ranks of every parameter's gradient.",
                details,
            )
    return Verdict(
        name,
        True,
        "On 2 and 3 ranks, three steps with your averaging equal one device training on the "
        "whole batch (to 1e-9): that is all DDP promises.",
        details,
    )


# ---- DDP by hand: the broadcast, the sampler, the average ----------------------------------------

SAMPLES, BATCH, EPOCHS = 24, 4, 2


class Centred(nn.Module):
    """A small regression model whose input is centred by a buffer (``mean``, as a
    normalisation layer keeps its statistics): state that is not a parameter, which DDP
    broadcasts from rank 0 all the same (``broadcast_buffers=True``)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        self.register_buffer("mean", torch.randn(6, dtype=torch.float64))

    def forward(self, x):
        return self.net(x - self.mean)


class Recorded(Dataset):
    """The samples, and which of them this rank read, in order (``seen``)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y, self.seen = x, y, []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        self.seen.append(int(i))
        return self.x[i], self.y[i]


def dealt(n: int, epochs: int = EPOCHS) -> list[list[list[int]]]:
    """``[epoch][rank]``: the samples torch's ``DistributedSampler(shuffle=True, seed=0)``
    deals each of ``n`` ranks in each epoch, its epoch set each time."""
    out = []
    for epoch in range(epochs):
        per_rank = []
        for r in range(n):
            sampler = DistributedSampler(range(SAMPLES), num_replicas=n, rank=r, seed=0)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        out.append(per_rank)
    return out


def _ddp_rank(ctx, fn) -> dict:
    n, r = ctx.world_size, ctx.rank
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
    y = torch.randn(SAMPLES, 2, generator=g, dtype=torch.float64)
    model = Centred(100 + r)  # each rank its own start, as separate processes seeded apart
    start = Centred(100)  # rank 0's: where every rank must start
    first: dict = {}

    def peek(module, args) -> None:  # what the first forward computes with
        if not first:
            first["params"] = max(
                diff(a, b) for a, b in zip(module.net.parameters(), start.net.parameters())
            )
            first["mean"] = diff(module.mean, start.mean)

    model.register_forward_pre_hook(peek)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list = []

    def before_step(optimizer, args, kwargs) -> None:  # the gradients of the first step
        if not grads:
            grads.extend(
                None if p.grad is None else p.grad.detach().clone() for p in model.parameters()
            )

    opt.register_step_pre_hook(before_step)
    data = Recorded(x, y)
    fn(model, opt, data, EPOCHS)

    # the reference: rank 0's start on one device, each step on the union of the ranks' batches
    single = Centred(100)
    ref = torch.optim.SGD(single.parameters(), lr=0.1)
    want, local = None, None
    for per_rank in dealt(n):
        for k in range(0, SAMPLES // n, BATCH):
            if want is None:  # the first step's gradient: whole batch, and this rank's alone
                mine = per_rank[r][k : k + BATCH]
                F.mse_loss(single(x[mine]), y[mine]).backward()
                local = [p.grad.clone() for p in single.parameters()]
                ref.zero_grad()
            idx = [i for share in per_rank for i in share[k : k + BATCH]]
            F.mse_loss(single(x[idx]), y[idx]).backward()
            if want is None:
                want = [p.grad.clone() for p in single.parameters()]
            ref.step()
            ref.zero_grad()
    got = grads if grads and all(t is not None for t in grads) else None
    flat = (lambda ts: torch.cat([t.reshape(-1) for t in ts])) if got else None
    return {
        "seen": data.seen,
        "start_params": first.get("params"),
        "start_mean": first.get("mean"),
        "grad_ratio": None if got is None else float(flat(got).norm() / flat(want).norm()),
        "grad_diff": None if got is None else float((flat(got) - flat(want)).abs().max()),
        "local_diff": None if got is None else float((flat(got) - flat(local)).abs().max()),
        "param_diff": max(diff(a, b) for a, b in zip(model.parameters(), single.parameters())),
        "mean_diff": diff(model.mean, single.mean),
    }


def _data_wrong(seen: list[int], r: int, n: int) -> str | None:
    """What is wrong with the samples rank ``r`` of ``n`` read, None if it read its share."""
    share, want = SAMPLES // n, dealt(n)
    if len(seen) == EPOCHS * SAMPLES:
        return (
            f"On {n} ranks rank {r} read the whole dataset every epoch ({SAMPLES} samples): each "
            f"rank must read only its share ({share}). Give the DataLoader "
            f"sampler=DistributedSampler(dataset, shuffle=True, seed=0)."
        )
    if len(seen) != EPOCHS * share:
        return (
            f"On {n} ranks rank {r} read {len(seen)} samples in {EPOCHS} epochs; its share is "
            f"{share} per epoch, {EPOCHS * share} in all."
        )
    epochs = [seen[e * share : (e + 1) * share] for e in range(EPOCHS)]
    if epochs == [want[e][r] for e in range(EPOCHS)]:
        return None
    if all(e == want[0][r] for e in epochs):
        return (
            f"On {n} ranks rank {r} read its samples in the same order in every epoch: call "
            "sampler.set_epoch(epoch) at the start of each epoch. The sampler shuffles with "
            "seed + epoch, and its epoch stays 0 until you set it."
        )
    if epochs[0] == list(range(r, SAMPLES, n)):
        return (
            f"On {n} ranks rank {r} read its samples unshuffled ({epochs[0][:4]}...): "
            "DistributedSampler(dataset, shuffle=True, seed=0) shuffles them."
        )
    return (
        f"On {n} ranks rank {r} read samples {epochs[0][:6]}... in the first epoch, where "
        f"DistributedSampler(dataset, shuffle=True, seed=0) deals it {want[0][r][:6]}...: use "
        f"that sampler, and DataLoader(dataset, batch_size={BATCH}, sampler=sampler)."
    )


@exercise(
    "ddp_by_hand",
    lesson="01",
    what="DDP by hand: broadcast, sampler and set_epoch, averaged gradients",
    solution="my_ddp_by_hand",
)
def grade_ddp_by_hand(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(model, optimizer, dataset, epochs)``: train as DDP does, by hand: every rank starts
    from rank 0's parameters and buffers; each reads its share of every epoch through
    ``DistributedSampler(dataset, shuffle=True, seed=0)`` (its epoch set each epoch) in batches
    of 4; each step averages the gradients over the ranks. Graded on 2 and 3 ranks that start
    from different parameters and buffers, over 2 epochs, against one device training from
    rank 0's start on the union of the ranks' batches, step by step."""
    name, details = "ddp_by_hand", {}
    for n in (2, 3):
        ranks = launch(_ddp_rank, n, args=(fn,), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        said = _ddp_wrong(ranks, n)
        if said:
            return Verdict(name, False, said, details)
    return Verdict(
        name,
        True,
        f"On 2 and 3 ranks that started apart, every rank began from rank 0's parameters and "
        f"buffers, read its own share of each epoch in a new order, and after {EPOCHS} epochs "
        f"holds what one device training on the whole batches holds (to 1e-9).",
        details,
    )


def _ddp_wrong(ranks: list[dict], n: int) -> str | None:
    """The learner's words for what differs, None if nothing does: the data each rank read,
    then where each started, then the gradients, then the parameters after training (a rank's
    wrong start shows in every rank's gradients: it is named first)."""
    for r, res in enumerate(ranks):
        said = _data_wrong(res["seen"], r, n)
        if said:
            return said
    for r, res in enumerate(ranks):
        if res["start_params"] is None:
            return f"On {n} ranks rank {r} never called the model: train it on every batch."
        if res["start_params"] > 0:
            return (
                f"On {n} ranks rank {r} started training from its own parameters (they differ "
                f"from rank 0's by {res['start_params']:.3g}): broadcast rank 0's before the "
                "first step, dist.broadcast(p.data, src=0) for every parameter."
            )
    for r, res in enumerate(ranks):
        if res["start_mean"] > 0 or res["mean_diff"] > 0:
            return (
                f"On {n} ranks rank {r}'s buffer `mean` is still its own (it differs from rank "
                f"0's by {max(res['start_mean'], res['mean_diff']):.3g}): the parameters were "
                "broadcast, the buffers were not, so the ranks' forwards differ. Broadcast "
                "model.buffers() from rank 0 too (DDP does: broadcast_buffers=True)."
            )
    for r, res in enumerate(ranks):
        if res["grad_ratio"] is None or res["param_diff"] <= 1e-9:
            continue
        if abs(res["grad_ratio"] - n) < 1e-6:
            return (
                f"On {n} ranks rank {r}'s gradients at the first step are {n}x one device's on "
                "the whole batch: you summed them; divide by the world size."
            )
        if res["local_diff"] <= 1e-12:
            return (
                f"On {n} ranks rank {r} stepped on its own gradients: nothing was exchanged. "
                "After backward, all-reduce each p.grad and divide by the world size."
            )
        if res["grad_diff"] > 1e-9:
            return (
                f"On {n} ranks rank {r}'s gradients at the first step differ from one device's "
                f"on the whole batch by {res['grad_diff']:.3g}: every rank must step on the "
                "mean over ranks of every parameter's gradient."
            )
    for r, res in enumerate(ranks):
        if res["param_diff"] > 1e-9:
            return (
                f"On {n} ranks rank {r}'s parameters differ from one device's by "
                f"{res['param_diff']:.3g} after {EPOCHS} epochs, though the first step was "
                "right: is each step's .grad zeroed before backward (optimizer.zero_grad())?"
            )
    return None
