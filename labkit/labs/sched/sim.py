"""An event-driven cluster simulator: jobs with throughput curves on N nodes x G GPUs.

Events are arrivals, completions, Tiresias queue demotions and (for time-sharing and elastic
policies) round boundaries, kept in one heap; every stale event (a job's allocation changed since
it was scheduled) is skipped by a version number. Between events each running job progresses at
``curve(workers)`` samples/s (times the curve's ``spread_factor`` when its workers span nodes)
once its start-up or restart delay is over. Work done is settled lazily, only when a job's
allocation changes, so an event costs O(log jobs) for the ranking policies (heaps of waiting jobs
per GPU size and of running jobs, worst first) and a sort of the active jobs per round for the
round-based ones: 10,000 jobs on 1,024 GPUs take seconds (``benchmarks/sched_speed.py``).

Placement: ``consolidated`` puts a job on the fullest node it fits in (best fit), spilling over
nodes only when no node has room; ``spread`` takes one GPU from each of the emptiest nodes.
Restarts: a job pays ``startup_s`` before its first step and ``restart_s`` (checkpoint, re-launch,
resume: measured on this machine for the replay) after every preemption or resize, holding its
GPUs meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .jobs import Job
from .policies import Policy, elastic_targets, greedy_targets, make_policy

ARRIVE, FINISH, LEVEL, ROUND = 1, 0, 2, 3  # at equal times: finishes first, then arrivals
PLACEMENTS = ("consolidated", "spread")
REPORT_EVERY_S = 0.1  # progress and the stop request, read this often while simulating


class SimulationStopped(Exception):
    """``should_stop`` answered yes: the simulation was abandoned part way (it holds nothing,
    so nothing needs cleaning up)."""


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    placement: str = "consolidated"

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"a cluster needs at least 1 node of 1 GPU, got {self.nodes}x{self.gpus_per_node}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def parse(cls, text: str, placement: str = "consolidated") -> Cluster:
        """'4x8' -> 4 nodes of 8 GPUs."""
        try:
            n, g = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"cluster {text!r} is not NODESxGPUS, e.g. 4x8") from None
        return cls(n, g, placement)

    def __str__(self):
        return f"{self.nodes}x{self.gpus_per_node}"


class _State:
    """A job while it is in the system: allocation and lazily settled progress."""

    __slots__ = (
        "job",
        "alloc",
        "nodes",
        "rate",
        "done",
        "last_t",
        "ready_t",
        "version",
        "gpu_s",
        "run_s",
        "seg_start",
        "started",
        "req_rate",
        "alone_s",
    )

    def __init__(self, job: Job):
        self.job, self.alloc, self.nodes, self.rate = job, 0, (), 0.0
        self.done, self.last_t, self.ready_t, self.version = 0.0, job.arrival_s, 0.0, 0
        self.gpu_s = self.run_s = 0.0
        self.seg_start, self.started = None, False
        self.req_rate, self.alone_s = job.curve(job.gpus), job.duration_alone_s  # keys use them

    def done_at(self, now: float) -> float:
        t0 = max(self.last_t, self.ready_t)
        return self.done + (self.rate * (now - t0) if self.rate and now > t0 else 0.0)

    def remaining_alone_s(self, now: float) -> float:
        return max(0.0, self.job.work - self.done_at(now)) / self.req_rate

    def gpu_s_at(self, now: float) -> float:
        return self.gpu_s + self.alloc * (now - self.last_t)

    def run_s_at(self, now: float) -> float:
        return self.run_s + (now - self.last_t if self.alloc else 0.0)

    def settle(self, now: float) -> None:
        last = self.last_t
        if now == last:  # settled at this instant already: nothing has moved since
            return
        if self.alloc:  # (``done_at``, ``gpu_s_at`` and ``run_s_at``, inline: the hot path)
            t0 = last if last > self.ready_t else self.ready_t
            if now > t0:
                done, work = self.done + self.rate * (now - t0), self.job.work
                self.done = done if done < work else work
            self.gpu_s += self.alloc * (now - last)
            self.run_s += now - last
        self.last_t = now


def _job_id(s: _State) -> int:
    return s.job.job_id


class _Rev:
    """Reverses a key's order in a min-heap (the worst running job on top)."""

    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k

    def __lt__(self, other):
        return other.k < self.k


