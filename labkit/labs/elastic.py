"""Elastic training on torchrun, driven from a notebook: start agents, kill a worker, add or
remove a node, and read what happened.

Each "node" is one ``torchrun`` agent (``python -m torch.distributed.run``) started as a
subprocess on this machine; the agents meet through torchrun's own c10d rendezvous on a
loopback port, exactly as agents on separate machines would (there the endpoint is a real host).
torchrun does the elastic work: ``--nnodes MIN:MAX`` lets the group form at any size in range,
a waiting agent makes the running ones restart their workers at the larger size (membership
changes do not count against ``--max-restarts``), a failed worker makes its agent restart the
group. labkit's part is in the workers: ``--checkpoint-dir`` makes every attempt continue from
the last checkpoint at whatever world size it got, with the same global batch re-sharded.

Every process this module starts is tracked (agents and the workers they spawn, which torchrun
puts in their own sessions) and stopped and reaped by ``close()``, which runs on leaving the
``with`` block, on an interrupt inside ``wait()``, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from dataclasses import dataclass, field

import pandas as pd
import psutil

from .. import registry
from ..config import RunConfig
from ..flags import to_argv
from ..launch import free_port
from ..rank.resume import read_timeline

# torchrun's rendezvous knobs (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py),
# in whole seconds: how long an agent waits for the group to reach MIN nodes (join), how long it
# waits for more once MIN is there (last_call, 30 s by default: the main cost of a join),
# and how soon a silent agent counts as gone (keep_alive_interval x keep_alive_max_attempt).
# They are read as whole seconds (``get_as_int``), so 1 s is the floor. torchrun's own
# --monitor-interval (how often an agent looks at its workers and for waiting nodes) already
# defaults to 0.1 s, and is left alone.
FAST_RDZV = {
    "join_timeout": 20,
    "last_call_timeout": 1,
    "close_timeout": 5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}
# torchrun shares the rendezvous TCP store with the workers by default; an agent that was rank
# 0 in the first round does not publish MASTER_ADDR for the next round, so a node joining a
# running job waits for it until the store times out, and both agents fail (benchmarks/
# README.md, "Behind the code"). A separate store per round re-forms correctly.
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def worker_args(cfg: RunConfig) -> list[str]:
    """``labkit.worker`` flags that rebuild ``cfg`` on every worker (torchrun sets the world
    size; the job passes its own checkpoint folder)."""
    skip = ("strategy", "world_size", "checkpoint_dir")
    return ["--strategy", cfg.strategy, *to_argv(cfg, skip=skip)]


def check_nnodes(nnodes: str | int, agents: int | None = None) -> tuple[int, int]:
    """``--nnodes`` as (min, max), or a ValueError saying why it can never be met."""
    text = str(nnodes)
    try:
        lo, _, hi = text.partition(":")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"nnodes {text!r} is not N or MIN:MAX (e.g. 2 or 1:2)") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"nnodes {text!r} can never be met: need 1 <= MIN <= MAX (e.g. 1:2)")
    if agents is not None and agents < lo:
        raise ValueError(
            f"nnodes {text!r} needs at least {lo} agents before training starts, "
            f"but {agents} will be started: start {lo} or lower MIN"
        )
    return lo, hi


@dataclass
class Agent:
    """One torchrun agent (a "node") and its log."""

    index: int
    proc: subprocess.Popen
    log: str
    started: float = field(default_factory=time.time)
    left: bool = False  # removed on purpose (its exit status is not a failure)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def workers(self) -> list[psutil.Process]:
        """The worker processes this agent runs now."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return [p for p in kids if _is_worker(p)]

    def output(self) -> str:
        try:
            with open(self.log) as f:
                return f.read()
        except OSError:
            return ""


class ElasticError(RuntimeError):
    """An elastic job that could not run, with the reason in words."""


def _is_worker(p: psutil.Process) -> bool:
    try:
        return "labkit.worker" in " ".join(p.cmdline())
    except psutil.Error:
        return False


