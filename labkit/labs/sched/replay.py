"""The real replay: a small trace of short labkit training runs scheduled on this machine's
cores (2 "GPUs" = 2 cores, one thread per worker), with real preemption (checkpoint, stop,
resume: ``labkit.rank.resume``) and real elastic resizing (a job resumes its checkpoint at another
world size: ``single`` on 1 worker, ``ddp`` on 2, the same global batch and update), and the same
trace through the simulator fed with this machine's measured curves and restart costs.

    report = check(6, ["fifo", "las", "elastic"])    # calibrate, replay each policy, simulate
    report.table      # per policy: mean JCT simulated, real, error; the ranking of both

What is measured first (``calibrate``) and handed to the simulator:

* the curve: steps/s of a job at 1 worker (two such jobs at once, as in the replay, sharing the
  memory bandwidth of one machine) and at 2 workers (ddp); from the runs' own step records;
* ``startup_s``: what a run costs besides its steps (launch, model build, teardown);
* ``restart_s``: the same for a run that resumes a checkpoint (load included).

The executor decides with the simulator's own policy objects and allocation functions
(``labkit.labs.sched.policies``): only the clock and the progress are real. Every job runs in its
own thread calling ``labkit.experiment.run``; stopping one sets its cancel event, which terminates
and reaps its ranks (``labkit.launch``); on any error or interrupt every job is stopped the same
way, so no process is left behind.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd

from ...config import RunConfig
from .jobs import Curve, Job
from .policies import elastic_targets, greedy_targets, make_policy
from .sim import Cluster, _State, metrics, simulate

CORES = 2  # this lab's cluster: one node of 2 "GPUs" (cores)
MIN_JOBS, MAX_JOBS = 3, 12
# a job: an MLP big enough that a step is compute, small enough that a job lasts seconds
BASE = RunConfig(
    strategy="single",
    world_size=1,
    model="mlp",
    width=384,
    depth=3,
    global_batch=128,
    dataset_size=4096,
    warmup=0,
    steps=10,
    threads=1,
    timeout_s=120.0,
)
ROUND_S = 2.0  # maxmin, ftf, elastic rounds in the replay (seconds)
LAS_THRESHOLDS = (1.5,)  # GPU-seconds: Tiresias' queue boundary at the replay's scale


def job_config(
    steps: int, workers: int, folder: str, seed: int = 0, pace_s: float = 0.0
) -> RunConfig:
    """One replay job at ``workers`` workers, resuming from ``folder``'s checkpoint if any;
    ``pace_s``: each step lasts at least that long (``RunConfig.pace_s``)."""
    return BASE.replace(
        strategy="single" if workers == 1 else "ddp",
        world_size=workers,
        steps=steps,
        checkpoint_dir=folder,
        checkpoint_every=1,
        seed=seed,
        pace_s=pace_s,
    )


@dataclass
class Calibration:
    """This machine's measured curve and costs for the replay's job."""

    steps_per_s: dict  # workers -> steps/s
    startup_s: dict  # workers -> seconds a fresh run costs besides its steps
    resume_extra_s: float  # what resuming a checkpoint adds to that
    busy: bool = False  # the CPU share of a rank fell below labkit's busy mark

    @property
    def curve(self) -> Curve:
        return Curve(
            "replay mlp (measured)",
            tuple(self.steps_per_s.items()),
            "measured on this machine" + (" (busy)" if self.busy else ""),
        )

    def job(
        self, job_id: int, arrival_s: float, workers: int, steps: int, priority: int = 0
    ) -> Job:
        start = self.startup_s[workers]
        return Job(
            job_id,
            arrival_s,
            workers,
            float(steps),
            self.curve,
            priority,
            startup_s=start,
            restart_s=start + self.resume_extra_s,
        )

    def as_dict(self) -> dict:
        return {
            "steps_per_s": self.steps_per_s,
            "startup_s": self.startup_s,
            "resume_extra_s": self.resume_extra_s,
            "busy": self.busy,
        }


def _timed_run(cfg: RunConfig, cancel=None) -> tuple[float, float, int, bool]:
    """(wall seconds, seconds the steps took, steps, busy) of one run. The steps' time comes
    from the checkpoint timeline's step stamps (``labkit.rank.resume``), so it includes writing a
    checkpoint after every step, as the replay does; the rest of the wall time is start-up
    (launch, model build, resume) and teardown."""
    from ...experiment import run
    from ...rank.resume import read_timeline

    t0 = time.perf_counter()
    res = run(cfg, cancel=cancel)
    wall = time.perf_counter() - t0
    rows = read_timeline(cfg.checkpoint_dir)
    last_start = max(i for i, r in enumerate(rows) if r.get("event") == "start")
    stamps = [r["time"] for r in rows[last_start:] if r.get("event") == "step"]
    n = len(stamps)
    per_step = (stamps[-1] - stamps[0]) / (n - 1) if n > 1 else wall
    return wall, per_step * n, n, _busy(res.records)


def _busy(records) -> bool:
    """The run's ranks did not get their cores: the median step's CPU share fell below labkit's
    busy mark (``labkit.records.BUSY_SHARE``)."""
    from ...records import BUSY_SHARE

    share = records.get("compute_cpu_share")
    return bool(share is not None and share.median() < BUSY_SHARE)


def calibrate(steps: int = 30, folder: str | None = None, pace_s: float = 0.0) -> Calibration:
    """Measure the curve at 1 and 2 workers and the start-up and resume costs (~10 s), of jobs
    paced at ``pace_s`` as ``execute`` paces them."""
    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="labkit-sched-cal-")
    try:
        # the first launch in a process starts labkit's forkserver (seconds): not a job's cost
        _timed_run(job_config(1, 2, os.path.join(folder, "warmup")))

        def cfg(steps: int, workers: int, name: str) -> RunConfig:
            return job_config(steps, workers, os.path.join(folder, name), pace_s=pace_s)

        out: dict = {}

        def one(i: int) -> None:
            out[i] = _timed_run(cfg(steps, 1, f"one{i}"))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BASE.timeout_s + 30)
        if len(out) != 2:
            raise RuntimeError("calibration: a 1-worker run did not finish")
        two = _timed_run(cfg(steps, 2, "two"))
        # resume each 1-worker job's checkpoint for as many steps again, one after the other:
        # the smaller cost of the two, since a hiccup only ever adds time, and one resume's
        # would be charged to every preemption the simulator makes
        resumed = [_timed_run(cfg(2 * steps, 1, f"one{i}")) for i in range(2)]
        rate1 = statistics.mean(n / s for _, s, n, _ in out.values())
        fixed1 = statistics.mean(w - s for w, s, _, _ in out.values())
        extra = max(0.0, min(w - s for w, s, _, _ in resumed) - fixed1)
        busy = any(r[3] for r in (*out.values(), two, *resumed))
        return Calibration(
            {1: rate1, 2: two[2] / two[1]}, {1: fixed1, 2: two[0] - two[1]}, extra, busy
        )
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class ReplayJob:
    job_id: int
    arrival_s: float
    workers: int  # requested "GPUs" (cores): 1 or 2
    steps: int
    priority: int = 0


def small_trace(
    n: int,
    seed: int = 0,
    mean_gap_s: float = 1.0,
    high_priority: float = 0.25,
    steps: tuple[int, int] = (40, 320),
) -> list[ReplayJob]:
    """``n`` jobs: Poisson arrivals, 70 % 1 worker and 30 % 2 (the Philly mix cut at 2),
    log-uniform (heavy-tailed) step counts in ``steps``."""
    if not MIN_JOBS <= n <= MAX_JOBS:
        raise ValueError(f"the replay runs {MIN_JOBS} to {MAX_JOBS} jobs, got {n}")
    rng = random.Random(seed)
    t, jobs = 0.0, []
    lo, hi = math.log(steps[0]), math.log(steps[1])
    for i in range(n):
        jobs.append(
            ReplayJob(
                i,
                round(t, 3),
                1 if rng.random() < 0.7 else 2,
                int(math.exp(rng.uniform(lo, hi))),
                1 if rng.random() < high_priority else 0,
            )
        )
        t += rng.expovariate(1.0 / mean_gap_s)
    return jobs


class _Handle:
    """One job's current run: its thread, cancel event and last reported step."""

    def __init__(self, cfg: RunConfig):
        self.cfg, self.cancel, self.step = cfg, threading.Event(), 0
        self.error: BaseException | None = None
        self.busy = False  # a run that finished: its ranks did not get their cores
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ...experiment import run
        from ...launch import LaunchCancelled

        try:
            res = run(
                self.cfg,
                cancel=self.cancel,
                on_progress=lambda rank, m: setattr(self, "step", max(self.step, m["step"])),
            )
            self.busy = _busy(res.records)
        except LaunchCancelled:
            pass
        except BaseException as exc:  # kept for the executor, which raises it
            self.error = exc

    def stop(self, timeout_s: float) -> None:
        self.cancel.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise RuntimeError(f"a job's run did not stop within {timeout_s:g} s")


