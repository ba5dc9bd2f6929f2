"""Uneven inputs: ranks that hold different numbers of batches.

The rank that runs out leaves its training loop while the others wait in their next gradient
all-reduce for a partner that never comes: a hung job. ``uneven_inputs`` shows it with DDP,
bounded by a timeout, and the fix: ``torch.distributed.algorithms.Join``, under which a rank
that ran out *shadows* the others' collectives (answers them with zeros) until every rank is
done. ``JoinableSync`` (``labkit.rank.join``) is the from-scratch twin of
``DistributedDataParallel.join()`` for ``ddp_naive``'s hand-written all-reduce
(``rebalance="join"``).
``sampler_padding`` counts how ``DistributedSampler`` avoids uneven inputs in the first place:
repeated samples, or dropped ones.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from ..config import RunConfig
from ..data import batches as endless
from ..data import shard_loader
from ..factories import Factories
from ..launch import LaunchError, launch

if TYPE_CHECKING:  # pandas loads in the caller only: _uneven_rank runs in rank processes
    import pandas as pd

# ---- uneven inputs: the hang, bounded, and the fix ----------------------------------------------


class UnevenInputsError(RuntimeError):
    """A rank ran out of data while others were still all-reducing (the run was stopped)."""


def uneven_inputs(batches=(5, 3), *, join: bool = False, cfg=None, timeout_s: float = 6.0):
    """DDP on ranks holding different numbers of batches (``batches[r]`` for rank r).

    Without join, the rank that runs out leaves the training loop while the others wait in
    their next gradient all-reduce for a partner that never comes: a hung job. labkit bounds it
    by ``timeout_s`` and raises ``UnevenInputsError`` naming the rank that ran out. With
    ``join=True`` the loop runs under ``Join([ddp_model])`` (what ``ddp_model.join()`` does):
    a rank that ran out answers the others' all-reduces with zeros until every rank is done,
    and DDP still divides by the world size it started with (``divide_by_initial_world_size``,
    True by default: at 2 ranks the survivor's gradient is its own over 2;
    ``ddp_model.join(divide_by_initial_world_size=False)`` divides by the ranks still
    training). Returns one row per rank."""
    cfg = cfg or RunConfig(strategy="ddp", world_size=len(batches), global_batch=32 * len(batches))
    cfg = cfg.replace(strategy="ddp", world_size=len(batches))
    seen: dict[int, dict] = {}
    try:
        rows = launch(
            _uneven_rank,
            len(batches),
            args=(cfg, tuple(batches), join),
            timeout_s=timeout_s,
            device=cfg.device,
            on_progress=lambda rank, m: seen.__setitem__(rank, m),
        )
    except LaunchError as exc:
        if join:
            raise
        raise UnevenInputsError(_uneven_message(batches, seen, timeout_s)) from exc
    import pandas as pd

    return pd.DataFrame(rows)


def _uneven_message(batches, seen: dict, timeout_s: float) -> str:
    out = [r for r, m in seen.items() if m.get("done")]
    stuck = [r for r in range(len(batches)) if r not in out]
    first = min(out, default=min(range(len(batches)), key=lambda r: batches[r]))
    waiting = ", ".join(
        f"rank {r} (batch {seen.get(r, {}).get('batch', 0) + 1} of {batches[r]})" for r in stuck
    )
    return (
        f"rank {first} ran out of data after {batches[first]} batches while {waiting} still "
        f"trained: the gradient all-reduce of the next batch waited for rank {first}, which "
        f"never came, until labkit's {timeout_s:g} s timeout stopped every rank (without a "
        f"timeout the job hangs forever). Fix: train under `with Join([ddp_model]):` (or "
        f"`with ddp_model.join():`), or give every rank the same number of batches "
        f"(DistributedSampler pads its shards with repeated samples, or drop_last=True drops "
        f"the remainder)"
    )


def _uneven_rank(ctx, cfg, batches, join: bool) -> dict:
    fns = Factories()
    torch.manual_seed(cfg.seed)
    model = fns.model(cfg).to(ctx.device)
    ddp = DDP(model, device_ids=ctx.device_ids)
    loss_fn, optimizer = fns.loss(cfg), fns.optimizer(cfg, ddp.parameters())
    data = endless(
        shard_loader(
            fns.dataset(cfg),
            cfg.global_batch // ctx.world_size,
            ctx.rank,
            ctx.world_size,
            seed=cfg.seed,
        )
    )
    mine = batches[ctx.rank]
    t0 = time.perf_counter()
    with Join([ddp]) if join else nullcontext():
        for i in range(mine):
            x, y = (t.to(ctx.device) for t in next(data))
            loss_fn(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            ctx.report(batch=i + 1, of=mine)
        trained = time.perf_counter() - t0
        ctx.report(batch=mine, of=mine, done=True)
    total = time.perf_counter() - t0
    return {
        "rank": ctx.rank,
        "batches": mine,
        "trained_s": trained,
        "shadowed_steps": max(batches) - mine if join else 0,
        "joined_s": total - trained,
    }


def sampler_padding(dataset_size: int, world_size: int) -> pd.DataFrame:
    """What ``DistributedSampler`` does when ``dataset_size`` does not divide by ``world_size``,
    counted by running it: with ``drop_last=False`` it pads the shards with repeated samples
    (every rank gets the same count, some samples are seen twice); with ``drop_last=True`` it
    drops the remainder (some samples are never seen this epoch)."""
    import pandas as pd

    class _Sized:
        def __len__(self):
            return dataset_size

    rows = []
    for drop_last in (False, True):
        shards = [
            list(
                DistributedSampler(
                    _Sized(),
                    num_replicas=world_size,
                    rank=r,
                    shuffle=True,
                    seed=0,
                    drop_last=drop_last,
                )
            )
            for r in range(world_size)
        ]
        seen = [i for s in shards for i in s]
        rows.append(
            {
                "drop_last": drop_last,
                "dataset_size": dataset_size,
                "world_size": world_size,
                "per_rank": len(shards[0]),
                "seen": len(seen),
                "repeated": len(seen) - len(set(seen)),
                "dropped": dataset_size - len(set(seen)),
            }
        )
    return pd.DataFrame(rows)