class ElasticJob:
    """One training job on torchrun agents started here (each agent is a node).

        with ElasticJob(cfg, nnodes="1:2") as job:
            job.add_agent()              # the first node; training starts
            ...; job.add_agent()         # a second node joins: the group re-forms at 2
            ...; job.remove_agent(1)     # it leaves: the group re-forms at 1
            job.wait()
            job.timeline()               # one row per step: world size, loss, attempt, time

    ``folder`` holds the checkpoint (``ckpt/``, unless ``cfg.checkpoint_dir`` names one), the
    timeline, the agents' logs and the records (``records.json``); a checkpoint is written every
    ``checkpoint_every`` steps. ``cfg.world_size`` is ignored: torchrun sets it.
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        nnodes: str | int = "1:2",
        nproc_per_node: int = 1,
        max_restarts: int = 3,
        folder: str | None = None,
        port: int | None = None,
        rdzv: dict | None = None,
        endpoint: str | None = None,
        checkpoint_every: int = 5,
    ):
        self.min_nodes, self.max_nodes = self.check(cfg, nnodes, nproc_per_node)
        self.folder = folder or tempfile.mkdtemp(prefix="labkit-elastic-")
        os.makedirs(self.folder, exist_ok=True)
        self.cfg = cfg.replace(
            checkpoint_dir=cfg.checkpoint_dir or os.path.join(self.folder, "ckpt"),
            checkpoint_every=checkpoint_every,
        )
        self.nnodes, self.nproc, self.max_restarts = (
            f"{self.min_nodes}:{self.max_nodes}",
            nproc_per_node,
            max_restarts,
        )
        self.endpoint = endpoint or f"127.0.0.1:{port or free_port()}"
        self.rdzv = {**FAST_RDZV, **(rdzv or {})}
        self.run_id = uuid.uuid4().hex[:8]
        self.agents: list[Agent] = []
        self.events: list[dict] = []  # what was done to the job, and when (time.time())
        self.records_path = os.path.join(self.folder, "records.json")
        _LIVE.add(self)

    @staticmethod
    def check(cfg: RunConfig, nnodes: str | int, nproc_per_node: int = 1) -> tuple[int, int]:
        """(min, max) nodes, or a ValueError naming the fix, before any process starts."""
        lo, hi = check_nnodes(nnodes)
        if not registry.get(cfg.strategy).replicated:
            names = " or ".join(n for n, s in registry.STRATEGIES.items() if s.replicated)
            raise ValueError(
                f"an elastic job runs {names} (its world size changes: every rank holds the "
                f"whole model, so a checkpoint resumes at any size), got {cfg.strategy!r}"
            )
        if nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
        for ws in range(lo * nproc_per_node, hi * nproc_per_node + 1):
            if cfg.global_batch % (ws * cfg.accumulate):
                raise ValueError(
                    f"global batch {cfg.global_batch} does not split over world "
                    f"size {ws} (reachable with nnodes {nnodes}): pick a multiple "
                    f"of every world size in range"
                )
        return lo, hi

    # ---- membership --------------------------------------------------------------------------

    def command(self) -> list[str]:
        conf = ",".join(f"{k}={v}" for k, v in self.rdzv.items())
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            self.nnodes,
            "--nproc-per-node",
            str(self.nproc),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            self.endpoint,
            "--rdzv-id",
            self.run_id,
            "--rdzv-conf",
            conf,
            "--max-restarts",
            str(self.max_restarts),
            "-m",
            "labkit.worker",
            *worker_args(self.cfg),
            "--checkpoint-dir",
            self.cfg.checkpoint_dir,
            "--out",
            self.records_path,
        ]

    def add_agent(self) -> Agent:
        """Start one more agent (a node joining)."""
        if len([a for a in self.agents if a.alive]) >= self.max_nodes:
            raise ValueError(
                f"the job already has {self.max_nodes} live agents, its most (nnodes {self.nnodes})"
            )
        index = len(self.agents)
        log = os.path.join(self.folder, f"agent{index}.log")
        env = {
            **os.environ,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONUNBUFFERED": "1",
            **AGENT_ENV,
        }
        with open(log, "w") as f:  # own session: a notebook interrupt does not reach it
            proc = subprocess.Popen(
                self.command(), stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        agent = Agent(index, proc, log)
        self.agents.append(agent)
        self.events.append({"time": agent.started, "event": "join", "agent": index})
        return agent

    def remove_agent(self, index: int | None = None) -> Agent:
        """Stop an agent the way a node leaves (SIGTERM: torchrun stops its workers, rank 0
        writes a checkpoint at the end of its step); the others re-form without it."""
        agent = self._pick(index)
        self.events.append({"time": time.time(), "event": "leave", "agent": agent.index})
        agent.left = True
        agent.proc.send_signal(signal.SIGTERM)
        return agent

    def kill_worker(self, index: int | None = None, timeout_s: float = 30.0) -> int:
        """SIGKILL one worker process of an agent (a crashed rank); its agent restarts the
        group (one of ``max_restarts``). Returns the pid killed."""
        agent = self._pick(index)
        deadline = time.time() + timeout_s
        while not (workers := agent.workers()):
            if time.time() > deadline or not agent.alive:
                raise RuntimeError(f"agent {agent.index} has no worker to kill")
            time.sleep(0.05)
        victim = workers[-1]
        self.events.append(
            {"time": time.time(), "event": "kill", "agent": agent.index, "pid": victim.pid}
        )
        victim.kill()
        return victim.pid

    def _pick(self, index: int | None) -> Agent:
        live = [a for a in self.agents if a.alive]
        if not live:
            raise RuntimeError("no agent is running")
        if index is None:
            return live[-1]
        agent = next((a for a in live if a.index == index), None)
        if agent is None:
            raise ValueError(
                f"agent {index} is not running (running: {', '.join(str(a.index) for a in live)})"
            )
        return agent

    # ---- reading -----------------------------------------------------------------------------

    def timeline(self) -> pd.DataFrame:
        """One row per training step (and per start/checkpoint/stop event) so far."""
        return pd.DataFrame(read_timeline(self.cfg.checkpoint_dir))

    def steps(self) -> pd.DataFrame:
        """The step rows: step, world_size, loss, attempt, samples/s, and seconds since the
        job's first agent started."""
        tl = self.timeline()
        if tl.empty or "step" not in tl or not (tl["event"] == "step").any():
            return pd.DataFrame(
                columns=["step", "world_size", "loss", "attempt", "time_s", "samples_per_s"]
            )
        rows = tl[tl["event"] == "step"].copy()
        rows["time_s"] = rows["time"] - self.t0
        rows["samples_per_s"] = rows["samples"] / rows["step_s"]
        return rows[
            ["step", "world_size", "loss", "attempt", "time_s", "step_s", "samples_per_s"]
        ].reset_index(drop=True)

    @property
    def t0(self) -> float:
        return self.agents[0].started if self.agents else time.time()

    def done(self) -> bool:
        return bool(self.agents) and all(not a.alive for a in self.agents)

    def returncodes(self) -> list[int | None]:
        return [a.proc.poll() for a in self.agents]

    def wait(self, timeout_s: float = 120.0) -> list[int]:
        """Wait for every agent to exit; on timeout or interrupt stop them all, then raise."""
        deadline = time.time() + timeout_s
        try:
            for a in self.agents:
                a.proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self.close()
            raise TimeoutError(
                f"the elastic job did not finish in {timeout_s:.0f} s: every "
                f"agent was stopped; logs in {self.folder}"
            ) from None
        except BaseException:
            self.close()
            raise
        failed = [a for a in self.agents if a.proc.returncode and not a.left]
        if failed:
            raise ElasticError(self.diagnose(failed[0]))
        return [a.proc.returncode for a in self.agents]

    def diagnose(self, agent: Agent) -> str:
        """Why an agent failed, in words, from its log."""
        log = agent.output()
        where = f"(agent {agent.index} exited with {agent.proc.returncode}; log {agent.log})"
        if "RendezvousConnectionError" in log:
            return (
                f"nobody serves the rendezvous endpoint {self.endpoint}: the agent could not "
                f"reach it within read_timeout={self.rdzv.get('read_timeout', 60)} s. Start "
                f"the first agent on that host (the c10d store runs in it) or fix "
                f"--rdzv-endpoint {where}"
            )
        if "RendezvousTimeoutError" in log:
            return (
                f"the group never reached its minimum of {self.min_nodes} node(s) (nnodes "
                f"{self.nnodes}) within join_timeout={self.rdzv['join_timeout']} s: start "
                f"{self.min_nodes} agents, or lower MIN in nnodes MIN:MAX {where}"
            )
        if "labkit.worker: error:" in log:
            line = next(ln for ln in log.splitlines() if "labkit.worker: error:" in ln)
            return f"{line.split('error:', 1)[1].strip()} {where}"
        tail = "\n".join(log.strip().splitlines()[-15:])
        return f"the job failed {where}:\n{tail}"

    def wait_for(self, predicate, timeout_s: float = 60.0, poll_s: float = 0.05) -> pd.DataFrame:
        """Poll the step rows until ``predicate(rows)`` holds; they are returned."""
        deadline = time.time() + timeout_s
        try:
            while True:
                rows = self.steps()
                if predicate(rows):
                    return rows
                if time.time() > deadline or self.done():
                    raise TimeoutError(
                        f"the condition was not met within {timeout_s:.0f} s "
                        f"(agents exited: {self.returncodes()}); logs in "
                        f"{self.folder}:\n{self.agents[-1].output()[-2000:]}"
                    )
                time.sleep(poll_s)
        except BaseException:
            if not isinstance(sys.exc_info()[1], TimeoutError):
                self.close()
            raise

    # ---- cleanup -----------------------------------------------------------------------------

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every agent and worker this job started and reap them (safe to call twice)."""
        procs = []
        for a in self.agents:
            try:
                root = psutil.Process(a.proc.pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        procs += [p for p in self._orphans() if p not in procs]
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        alive = _wait_gone(procs, grace_s)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        _wait_gone(alive, grace_s)
        for a in self.agents:
            try:
                a.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        _LIVE.discard(self)

    def _orphans(self) -> list[psutil.Process]:
        """Workers of this job whose agent is gone (torchrun tells each its run id)."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if _is_worker(p) and p.environ().get("TORCHELASTIC_RUN_ID") == self.run_id:
                    found.append(p)
            except psutil.Error:
                continue
        return found

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process has exited, at most ``timeout_s``; those still running. A
    zombie counts as gone: a worker whose agent died is re-parented to an init that may never
    reap it, and ``psutil.wait_procs`` would wait out its whole timeout on it."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p in psutil.wait_procs(procs, timeout=0)[0]:  # reap our own children
            procs = [q for q in procs if q is not p]
        procs = [p for p in procs if _running(p)]
        if not procs or time.monotonic() >= deadline:
            return procs
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