def _checkpointed_step(folder: str) -> int:
    from ...rank.resume import read_timeline

    steps = [r["step"] for r in read_timeline(folder) if r.get("event") == "checkpoint"]
    return max(steps, default=0)


def execute(
    trace: Sequence[ReplayJob],
    policy: str,
    calibration: Calibration,
    *,
    folder: str | None = None,
    tick_s: float = 0.05,
    timeout_s: float = 300.0,
    log: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    round_s: float = ROUND_S,
    pace_s: float = 0.0,
):
    """Run ``trace`` for real under ``policy``; returns the jobs (with real start, finish,
    restarts) and the real allocation segments. ``pace_s``: each step lasts at least that long
    (``RunConfig.pace_s``), so a job of n steps is still running n x pace_s after it starts
    however fast the machine computes: a trace's arrivals then land while the jobs they should
    meet are running, which is what a test of preemption or resizing needs."""
    pol = make_policy(policy, round_s=round_s, thresholds=LAS_THRESHOLDS)
    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix=f"labkit-sched-{pol.name}-")
    jobs = {
        j.job_id: calibration.job(j.job_id, j.arrival_s, j.workers, j.steps, j.priority)
        for j in trace
    }
    steps = {j.job_id: j.steps for j in trace}
    pending = sorted(trace, key=lambda j: (j.arrival_s, j.job_id))
    active: dict[int, _State] = {}
    handles: dict[int, _Handle] = {}
    gantt: list[dict] = []
    free, next_round, changed = CORES, round_s, False
    levels: dict[int, int] = {}
    t0 = time.monotonic()

    def now() -> float:
        return time.monotonic() - t0

    def start(s: _State, k: int) -> None:
        nonlocal free
        jid = s.job.job_id
        s.settle(now())
        if s.started:
            s.job.restarts += 1
        else:
            s.started, s.job.start_s = True, now()
        s.alloc, s.seg_start = k, now()
        free -= k
        folder_j = os.path.join(folder, f"job{jid}")
        handles[jid] = _Handle(job_config(steps[jid], k, folder_j, pace_s=pace_s))

    def stop(s: _State) -> None:
        nonlocal free
        jid = s.job.job_id
        handle = handles.pop(jid)
        handle.stop(BASE.timeout_s)
        t = now()
        s.done = float(_checkpointed_step(os.path.join(folder, f"job{jid}")))
        s.settle(t)
        gantt.append(
            {
                "job_id": jid,
                "start_s": s.seg_start,
                "end_s": t,
                "gpus": s.alloc,
                "nodes": ((0, s.alloc),),
                "spread": False,
                "ready_s": s.seg_start,
                "priority": s.job.priority,
                "busy": handle.busy,  # a segment that ran to the job's end on a busy machine
            }
        )
        free += s.alloc
        s.alloc = 0

    try:
        while pending or active:
            if cancel is not None and cancel.is_set():
                from ...launch import LaunchCancelled

                raise LaunchCancelled("the replay was stopped")
            t = now()
            if t > timeout_s:
                raise TimeoutError(f"the replay under {pol.name} ran past {timeout_s:g} s")
            event, rounds = False, False
            while pending and pending[0].arrival_s <= t:
                j = pending.pop(0)
                active[j.job_id] = _State(jobs[j.job_id])
                active[j.job_id].last_t = t
                event = changed = True
            for jid, h in list(handles.items()):
                if h.error is not None:
                    raise h.error
                if not h.thread.is_alive():  # finished all its steps
                    s = active.pop(jid)
                    s.done = float(steps[jid])
                    stop(s)
                    s.job.finish_s = now()
                    s.job.gpu_seconds = s.gpu_s
                    event = changed = True
                    if log:
                        log(f"  {pol.name}: job {jid} done at {s.job.finish_s:.1f} s")
                else:
                    active[jid].done = float(h.step)
            for s in active.values():
                s.settle(t)
            if pol.thresholds:  # a queue demotion is an event
                for jid, s in active.items():
                    lv = pol.level(s.gpu_s)
                    if levels.get(jid, 0) != lv:
                        levels[jid], event = lv, True
            if pol.round_s and t >= next_round:
                next_round = (math.floor(t / pol.round_s) + 1) * pol.round_s
                rounds = event = True
            if event:
                _decide(pol, active, rounds, changed, free, start, stop, t)
                if rounds:
                    changed = False
            time.sleep(tick_s)
    finally:
        for h in list(handles.values()):  # every rank stopped, every thread joined
            try:
                h.stop(BASE.timeout_s)
            except RuntimeError:
                pass
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    return list(jobs.values()), gantt


