"""Load balancing inside a rank: stragglers, data skew, dynamic shares and uneven inputs.

Every data-parallel step ends at a synchronisation that the slowest rank gates: a rank that is
twice as slow (an older GPU, a busy node) makes every other rank wait for it, every step. This
module makes that visible and fixes it, on ``ddp_naive`` and ``ddp`` (``ddp_naive``'s gradient
all-reduce runs after backward, so each rank can time its wait there; DDP hides the same wait
inside its overlapped backward):

* **slowdown** (``RunConfig.slowdown``): rank r computes ``factor`` times slower. After each
  backward it sleeps ``(factor - 1)`` times the compute it just did, so it really takes longer
  per sample without burning the core a faster rank needs.
* **skew** (``RunConfig.skew``): the ranks hold unequal amounts of data (the last rank
  ``1 + skew`` times the first's, linearly in between).
* **arrival**: before the gradient all-reduce every rank all-gathers how long it computed. The
  all-gather returns when the last rank arrives, so its duration is this rank's **wait**; the
  gathered times tell every rank, identically, how fast each rank is.
* **dynamic shares** (``rebalance="dynamic"``): every ``rebalance_every`` steps each rank's share
  of the global batch is set in proportion to its measured throughput (samples per second of
  compute). Each rank's loss is weighted by its share (``n_r * world_size / B``), so after the
  all-reduce's average the gradient is exactly the whole global batch's mean gradient: the same
  update as single-device training, whatever the shares.
* **join** (``rebalance="join"``): uneven inputs. Each rank runs through its own data at a fixed
  batch, so a rank with more data runs more steps; ``torch.distributed.algorithms.Join`` lets the
  ranks that ran out shadow the all-reduces of those still training (``labkit.rank.join``).

None of this is in the shared loop: ``ddp_naive`` and ``ddp`` compose it when ``cfg.balancing``
(``balanced``: the loop handed this rank's data, its weighted loss and, for ``ddp_naive``, the
balancer's sync), and the balancer acts at the points of the loop's watch. The sync vs async
lab's straggler (``slowdown`` alone) is ``Straggler``, composed by those strategies the same way.
The shares themselves are ``labkit.shares``; what the records say, ``labkit.labs.load_balance``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler, default_collate

from ..dist import RankContext, all_reduce_flat
from ..shares import skew_weights, slowdown_at, split
from .join import JoinableSync, join_context
from .loop import train_loop
from .probes import cpu_seconds
from .watch import Watch

if TYPE_CHECKING:
    from ..config import RunConfig
    from ..data import batches
    from ..factories import Factories
    from .watch import Phase


def balanced(
    cfg: RunConfig, ctx: RankContext, model: nn.Module, data: batches, *, fns: Factories
) -> dict:
    """``train_loop`` with load balancing composed in (``cfg.balancing``: ``ddp_naive`` and
    ``ddp``): this rank's slice of every global batch (or, under join, its own data for as many
    steps as it lasts), its loss's gradient weighted by its share, the straggler's sleep and,
    for ``ddp_naive``, the arrival point and one flat weighted all-reduce instead of its own
    average (DDP's stays inside backward). Join's context wraps the whole loop."""
    bal = Balancer(cfg, ctx, model, data)
    with join_context(bal.joinable):
        return train_loop(
            cfg,
            ctx,
            model,
            bal.batches,
            fns=fns,
            loss_fn=bal.weighted(fns.loss(cfg)),
            sync_grads=None if bal.overlapped else bal.sync,
            steps=bal.steps(cfg.warmup + cfg.steps) - cfg.warmup,
            watch=Watch(cfg, ctx, bal),
        )


def straggler(cfg: RunConfig, ctx: RankContext) -> Straggler | None:
    """The sync vs async lab's straggler (``cfg.slowdown`` alone), or None without one."""
    return Straggler(cfg, ctx.rank) if cfg.slowdown else None


def straggle(slowdown, rank: int, step: int, since: float, clock=time.perf_counter) -> float:
    """Make ``rank`` a straggler at ``step``: sleep (factor - 1) x the compute done since
    ``since`` (a reading of ``clock``); return the factor."""
    factor = slowdown_at(slowdown, rank, step)
    if factor > 1:
        time.sleep((factor - 1) * (clock() - since))
    return factor


class Straggler:
    """A rank made slower in the modes that compute the same work on every rank (local SGD,
    DiLoCo, the parameter server's workers, Hogwild): after each backward it sleeps (factor - 1)
    x the CPU seconds its compute had since the batch arrived (CPU time, not wall time: a
    synchronous mode's backward also waits in all-reduces). Its records carry ``slowdown``."""

    def __init__(self, cfg: RunConfig, rank: int):
        self.slowdown, self.rank, self.warmup = cfg.slowdown, rank, cfg.warmup
        self.threads = torch.get_num_threads()
        self.step, self.since, self.factor = 0, 0.0, 1.0

    def clock(self) -> float:
        return cpu_seconds(self.threads)

    def step_start(self, i: int) -> None:
        self.step = i - self.warmup

    def exit(self, phase: Phase) -> None:
        if phase.name == "data":
            self.since = self.clock()
        elif phase.name == "backward":  # inside the backward phase: a slower device's compute
            self.factor = straggle(self.slowdown, self.rank, self.step, self.since, self.clock)

    def step_end(self, i: int, rec: dict) -> None:
        rec["slowdown"] = self.factor


class _Weighted(torch.autograd.Function):
    """The loss as it is (what the rank reports), its gradient times ``weight``."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.weight, None


class _Slices:
    """The balancer's data stream: each ``next`` one micro-batch of this rank's, counted."""

    def __init__(self, balancer: Balancer, data: batches):
        self.balancer, self.data, self.loader = balancer, data, data.loader

    def __iter__(self):
        return self

    def __next__(self):
        bal = self.balancer
        x, y = bal.batch() if bal.slices else next(self.data)
        bal.samples += len(x)
        bal.last = len(x)
        return x, y


class Balancer:
    """One rank's load balancing, composed into the shared loop by ``balanced``.

    static / dynamic: every step draws the same global batch single-device training draws and
    takes this rank's slice of it (``shares``); join: the rank's own shard at a fixed batch, for
    as many steps as its data lasts. It is a participant of the loop's watch
    (``labkit.rank.watch``): it sleeps inside the phase a slower device would spend longer in,
    times its arrival as the ``wait`` phase, and adds ``slowdown`` and ``share`` to each record.
    """

    # DDP's sleep covers the backward to come, which the watch's calibration times: from the
    # first step on, so warm-up steps straggle too and the last one can set the first shares
    calibrate_early = True

    def __init__(self, cfg: RunConfig, ctx: RankContext, model: nn.Module, data: batches):
        self.cfg, self.rank, self.world_size = cfg, ctx.rank, ctx.world_size
        self.device, self.model, self.dataset = ctx.device, model, data.loader.dataset
        # DDP: gradients are synchronised inside backward, so there is no arrival point to time;
        # each rank keeps its own (compute, samples) and the ranks pool them when shares move
        self.overlapped = hasattr(model, "no_sync")
        self.joinable = JoinableSync(model, ctx.device) if cfg.rebalance == "join" else None
        self.weights = skew_weights(self.world_size, cfg.skew)
        self.shares = split(cfg.global_batch, self.weights)
        self._order = _global_batches(self.dataset, cfg.global_batch, cfg.seed)
        self.batches = _Slices(self, data)
        self.watch: Watch | None = None
        self.window: list[list[tuple[float, float]]] = []  # per step, per rank
        self.own: list[tuple[float, float]] = []  # overlapped: this rank's (compute, samples)
        self.samples = self.last = 0  # this rank's samples in the current step, the last batch's
        self.step, self.slowdown = 0, 1.0
        self._t0 = self._since = 0.0

    # -- data, loss, sync: what the loop is handed
    @property
    def slices(self) -> bool:
        """static / dynamic: this rank trains a slice of every global batch (else join: its
        own shard, at a fixed batch)."""
        return self.joinable is None

    def batch(self):
        """This rank's slice of the next global batch (every rank draws the same one)."""
        idx = next(self._order)
        start = sum(self.shares[: self.rank])
        mine = idx[start : start + self.shares[self.rank]]
        return default_collate([self.dataset[i] for i in mine])

    @property
    def loss_scale(self) -> float:
        """Weight of this rank's mean loss so that the all-reduce's average (sum / world size)
        is the global batch's mean gradient: n_r * world_size / B."""
        return self.shares[self.rank] * self.world_size / self.cfg.global_batch

    def weighted(self, loss_fn):
        """``loss_fn`` whose gradient is weighted by this rank's share (slices only)."""
        if not self.slices:
            return loss_fn
        return lambda out, y: _Weighted.apply(loss_fn(out, y), self.loss_scale)

    def steps(self, total: int) -> int:
        """Steps this rank trains (warm-up included): all of them, except under join, where a
        rank with less data runs out sooner (rank r: ``total * weight_r / max weight``)."""
        if self.cfg.rebalance != "join":
            return total
        return max(1, round(total * self.weights[self.rank] / max(self.weights)))

    def sync(self) -> None:
        """``ddp_naive``'s gradient average at the arrival point (the ``wait`` phase): under
        join, ``JoinableSync``'s (the ranks that ran out shadow it); else one flat all-reduce
        of every gradient, so that what a run measures is the balance, not one latency per
        parameter tensor. Each rank's loss was weighted by its share, so the average is the
        global batch's mean gradient."""
        with self.watch.phase("wait"):
            self.arrive(self.samples)
        if self.joinable is not None:
            self.joinable.reduce(self.samples)
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        all_reduce_flat(grads)
        for g in grads:
            g /= self.world_size

    # -- the watch's points: the step, the sleep, the record
    def attach(self, watch: Watch) -> None:
        self.watch = watch

    def step_start(self, i: int) -> None:
        self.step, self.samples, self.slowdown = i - self.cfg.warmup, 0, 1.0
        self._t0 = time.perf_counter()

    def exit(self, phase: Phase) -> None:
        """A slower device: after its data arrived, it computes ``factor`` times as long. DDP's
        gradients leave during backward, so it sleeps at the end of forward for the forward it
        did and the backward to come; ``ddp_naive`` sleeps at the end of backward."""
        if phase.name == "data":
            self._since = time.perf_counter()
        elif phase.name == ("forward" if self.overlapped else "backward"):
            to_come = self.watch.backward_estimate(self.last) if self.overlapped else 0.0
            self.slowdown = self.slow_down(self.step, self._since, to_come)

    def step_end(self, i: int, rec: dict) -> None:
        rec["slowdown"] = self.slowdown
        rec["share"] = rec["samples"] / self.cfg.global_batch
        if self.overlapped:
            self.record(rec["forward_s"] + rec["backward_s"], rec["samples"])
        self.end_step(i - self.cfg.warmup)

    # -- compute and arrival
    def slow_down(self, step: int, since: float, to_come: float = 0.0) -> float:
        """Sleep (factor - 1) x the compute since ``since`` (plus ``to_come`` seconds of compute
        this step will still do); return the factor."""
        factor = slowdown_at(self.cfg.slowdown, self.rank, step)
        if factor > 1:
            time.sleep((factor - 1) * (time.perf_counter() - since + to_come))
        return factor

    def record(self, compute_s: float, samples: int) -> None:
        """Overlapped (DDP): this step's own compute seconds and samples, for the next share
        update (the step's wait for the others is inside backward's all-reduce)."""
        self.own.append((compute_s, float(samples)))

    def arrive(self, samples: int) -> float:
        """All-gather (compute seconds, samples) of every rank; return the seconds this rank
        waited for the last one to arrive. Under join: notify the join context instead."""
        if self.joinable is not None:
            return self.joinable.notify()
        compute = time.perf_counter() - self._t0
        mine = torch.tensor([compute, float(samples)], dtype=torch.float64, device=self.device)
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        t = time.perf_counter()
        dist.all_gather(every, mine)
        wait = time.perf_counter() - t
        self.window.append([(float(c), float(n)) for c, n in (e.tolist() for e in every)])
        return wait

    def end_step(self, step: int) -> None:
        """Dynamic: after every ``rebalance_every`` measured steps, shares follow throughput
        over the last ``2 x rebalance_every`` steps (one step's compute time is noisy on a shared
        machine, benchmarks/README.md "Behind the code"; twice the evidence halves the shares'
        jitter, and a rank that slows down still moves them at the next rebalance); and once
        before the first measured step, from the last warm-up step (the first one pays one-off
        costs and is no evidence), so measured steps do not start from even shares."""
        dynamic = self.cfg.rebalance == "dynamic"
        if step < 0:
            if dynamic and step == -1 and self.cfg.warmup >= 2:
                self._rebalance(self._pooled(1))
            self.window.clear()
            self.own.clear()
            return
        if dynamic and (step + 1) % self.cfg.rebalance_every == 0:
            self._rebalance(self._pooled(2 * self.cfg.rebalance_every))

    def _pooled(self, steps: int) -> list[list[tuple[float, float]]]:
        """Every rank's (compute, samples) over the last ``steps`` steps: gathered at each
        arrival (ddp_naive), or now in one all-gather of each rank's own sums (DDP)."""
        if not self.overlapped:
            del self.window[:-steps]
            return self.window
        del self.own[:-steps]
        mine = torch.tensor(
            [sum(c for c, _ in self.own), sum(n for _, n in self.own)],
            dtype=torch.float64,
            device=self.device,
        )
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        return [[tuple(e.tolist()) for e in every]]

    def _rebalance(self, window) -> None:
        rates = [
            sum(n for _, n in (s[r] for s in window))
            / max(1e-9, sum(c for c, _ in (s[r] for s in window)))
            for r in range(self.world_size)
        ]
        self.shares = split(self.cfg.global_batch, rates)


def _global_batches(dataset, batch: int, seed: int):
    """Endless index blocks of ``batch``: the order single-device training's loader draws
    (``DistributedSampler`` with one replica, reshuffled every epoch, last partial batch
    dropped), so every rank's slice of block k comes from single's step-k batch."""
    sampler = DistributedSampler(
        dataset, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True
    )
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        order = list(sampler)
        for i in range(0, len(order) - batch + 1, batch):
            yield order[i : i + batch]
        epoch += 1