_LIVE: weakref.WeakSet[ElasticJob] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:  # a kernel shutting down takes its jobs with it
    for job in list(_LIVE):
        job.close(grace_s=2.0)


# ---- what happened --------------------------------------------------------------------------


def changes(job_events: list[dict], steps: pd.DataFrame, t0: float) -> pd.DataFrame:
    """Per join, leave or kill: when it happened, the world sizes before and after, the last
    step of the old group and the first of the re-formed one, the steps lost (trained by the old
    group after its last checkpoint, trained again), ``reform_s`` (seconds from the change to
    the first step of the re-formed group) and ``pause_s`` (seconds without a step: the old
    group kept training while a joining node started)."""
    rows = []
    for ev in job_events:
        t = ev["time"] - t0
        before = steps[steps["time_s"] <= t]
        if before.empty:  # the first node: nothing to re-form
            continue
        old = before.iloc[-1]
        later = steps[steps["time_s"] > t]
        new = later[
            (later["attempt"] != old["attempt"]) | (later["world_size"] != old["world_size"])
        ]
        if new.empty:
            continue
        first = new.iloc[0]
        last = steps[steps["time_s"] < first["time_s"]].iloc[-1]
        rows.append(
            {
                "event": ev["event"],
                "at_s": round(t, 2),
                "world_before": int(last["world_size"]),
                "world_after": int(first["world_size"]),
                "last_step_before": int(last["step"]),
                "first_step_after": int(first["step"]),
                "steps_lost": max(0, int(last["step"] - (first["step"] - 1))),
                "reform_s": round(float(first["time_s"] - t), 2),
                "pause_s": round(float(first["time_s"] - last["time_s"]), 2),
            }
        )
    return pd.DataFrame(rows)