@dataclass
class SimResult:
    policy: str
    cluster: str
    jobs: list[Job]
    gantt: list[dict] = field(default_factory=list)
    busy_gpu_s: float = 0.0
    total_gpus: int = 0
    events: int = 0
    start_gpu_s: float = 0.0  # of busy_gpu_s, held while starting or restarting

    def metrics(self) -> dict:
        return metrics(self.jobs, self.total_gpus, self.policy, self.busy_gpu_s, self.start_gpu_s)


class Simulator:
    defer_finishes = True  # round policies: see ``deferred`` (off: a FINISH event per start)

    def __init__(
        self,
        jobs: Sequence[Job],
        cluster: Cluster,
        policy: Policy | str,
        record_gantt: bool = True,
        *,
        on_progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        **policy_options,
    ):
        """``on_progress(finished, total)`` jobs and ``should_stop()`` are called every
        ``REPORT_EVERY_S`` of simulation (and progress once at the end); a yes from
        ``should_stop`` raises ``SimulationStopped``."""
        from .traces import check_fits

        check_fits(jobs, cluster.gpus)
        self.cluster, self.policy = cluster, make_policy(policy, **policy_options)
        self.jobs = [j.fresh() for j in sorted(jobs, key=lambda j: (j.arrival_s, j.job_id))]
        self.record = record_gantt
        self.free_nodes = [cluster.gpus_per_node] * cluster.nodes
        self.consolidated = cluster.placement == "consolidated"
        # best fit takes the lowest-numbered empty node: a heap of the nodes that emptied (an
        # entry is stale once its node holds a job again; the set above says which are empty)
        self.empty_heap = list(range(cluster.nodes))
        # nodes by their free GPUs, so best fit looks at G+1 buckets, not every node
        self.nodes_with = [set() for _ in range(cluster.gpus_per_node + 1)]
        self.nodes_with[cluster.gpus_per_node].update(range(cluster.nodes))
        self.free = cluster.gpus
        self.events: list = []
        self.seq = itertools.count()
        self.active: dict[int, _State] = {}
        self.waiting: dict[int, list] = {}  # GPU request -> heap of (key, id)
        self.running: list = []  # heap of (_Rev(key), id, version)
        self.gantt: list[dict] = []
        self.busy_gpu_s = 0.0
        self.start_gpu_s = 0.0  # GPU-seconds held while starting or restarting (no step runs)
        self.round_pending = False
        self.next_round_t = math.inf  # the pending ROUND event's time (round policies)
        # round policies: running jobs that finish after the next round, their FINISH event not
        # yet pushed ({id: (state, finish time)}); pushed at the last round before it. A job
        # rotated out first never enters the event heap, which otherwise filled with
        # hundreds of thousands of stale finishes on a loaded cluster
        self.deferred: dict[int, tuple] = {}
        self.fill_order: list = []  # round policies: who fills free GPUs next
        self.fill_from = 0  # fill_order[:fill_from] started or finished since the round
        self.changed = True  # arrivals or finishes since the last round
        self.n_events = 0
        self.n_finished = 0
        self.on_progress, self.should_stop = on_progress, should_stop
        # no one to report to: no clock read per event (the speed benchmark, sim.compare)
        listening = on_progress is not None or should_stop is not None
        self.next_report = time.monotonic() + REPORT_EVERY_S if listening else math.inf

    # ---- events ------------------------------------------------------------------------------

    def push(self, t: float, kind: int, jid: int = -1, version: int = 0) -> None:
        heapq.heappush(self.events, (t, kind, next(self.seq), jid, version))

    def run(self) -> SimResult:
        for j in self.jobs:
            self.push(j.arrival_s, ARRIVE, j.job_id)
        by_id = {j.job_id: j for j in self.jobs}
        while self.events:
            now = self.events[0][0]
            rounds = acted = False  # stale events alone change nothing
            while self.events and self.events[0][0] == now:
                t, kind, _, jid, version = heapq.heappop(self.events)
                self.n_events += 1
                if time.monotonic() >= self.next_report:
                    self.report()
                if kind == ARRIVE:
                    s = _State(by_id[jid])
                    self.active[jid] = s
                    self.enqueue(s, now)
                    self.fill_order.append(s)
                    self.changed = acted = True
                elif kind == FINISH:
                    s = self.active.get(jid)
                    if s is not None and s.version == version:
                        self.finish(s, now)
                        self.changed = acted = True
                elif kind == LEVEL:
                    s = self.active.get(jid)
                    if s is not None and s.version == version and s.alloc:
                        self.reschedule(s, now)  # its key got worse: re-rank it among running
                        acted = True
                elif kind == ROUND:
                    self.round_pending, rounds, acted = False, True, True
                    if self.active:  # the next round is known before anyone starts in this one
                        self.push_round(now)
            if acted:
                self.schedule(now, rounds)
            if rounds and self.deferred:
                self.release_finishes()
            if self.policy.round_s and self.active and not self.round_pending:
                self.push_round(now)
        if self.on_progress:
            self.on_progress(self.n_finished, len(self.jobs))
        return SimResult(
            self.policy.name,
            str(self.cluster),
            self.jobs,
            self.gantt,
            self.busy_gpu_s,
            self.cluster.gpus,
            self.n_events,
            self.start_gpu_s,
        )

    def push_round(self, now: float) -> None:
        r = self.policy.round_s
        t = (math.floor(now / r) + 1) * r
        self.next_round_t = t if t > now else t + r  # (a boundary rounded down: the next one)
        self.push(self.next_round_t, ROUND)
        self.round_pending = True

    def release_finishes(self) -> None:
        """Push the FINISH events of deferred jobs that finish before the next round."""
        due = [jid for jid, (_, t) in self.deferred.items() if t <= self.next_round_t]
        for jid in due:
            s, t = self.deferred.pop(jid)
            self.push(t, FINISH, jid, s.version)

    def report(self) -> None:
        if self.should_stop and self.should_stop():
            raise SimulationStopped(
                f"stopped after {self.n_finished} of {len(self.jobs)} jobs finished"
            )
        if self.on_progress:
            self.on_progress(self.n_finished, len(self.jobs))
        self.next_report = time.monotonic() + REPORT_EVERY_S

    # ---- queues ------------------------------------------------------------------------------

    def enqueue(self, s: _State, now: float) -> None:
        if self.policy.round_s:  # round policies rank every job at each round instead
            return
        heapq.heappush(
            self.waiting.setdefault(s.job.gpus, []), (self.policy.key(s, now), s.job.job_id)
        )

    def best_waiting(self, limit: int | None = None):
        """The top-ranked waiting job (of at most ``limit`` GPUs): (key, id, size) or None."""
        best = None
        for size, heap in self.waiting.items():
            if limit is not None and size > limit:
                continue
            while (
                heap
                and self.active.get(heap[0][1]) is None
                or (heap and self.active[heap[0][1]].alloc)
            ):
                heapq.heappop(heap)  # finished or running: stale entry
            if heap and (best is None or heap[0][0] < best[0]):
                best = (heap[0][0], heap[0][1], size)
        return best

    def pop_worst_running(self):
        while self.running:
            rk, jid, version = heapq.heappop(self.running)
            s = self.active.get(jid)
            if s is not None and s.alloc and s.version == version:
                return s
        return None

    # ---- scheduling --------------------------------------------------------------------------

    def schedule(self, now: float, rounds: bool) -> None:
        p = self.policy
        if rounds and p.round_s:
            states = list(self.active.values())
            # the same jobs give the same elastic allocation; with no job waiting, a ranking
            # runs every job it already runs: skip the recompute (it is the costly part)
            if not self.changed if p.elastic else all(s.alloc for s in states):
                return
            self.changed = False
            if p.elastic:
                target = elastic_targets(
                    states, p, now, self.cluster.gpus, self.cluster.gpus_per_node
                )
            else:
                ranked = p.rank(states, now)
                target = greedy_targets(ranked, self.cluster.gpus)
                self.fill_order = [s for s in ranked if s.job.job_id not in target]
                self.fill_from = 0
            self.apply(target, now)
            return
        if self.free == 0:  # between rounds nothing can start
            if p.elastic or p.round_s:
                return
        if p.elastic:  # between rounds: one worker per newcomer
            for s in sorted(
                (s for s in self.active.values() if not s.alloc), key=lambda s: p.key(s, now)
            ):
                if self.free == 0:
                    break
                self.start(s, 1, now)
            return
        if p.round_s:  # between rounds: fill, never preempt,
            # in the last round's ranking (then newcomers by arrival): re-ranking every waiting
            # job at every event made a loaded cluster's time-sharing policies slow
            # (one pass; the finished are dropped when the next round ranks again, and the
            # front that started or finished since, which stays so until then, is skipped)
            order, i = self.fill_order, self.fill_from
            while i < len(order) and (order[i].alloc or order[i].job.finish_s is not None):
                i += 1
            self.fill_from = i
            for j in range(i, len(order)):
                s = order[j]
                if not s.alloc and s.job.gpus <= self.free and s.job.finish_s is None:
                    self.start(s, s.job.gpus, now)
                    if self.free == 0:
                        break
            return
        while True:
            best = self.best_waiting()
            if best is None:
                return
            key, jid, size = best
            s = self.active[jid]
            if size <= self.free:
                self.start(s, size, now)
                continue
            if p.preemptive and self.preempt_for(s, key, now):
                continue
            break
        while self.free:  # backfill what fits behind the blocked head
            best = self.best_waiting(limit=self.free)
            if best is None:
                return
            self.start(self.active[best[1]], best[2], now)

    def preempt_for(self, s: _State, key, now: float) -> bool:
        """Evict running jobs ranked strictly below ``s`` (worst first) if that frees enough."""
        victims, freed = [], 0
        while self.free + freed < s.job.gpus:
            v = self.pop_worst_running()
            if v is None:
                break
            if not self.policy.evicts(key, self.policy.key(v, now)):
                self.push_running(v, now)
                break
            victims.append(v)
            freed += v.alloc
        if self.free + freed < s.job.gpus:
            for v in victims:
                self.push_running(v, now)
            return False
        for v in victims:
            self.stop(v, now)
            self.enqueue(v, now)
        self.start(s, s.job.gpus, now)
        return True

    def apply(self, target: dict, now: float) -> None:
        """Move to a whole new allocation: stop and shrink first, then grow and start (a round
        policy's jobs that stop wait for the next round's ranking: no queue to join)."""
        get = target.get
        changed = [s for s in self.active.values() if s.alloc != get(s.job.job_id, 0)]
        for s in changed:
            if s.alloc:
                self.stop(s, now)
        changed.sort(key=_job_id)
        for s in changed:
            k = get(s.job.job_id, 0)
            if k:
                self.start(s, k, now)

    # ---- one job's allocation ----------------------------------------------------------------

    def _take(self, node: int, count: int) -> None:
        """Change a node's free GPUs by -count (negative: give back), keeping the buckets."""
        f = self.free_nodes[node]
        self.nodes_with[f].discard(node)
        self.free_nodes[node] = f - count
        self.nodes_with[f - count].add(node)

    def place(self, k: int) -> tuple:
        free, G = self.free_nodes, self.cluster.gpus_per_node
        if self.consolidated and k <= G:
            nodes_with = self.nodes_with
            for f in range(k, G + 1):  # best fit: the fullest node with room
                if nodes_with[f]:
                    if f == G:
                        node = heapq.heappop(self.empty_heap)
                        while free[node] != G:
                            node = heapq.heappop(self.empty_heap)
                    else:
                        node = next(iter(nodes_with[f]))
                    nodes_with[f].discard(node)  # ``_take``, inline: the hot path
                    free[node] = f - k
                    nodes_with[f - k].add(node)
                    return ((node, k),)
        counts: dict = {}
        if self.cluster.placement == "spread":  # one GPU from each of the emptiest nodes
            order = sorted(range(len(free)), key=lambda i: -free[i])
            need = k
            while need:
                for i in order:
                    if need and free[i] > counts.get(i, 0):
                        counts[i] = counts.get(i, 0) + 1
                        need -= 1
        else:  # spill over the emptiest nodes
            need = k
            for f in range(G, 0, -1):
                for i in sorted(self.nodes_with[f]):
                    take = min(f, need)
                    counts[i] = take
                    need -= take
                    if not need:
                        break
                if not need:
                    break
        for i, c in counts.items():
            self._take(i, c)
        return tuple(sorted(counts.items()))

    def start(self, s: _State, k: int, now: float) -> None:
        # a job starts only while it holds nothing (no rate, no GPUs): nothing to settle
        s.last_t = now
        s.nodes = nodes = self.place(k)
        s.alloc = k
        self.free -= k
        job = s.job
        s.rate = s.req_rate if k == job.gpus and len(nodes) == 1 else job.curve(k, len(nodes) > 1)
        if s.started:
            job.restarts += 1
            s.ready_t = now + job.restart_s
        else:
            s.started, job.start_s = True, now
            s.ready_t = now + job.startup_s
        s.seg_start = now
        self._arm(s, now)

    def reschedule(self, s: _State, now: float) -> None:
        """New version: its completion (and queue demotion) events, its place among running."""
        s.settle(now)
        self._arm(s, now)

    def _arm(self, s: _State, now: float) -> None:  # ``reschedule`` for a settled job
        s.version += 1
        jid = s.job.job_id
        finish_t = (now if now > s.ready_t else s.ready_t) + (s.job.work - s.done) / s.rate
        if self.round_pending and self.defer_finishes and finish_t > self.next_round_t:
            self.deferred[jid] = (s, finish_t)  # round policies: see ``deferred``
        else:
            self.push(finish_t, FINISH, jid, s.version)
        if self.policy.thresholds:
            # a demotion due now (float rounding left gpu_s a hair below) is not due again
            nxt = self.policy.next_threshold(s.gpu_s + 1e-9 * (1 + s.gpu_s))
            if nxt:
                self.push(now + (nxt - s.gpu_s) / s.alloc, LEVEL, jid, s.version)
        if self.policy.preemptive:
            self.push_running(s, now)

    def push_running(self, s: _State, now: float) -> None:
        if not self.policy.preemptive:  # only preempt_for reads the running heap
            return
        heapq.heappush(
            self.running, (_Rev(self.policy.running_key(s, now)), s.job.job_id, s.version)
        )

    def stop(self, s: _State, now: float) -> None:
        s.settle(now)
        self._segment(s, now)
        free, nodes_with = self.free_nodes, self.nodes_with
        for node, c in s.nodes:  # ``_take(node, -c)``, inline: the hot path
            f = free[node]
            nodes_with[f].discard(node)
            free[node] = f + c
            nodes_with[f + c].add(node)
            if f + c == self.cluster.gpus_per_node:
                heapq.heappush(self.empty_heap, node)
        self.free += s.alloc
        s.alloc, s.nodes, s.rate = 0, (), 0.0
        s.version += 1
        self.deferred.pop(s.job.job_id, None)

    def finish(self, s: _State, now: float) -> None:
        s.settle(now)
        s.done = s.job.work
        self.stop(s, now)
        s.job.finish_s = now
        s.job.gpu_seconds = s.gpu_s
        self.n_finished += 1
        del self.active[s.job.job_id]

    def _segment(self, s: _State, now: float) -> None:
        self.busy_gpu_s += s.alloc * (now - s.seg_start)
        self.start_gpu_s += s.alloc * ((s.ready_t if s.ready_t < now else now) - s.seg_start)
        if self.record and now > s.seg_start:
            self.gantt.append(
                {
                    "job_id": s.job.job_id,
                    "start_s": s.seg_start,
                    "end_s": now,
                    "gpus": s.alloc,
                    "nodes": s.nodes,
                    "spread": len(s.nodes) > 1,
                    "ready_s": min(s.ready_t, now),
                    "priority": s.job.priority,
                }
            )