def _decide(
    pol, active: dict, rounds: bool, changed: bool, free: int, start, stop, now: float
) -> None:
    """The simulator's decision at this event, on real progress."""
    states = list(active.values())
    if pol.round_s and rounds:
        if pol.elastic and not changed:
            return
        if not pol.elastic and all(s.alloc for s in states):
            return
        target = (
            elastic_targets(states, pol, now, CORES, CORES)
            if pol.elastic
            else greedy_targets(sorted(states, key=lambda s: pol.key(s, now)), CORES)
        )
    elif pol.preemptive:
        target = greedy_targets(sorted(states, key=lambda s: pol.key(s, now)), CORES)
    else:  # keep what runs; newcomers in key order
        target = {s.job.job_id: s.alloc for s in states if s.alloc}
        left = free
        for s in sorted((s for s in states if not s.alloc), key=lambda s: pol.key(s, now)):
            want = 1 if pol.elastic else s.job.gpus
            if want <= left:
                target[s.job.job_id] = want
                left -= want
    for s in states:
        if s.alloc and s.alloc != target.get(s.job.job_id, 0):
            stop(s)
    for s in sorted(states, key=lambda s: s.job.job_id):
        k = target.get(s.job.job_id, 0)
        if k and not s.alloc:
            start(s, k)


