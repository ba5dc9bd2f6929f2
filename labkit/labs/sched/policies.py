"""Scheduling policies: who gets GPUs, in what order, and whether a running job can lose them.

A policy is a ranking of jobs (``key``: smaller is served first) plus a few flags the simulator
(``labkit.labs.sched.sim``) reads:

* ``preemptive``: a waiting job may take GPUs from running jobs ranked strictly below it;
* ``round_s``: the whole allocation is recomputed every round (time-sharing policies whose
  ranking changes while jobs wait); between rounds, free GPUs go to waiting jobs in the last
  round's ranking, newcomers after them by arrival;
* ``elastic``: the policy also picks how many workers each job gets (``elastic_targets``).

Every policy is work-conserving: a job that does not fit is skipped and smaller ones behind it
start (backfilling), so no policy leaves GPUs idle while a waiting job would fit.

Policies (the papers they follow, in the simplified form a teaching simulator can state exactly):

``fifo``       arrival order, never preempts.
``srtf``       shortest remaining time (at the requested size) first, preemptive.
``priority``   higher ``priority`` first, then arrival; preemptive (an arrival evicts the most
               recent jobs of strictly lower priority; within one priority it is FIFO).
``las``        Tiresias' discretised two-dimensional least attained service (Gu et al.,
               NSDI'19): a job's attained service is GPUs x seconds it has held; queues split at
               ``thresholds`` (GPU-seconds; default 0.5, 5 and 50 GPU-hours, chosen on generated
               traces: benchmarks/README.md, "Behind the code"), lower queue first, arrival
               order inside a queue; preemptive. Tiresias' starvation guard (promotion after a
               long wait) is left out.
``maxmin``     max-min fairness of normalised throughput (Gavel's ``max_min_fairness``, as rounds):
               each round runs the jobs that have held their requested GPUs for the smallest share
               of their time in the system.
``ftf``        finish-time fairness (Themis, Mahajan et al., NSDI'20, as rounds): each round runs
               the jobs with the largest estimated rho = (time in system + remaining time alone) /
               (time alone), the jobs that are worst off relative to running alone.
``elastic``    Pollux-like (Qiao et al., OSDI'21): every job gets one worker if there are enough
               (priority, then arrival), then each further GPU goes to the job whose speed-up
               gains most from it (``Curve.speedup``, with the placement penalty when it would span
               nodes); workers are added or removed while jobs run, each change a restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass
class Policy:
    name: str
    preemptive: bool = False
    round_s: float | None = None
    elastic: bool = False
    thresholds: tuple = ()  # las: GPU-second boundaries between queues

    def key(self, s, now: float) -> tuple:
        """Rank of job state ``s`` at ``now``: smaller runs first."""
        raise NotImplementedError

    def rank(self, states, now: float) -> list:
        """``states`` best first: sorted by ``key`` (the round policies compute the same keys
        for all jobs at once, in numpy; the same floating-point operations, the same order)."""
        return sorted(states, key=lambda s: self.key(s, now))

    def running_key(self, s, now: float) -> tuple:
        """A key that orders *running* jobs as ``key`` will at any later moment while they run
        (the simulator keeps running jobs in a heap and does not re-key them as time passes)."""
        return self.key(s, now)

    def evicts(self, key: tuple, victim: tuple) -> bool:
        """Whether a waiting job ranked ``key`` may take a running job's GPUs (its ``key``)."""
        return key < victim

    def level(self, gpu_s: float) -> int:
        gpu_s += 1e-9 * (1 + gpu_s)  # at a boundary (up to rounding): the next queue
        return sum(gpu_s >= t for t in self.thresholds)

    def next_threshold(self, gpu_s: float) -> float | None:
        return next((t for t in self.thresholds if t > gpu_s), None)


class FIFO(Policy):
    def __init__(self):
        super().__init__("fifo")

    def key(self, s, now):
        return (s.job.arrival_s, s.job.job_id)