def simulate(
    jobs: Sequence[Job],
    cluster: Cluster | str,
    policy: Policy | str = "fifo",
    *,
    record_gantt: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    **policy_options,
) -> SimResult:
    """Run ``jobs`` on ``cluster`` ('4x8' or a Cluster) under ``policy``; the jobs you pass are
    not changed (each run works on fresh copies). ``on_progress``/``should_stop``: see
    ``Simulator``."""
    if isinstance(cluster, str):
        cluster = Cluster.parse(cluster)
    return Simulator(
        jobs,
        cluster,
        policy,
        record_gantt,
        on_progress=on_progress,
        should_stop=should_stop,
        **policy_options,
    ).run()


def _pct(values: list[float], q: float) -> float:
    """The q-th percentile, linear between order statistics (numpy's default)."""
    v = sorted(values)
    if not v:
        return math.nan
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def metrics(
    jobs: Sequence[Job],
    total_gpus: int,
    policy: str = "",
    busy_gpu_s: float | None = None,
    start_gpu_s: float | None = None,
) -> dict:
    """One run's numbers. jct = finish - arrival; queue = first start - arrival; makespan = last
    finish - first arrival; utilisation = GPU-seconds held (restarts included) / (GPUs x
    makespan); rho (finish-time fairness) = jct / time alone at the requested size, mean and
    worst; restarts per job counts preemptions and resizes; start share: of the GPU-seconds
    held, those spent starting and restarting (``startup_s``, ``restart_s``), no step running."""
    done = [j for j in jobs if j.finish_s is not None]
    if not done:
        raise ValueError("no job finished")
    jct = [j.jct_s for j in done]
    rho = [j.jct_s / j.duration_alone_s for j in done]
    span = max(j.finish_s for j in done) - min(j.arrival_s for j in done)
    gpu_s = busy_gpu_s if busy_gpu_s is not None else sum(j.gpu_seconds for j in done)
    high = [j.jct_s for j in done if j.priority > 0]
    low = [j.jct_s for j in done if j.priority <= 0]
    return {
        "policy": policy,
        "jobs": len(done),
        "mean_jct_s": sum(jct) / len(jct),
        "p95_jct_s": _pct(jct, 95),
        "p99_jct_s": _pct(jct, 99),
        "mean_queue_s": sum(j.start_s - j.arrival_s for j in done) / len(done),
        "makespan_s": span,
        "utilisation": gpu_s / (total_gpus * span) if span > 0 else math.nan,
        "mean_rho": sum(rho) / len(rho),
        "max_rho": max(rho),
        "gpu_hours": gpu_s / 3600,
        "restarts_per_job": sum(j.restarts for j in done) / len(done),
        "start_share": start_gpu_s / gpu_s if start_gpu_s is not None and gpu_s else math.nan,
        "mean_jct_high_s": sum(high) / len(high) if high else math.nan,
        "mean_jct_low_s": sum(low) / len(low) if low else math.nan,
    }


def compare(jobs: Sequence[Job], cluster: Cluster | str, policies: Sequence[str], **options):
    """One metrics row per policy (a pandas DataFrame) and the runs, same trace and cluster."""
    import pandas as pd

    runs = {p: simulate(jobs, cluster, p, **options) for p in policies}
    return pd.DataFrame([r.metrics() for r in runs.values()]), runs