@dataclass
class ReplayReport:
    calibration: Calibration
    trace: list
    table: pd.DataFrame  # per policy: simulated vs real mean JCT
    jobs: pd.DataFrame  # per policy and job: simulated vs real JCT
    real: dict = field(default_factory=dict)  # policy -> (jobs, gantt)
    simulated: dict = field(default_factory=dict)

    @property
    def mean_abs_error(self) -> float:
        return float(self.table["error"].abs().mean())

    @property
    def busy(self) -> bool:
        """Another program took the ranks' cores while calibrating or while replaying (a run
        that finished with its median step's CPU share below labkit's busy mark): measured
        times then move with that load, not with the policy."""
        return self.calibration.busy or any(
            seg.get("busy") for _, gantt in self.real.values() for seg in gantt
        )

    @property
    def same_ranking(self) -> bool:
        return list(self.table.sort_values("sim_mean_jct_s")["policy"]) == list(
            self.table.sort_values("real_mean_jct_s")["policy"]
        )

    def summary(self) -> str:
        c = self.calibration
        rank_sim = " < ".join(self.table.sort_values("sim_mean_jct_s")["policy"])
        rank_real = " < ".join(self.table.sort_values("real_mean_jct_s")["policy"])
        return (
            f"measured: {c.steps_per_s[1]:.1f} steps/s on 1 worker, {c.steps_per_s[2]:.1f} on 2 "
            f"({c.steps_per_s[2] / c.steps_per_s[1]:.2f}x); start-up {c.startup_s[1]:.2f} s "
            f"(1 worker) / {c.startup_s[2]:.2f} s (2), resume adds {c.resume_extra_s:.2f} s"
            f"{' (machine busy while measuring)' if c.busy else ''}"
            f"{' (machine busy while replaying)' if self.busy and not c.busy else ''}\n"
            f"mean JCT error (simulated / real - 1), mean of |error| over policies: "
            f"{self.mean_abs_error:.1%}\n"
            f"ranking by mean JCT: simulated {rank_sim}; real {rank_real} "
            f"({'same order' if self.same_ranking else 'different order'})"
        )

    def as_dict(self) -> dict:
        return {
            "calibration": self.calibration.as_dict(),
            "trace": [j.__dict__ for j in self.trace],
            "table": self.table.to_dict("records"),
            "jobs": self.jobs.to_dict("records"),
            "mean_abs_error": self.mean_abs_error,
            "same_ranking": self.same_ranking,
        }