class SRTF(Policy):
    def __init__(self):
        super().__init__("srtf", preemptive=True)

    def key(self, s, now):
        return (s.remaining_alone_s(now), s.job.arrival_s, s.job.job_id)

    def running_key(self, s, now):
        # every running job's remaining time shrinks one second per second (once it is ready),
        # so the order of their remaining times is the order of their finish times
        finish = max(now, s.ready_t) + s.remaining_alone_s(now)
        return (finish, s.job.arrival_s, s.job.job_id)


class Priority(Policy):
    def __init__(self):
        super().__init__("priority", preemptive=True)

    def key(self, s, now):
        return (-s.job.priority, s.job.arrival_s, s.job.job_id)

    def evicts(self, key, victim):
        return key[0] < victim[0]  # only a strictly higher priority; its own level is FIFO


class LAS(Policy):
    def __init__(self, thresholds: Sequence[float] = (1800.0, 18000.0, 180000.0)):
        th = tuple(sorted(float(t) for t in thresholds))
        if any(t <= 0 for t in th):
            raise ValueError(f"las thresholds must be positive GPU-seconds, got {thresholds}")
        super().__init__("las", preemptive=True, thresholds=th)

    def key(self, s, now):
        return (self.level(s.gpu_s_at(now)), s.job.arrival_s, s.job.job_id)


class MaxMin(Policy):
    def __init__(self, round_s: float = 360.0):
        super().__init__("maxmin", round_s=round_s)

    def key(self, s, now):
        age = now - s.job.arrival_s
        share = s.run_s_at(now) / age if age > 0 else 0.0
        return (share, s.job.arrival_s, s.job.job_id)

    def rank(self, states, now):
        if len(states) < 64:  # a few jobs: numpy's set-up costs more than it saves
            return super().rank(states, now)
        # one pass over the jobs (a waiting job's clock stops: last_t = now adds nothing)
        flat: list = []
        put = flat.extend
        for s in states:
            j = s.job
            put((s.run_s, s.last_t if s.alloc else now, j.arrival_s, j.job_id))
        run, last, arrival, ids = np.array(flat, dtype=float).reshape(-1, 4).T
        run = run + (now - last)
        age = now - arrival
        share = np.divide(run, age, out=np.zeros_like(run), where=age > 0)
        return _lexsorted(states, share, arrival, ids)


class FinishTimeFairness(Policy):
    def __init__(self, round_s: float = 360.0):
        super().__init__("ftf", round_s=round_s)

    def key(self, s, now):
        rho = (now - s.job.arrival_s + s.remaining_alone_s(now)) / s.alone_s
        return (-rho, s.job.arrival_s, s.job.job_id)

    def rank(self, states, now):
        if len(states) < 64:
            return super().rank(states, now)
        flat: list = []
        put = flat.extend
        for s in states:
            j, t0 = s.job, s.last_t if s.last_t > s.ready_t else s.ready_t
            put((s.rate, t0, s.done, j.work, s.req_rate, j.arrival_s, s.alone_s, j.job_id))
        cols = np.array(flat, dtype=float).reshape(-1, 8).T
        rate, t0, done, work, req_rate, arrival, alone_s, ids = cols
        done = done + np.where((rate != 0) & (now > t0), rate * (now - t0), 0.0)
        remaining = np.maximum(0.0, work - done) / req_rate
        rho = (now - arrival + remaining) / alone_s
        return _lexsorted(states, -rho, arrival, ids)


class Elastic(Policy):
    def __init__(self, round_s: float = 360.0):
        super().__init__("elastic", round_s=round_s, elastic=True)

    def key(self, s, now):
        return (-s.job.priority, s.job.arrival_s, s.job.job_id)

    def evicts(self, key, victim):
        return key[0] < victim[0]  # only a strictly higher priority; its own level is FIFO


def _lexsorted(states, primary: np.ndarray, arrival: np.ndarray, ids: np.ndarray) -> list:
    """``states`` in the order of the tuples (primary, arrival, job id): what ``sorted`` on
    ``key`` gives (every job id differs, so no two keys tie)."""
    return [states[i] for i in np.lexsort((ids, arrival, primary)).tolist()]