def check(
    n: int | Sequence[ReplayJob],
    policies: Sequence[str],
    *,
    seed: int = 0,
    calibration: Calibration | None = None,
    log: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    recalibrate: bool = False,
    pace_s: float = 0.0,
    **trace_options,
) -> ReplayReport:
    """Calibrate (unless given), replay ``n`` jobs (or your trace) under each policy for real,
    simulate the same, and compare. ``recalibrate``: measure again before every policy (on a
    machine whose other load changes, one calibration goes stale within minutes). ``pace_s``:
    each step lasts at least that long, in the calibration and the replay (``execute``)."""
    for p in policies:
        make_policy(p)  # a bad name fails before anything runs
    trace = list(n) if not isinstance(n, int) else small_trace(n, seed, **trace_options)
    if calibration is None:
        if log:
            log("calibrating: 1 and 2 workers, start-up and resume ...")
        calibration = calibrate(pace_s=pace_s)
    rows, per_job, real, simulated = [], [], {}, {}
    for i, p in enumerate(policies):
        if recalibrate and i:
            if log:
                log("calibrating again ...")
            calibration = calibrate(pace_s=pace_s)
        if log:
            log(f"replaying {len(trace)} jobs under {p} ...")
        jobs, gantt = execute(trace, p, calibration, log=log, cancel=cancel, pace_s=pace_s)
        real[p] = (jobs, gantt)
        sim_jobs = [
            calibration.job(j.job_id, j.arrival_s, j.workers, j.steps, j.priority) for j in trace
        ]
        res = simulate(sim_jobs, Cluster(1, CORES), p, round_s=ROUND_S, thresholds=LAS_THRESHOLDS)
        simulated[p] = res
        m_real, m_sim = metrics(jobs, CORES, p), res.metrics()
        rows.append(
            {
                "policy": p,
                "sim_mean_jct_s": m_sim["mean_jct_s"],
                "real_mean_jct_s": m_real["mean_jct_s"],
                "error": m_sim["mean_jct_s"] / m_real["mean_jct_s"] - 1,
                "sim_makespan_s": m_sim["makespan_s"],
                "real_makespan_s": m_real["makespan_s"],
                "sim_restarts": sum(j.restarts for j in res.jobs),
                "real_restarts": sum(j.restarts for j in jobs),
            }
        )
        sim_by_id = {j.job_id: j for j in res.jobs}
        for j in jobs:
            per_job.append(
                {
                    "policy": p,
                    "job_id": j.job_id,
                    "workers": j.gpus,
                    "steps": int(j.work),
                    "priority": j.priority,
                    "real_jct_s": j.jct_s,
                    "sim_jct_s": sim_by_id[j.job_id].jct_s,
                    "real_restarts": j.restarts,
                    "sim_restarts": sim_by_id[j.job_id].restarts,
                }
            )
    return ReplayReport(
        calibration, trace, pd.DataFrame(rows), pd.DataFrame(per_job), real, simulated
    )