POLICIES = {
    "fifo": FIFO,
    "srtf": SRTF,
    "priority": Priority,
    "las": LAS,
    "maxmin": MaxMin,
    "ftf": FinishTimeFairness,
    "elastic": Elastic,
}


def make_policy(name: str | Policy, **options) -> Policy:
    """A policy by name; ``options``: ``round_s`` (maxmin, ftf, elastic), ``thresholds`` (las)."""
    if isinstance(name, Policy):
        return name
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    cls = POLICIES[name]
    accepted = {
        "las": ("thresholds",),
        "maxmin": ("round_s",),
        "ftf": ("round_s",),
        "elastic": ("round_s",),
    }.get(name, ())
    kwargs = {k: v for k, v in options.items() if k in accepted and v is not None}
    if "round_s" in kwargs and not kwargs["round_s"] > 0:
        raise ValueError(f"round_s must be positive, got {kwargs['round_s']}")
    return cls(**kwargs)


def greedy_targets(ranked, total_gpus: int) -> dict:
    """The allocation a ranking gives: walk the jobs in ``ranked`` order (best first), give each
    its request if it still fits, skip it otherwise. {job_id: gpus} of the jobs that run."""
    free, target = total_gpus, {}
    for s in ranked:
        if s.job.gpus <= free:
            target[s.job.job_id] = s.job.gpus
            free -= s.job.gpus
            if free == 0:
                break
    return target


def elastic_targets(
    states, policy: Policy, now: float, total_gpus: int, gpus_per_node: int
) -> dict:
    """Pollux-like allocation: one worker each in key order while GPUs last, then each spare GPU
    to the largest marginal speed-up (spanning nodes costs the curve's spread factor). A job's
    gains are made non-increasing (a running minimum: it grows past a node boundary only while
    that still pays) and stop at the first that gains nothing; then giving GPUs one by one to
    the largest gain is picking the largest gains overall (ties: key order, then fewer workers),
    which numpy does at once."""
    import numpy as np

    order = sorted(states, key=lambda s: policy.key(s, now))[:total_gpus]
    target = {s.job.job_id: 1 for s in order}
    free = total_gpus - len(target)
    if free <= 0 or not target:
        return target
    groups: dict = {}  # jobs sharing a curve share its gains
    for rank, s in enumerate(order):
        c = s.job.curve
        if id(c) in groups:
            groups[id(c)][1].append(rank)
        else:
            groups[id(c)] = (c, [rank])
    gains, who, ks = [], [], []
    for curve, ranks in groups.values():
        g = _gain_table(curve, gpus_per_node)
        if len(g):
            n = len(ranks)
            gains.append(np.broadcast_to(g, (n, len(g))).ravel())
            who.append(np.repeat(np.asarray(ranks), len(g)))
            ks.append(np.broadcast_to(np.arange(len(g)), (n, len(g))).ravel())
    if not gains:
        return target
    gains, who, ks = np.concatenate(gains), np.concatenate(who), np.concatenate(ks)
    pick = np.lexsort((ks, who, -gains))[:free]
    extra = np.bincount(who[pick], minlength=len(order))
    for rank in np.flatnonzero(extra).tolist():
        target[order[rank].job.job_id] += int(extra[rank])
    return target


_GAINS: dict = {}


def _gain_table(curve, gpus_per_node: int):
    """Speed-up gained by worker k + 1 over k (k = 1, 2, ...), non-increasing, positive only."""
    import numpy as np

    key = (id(curve), gpus_per_node)
    if key not in _GAINS or _GAINS[key][0] is not curve:
        sp = [curve(k, k > gpus_per_node) / curve(1) for k in range(1, curve.max_workers + 1)]
        g = np.minimum.accumulate(np.diff(np.array(sp))) if len(sp) > 1 else np.zeros(0)
        stop = int(np.argmax(g <= 1e-9)) if (g <= 1e-9).any() else len(g)
        _GAINS[key] = (curve, g[:stop])
    return _GAINS[key][1]
