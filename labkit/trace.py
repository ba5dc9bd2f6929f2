"""A run in the field's own tools: records as a Chrome trace (Trace Event Format) that Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open.

One process per rank ("rank N", with its node under torchrun, and the run's label when a file
holds several runs), two threads in each: **compute**, where the step's phases follow each other
as complete events (``ph: "X"``) in the order the training loop runs them, and **communication
in flight**, one event per collective from issue to completion, counted and timed where it
travels (``labkit.wire``; collectives in flight at once go to further "communication in flight"
threads, so that every thread's events nest). On the compute thread, exposed communication is
the part of the step that waited for a collective; what the other thread shows beyond it was
hidden behind compute. Pipelines show each stage's step where it ran instead: the data, the
barrier every stage meets, then each micro-batch's receive, forward and backward (stage and
micro-batch in their arguments), the wait for the step's sends, the replicas' gradient
average, the optimizer, and as "other" the schedule's bookkeeping between those intervals
(under ``pipeline_impl="torch"`` the library's sends and receives too). A parameter server's
step is one update: the wait for a push, applying it, the reply. Each step starts with an
instant event; checkpoint saves and a job's re-forms (a new attempt under torchrun) are marked
too. Every time is on the one clock the records share (``perf_counter``, from the run's first
step), in microseconds.

Each event's ``args`` name its step and the record's phase it belongs to (``phase``: one of
``labkit.rank.probes.PHASES``). Outside pipelines, phases are a step's totals: with gradient
accumulation, each phase's micro-batches are summed into one block (the record keeps no finer
split). A step's events tile it: they add up to its measured ``step_s``, each phase to its
column, here as in the tables.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import pandas as pd

from .rank.probes import PHASES
from .records import BUSY_SHARE, cpu_share, labels

COMPUTE, COMM = 0, 1  # thread ids in each rank's process (COMM + k: the k-th overlapping lane)
# a parameter server's update in the order it runs (labkit.strategies.async_ps.serve)
SERVER_PHASES = ("wait", "optimizer", "comm")


def to_chrome_trace(
    records: pd.DataFrame, path: str | None = None, *, meta: dict | None = None
) -> dict:
    """The trace of ``records`` (one run or several, as ``labkit.experiment.compare`` returns
    them) as a dict in the Trace Event Format's JSON object form; written to ``path`` if given.
    ``meta``: anything to keep beside the events (the config, the command line)."""
    if records.empty:
        raise ValueError("no records: run something first")
    events: list[dict] = []
    runs = _runs(records)
    for run_index, (label, run) in enumerate(runs):
        # pipelines: each step's earliest start_s in its pipeline (the barrier's exit), where
        # labkit.records.finalize put the origin of that step's F/B events
        keys = ["step", "replica"] if "replica" in run else ["step"]
        origins = run.groupby(keys)["start_s"].min().to_dict()
        for rank, g in run.groupby("rank"):
            pid = run_index * 1000 + int(rank)
            name = f"rank {int(rank)}" + (f" ({label})" if len(runs) > 1 else "")
            if "node" in g:
                name += f", node {g['node'].iloc[0]}"
            events += _names(pid, name, run_index * 1000 + int(rank))
            events += _rank_events(pid, g.sort_values("step"), origins, keys)
    # the records' clock starts at the first step's start_s; a pipeline stage's data and wait
    # come before its start_s, so the clock's zero moves back to where they began
    lead = min([0.0] + [e["ts"] for e in events if "ts" in e])
    for e in events:
        if "ts" in e:
            e["ts"] = round(e["ts"] - lead, 3)
    other = {
        "runs": [label for label, _ in runs],
        "world_sizes": sorted({int(w) for w in records["world_size"]}),
        "busy": _busy(records),
        "oversubscribed": bool(records.get("oversubscribed", pd.Series([False])).any()),
        "clock": "perf_counter seconds from the first step, shown in microseconds",
        **(meta or {}),
    }
    trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
    if path is not None:
        with open(path, "w") as f:
            json.dump(trace, f, default=_plain)
    return trace


def _runs(records: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    keys = [k for k in ("run_id", "strategy", "world_size", "threads", "variant") if k in records]
    out = []
    for _, g in records.groupby(keys, sort=False, dropna=False):
        first = g.iloc[[0]].assign(threads=g["threads"].iloc[0] if "threads" in g else 1)
        out.append((labels(first)[0], g))
    return out


def _names(pid: int, process: str, order: int) -> list[dict]:
    def meta(kind: str, tid: int, args: dict) -> dict:
        return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}

    return [
        meta("process_name", COMPUTE, {"name": process}),
        meta("process_sort_index", COMPUTE, {"sort_index": order}),
        meta("thread_name", COMPUTE, {"name": "compute"}),
        meta("thread_name", COMM, {"name": "communication in flight"}),
    ]


def _us(seconds: float) -> float:
    return round(1e6 * float(seconds), 3)


def _rank_events(pid: int, g: pd.DataFrame, origins: dict, keys: list[str]) -> list[dict]:
    events, attempt, spans = [], None, []
    for rec in g.to_dict("records"):
        staged = isinstance(rec.get("events"), list) and bool(rec["events"])  # a pipeline stage
        start = _step_start(rec) if staged else rec["start_s"]
        step = int(rec["step"])
        events.append(_instant(pid, f"step {step}", start, {"step": step}))
        if "attempt" in rec and rec["attempt"] == rec["attempt"] and rec["attempt"] != attempt:
            if attempt is not None:  # torchrun started the group again
                events.append(
                    _instant(
                        pid,
                        f"re-formed: attempt {int(rec['attempt'])}",
                        start,
                        {"world_size": int(rec["world_size"])},
                    )  # fmt: skip
                )
            attempt = rec["attempt"]
        if staged:
            origin = origins[tuple(rec[k] for k in keys) if len(keys) > 1 else rec["step"]]
            events += _pipeline(pid, rec, origin)
        else:
            t = start
            for phase in SERVER_PHASES if rec.get("role") == "server" else PHASES:
                dur = float(rec.get(f"{phase}_s", 0.0) or 0.0)
                if dur > 0:
                    args = {"step": step, "phase": phase}
                    events.append(_complete(pid, COMPUTE, _phase_name(phase), t, t + dur, args))
                    t += dur
        for op, a, b, nbytes in rec.get("comm_spans") or []:
            spans.append((a, b, op, {"step": step, "bytes": nbytes}))
        saved = rec.get("checkpoint_start_s")
        if saved is not None and not (isinstance(saved, float) and math.isnan(saved)):
            end = saved + rec["checkpoint_s"]
            events.append(_complete(pid, COMPUTE, "checkpoint save", saved, end, {"step": step}))
    return events + _lanes(pid, spans)


def _lanes(pid: int, spans: list[tuple]) -> list[dict]:
    """Each collective in flight, on the first communication thread free at its start: events on
    one thread of a trace must nest, and two collectives in flight at once need not."""
    ends: list[float] = []  # per lane, where its last span ended
    events = []
    for a, b, op, args in sorted(spans, key=lambda s: (s[0], s[1])):
        b = max(a, b)
        lane = next((k for k, end in enumerate(ends) if _us(end) <= _us(a)), len(ends))
        if lane == len(ends):
            ends.append(b)
        else:
            ends[lane] = b
        events.append(_complete(pid, COMM + lane, op, a, b, args))
    return events + [
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": COMM + k,
         "args": {"name": f"communication in flight ({k + 1})"}}
        for k in range(1, len(ends))
    ]  # fmt: skip


def _step_start(rec: dict) -> float:
    """Where a pipeline stage's step began: its ``start_s`` is the barrier's exit, after the
    step's data and wait (``labkit.rank.stages.train_stages``)."""
    return rec["start_s"] - sum(float(rec.get(c, 0.0) or 0.0) for c in ("data_s", "wait_s"))


def _pipeline(pid: int, rec: dict, origin: float) -> list[dict]:
    """A stage's step as it ran: data and the barrier first, the schedule's intervals where
    they were measured (F/B events from ``origin``, the step's earliest barrier exit in its
    pipeline; the blocked communication from this record's ``start_s``), the optimizer at the
    end, and "other" in every gap between them, so the step's events tile ``step_s``."""
    begin, step = _step_start(rec), int(rec["step"])
    start, end = rec["start_s"], begin + rec["step_s"]
    spans = []  # (start, end, name, phase, args)
    t = begin
    for phase in ("data", "wait"):
        dur = float(rec.get(f"{phase}_s", 0.0) or 0.0)
        spans.append((t, t + dur, _phase_name(phase), phase, {}))
        t += dur
    for e in rec["events"]:
        phase = "forward" if e["kind"] == "F" else "backward"  # B, or a split one's I and W
        args = {"stage": int(e["stage"]), "microbatch": int(e["microbatch"])}
        what = phase if e["kind"] in "FB" else f"backward {e['kind']}"
        spans.append((origin + e["start"], origin + e["end"], f"{what} mb {e['microbatch']}",
                      phase, args))  # fmt: skip
    for c in rec.get("comm_events") or []:
        args = {} if c.get("microbatch") is None else {"microbatch": int(c["microbatch"])}
        spans.append((start + c["start"], start + c["end"], _comm_name(c), "comm", args))
    opt = float(rec.get("optimizer_s", 0.0) or 0.0)
    spans.append((end - opt, end, "optimizer", "optimizer", {}))
    out, t = [], begin
    for a, b, name, phase, args in sorted(spans, key=lambda s: (s[0], s[1])):
        if _us(a) > _us(t):  # between the timed intervals: the schedule's own work
            out.append(_complete(pid, COMPUTE, "other", t, a, {"step": step, "phase": "other"}))
        elif t - a < 1e-9:  # the same instant read twice: rounding, not an overlap
            a = t
        if _us(b) > _us(a):
            out.append(_complete(pid, COMPUTE, name, a, b, {"step": step, "phase": phase, **args}))
        t = max(t, b)
    if _us(end) > _us(t):
        out.append(_complete(pid, COMPUTE, "other", t, end, {"step": step, "phase": "other"}))
    return out


def _comm_name(c: dict) -> str:
    """A pipeline stage's blocked interval (``labkit.rank.stages.label_comm``), by what it
    waited for."""
    if c["kind"] == "recv":
        what = "activations" if c.get("for") == "F" else "gradient"
        return f"recv {what} mb {c['microbatch']}"
    return {"send": "wait for sends", "sync": "all-reduce over replicas"}.get(c["kind"], "comm")


def _phase_name(phase: str) -> str:
    return {"comm": "comm (exposed)", "wait": "wait for the others"}.get(phase, phase)


def _complete(pid: int, tid: int, name: str, start: float, end: float, args: dict) -> dict:
    """A complete event from ``start`` to ``end`` (seconds). Both ends are rounded, not the
    duration, so that an event starting where another ends meets it to the nanosecond."""
    ts = _us(start)
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": ts,
            "dur": round(max(0.0, _us(end) - ts), 3), "args": args}  # fmt: skip


def _instant(pid: int, name: str, at: float, args: dict) -> dict:
    return {"name": name, "ph": "i", "s": "p", "pid": pid, "tid": COMPUTE, "ts": _us(at),
            "args": args}  # fmt: skip


def _busy(records: pd.DataFrame) -> dict:
    return {label: bool(cpu_share(run) < BUSY_SHARE) for label, run in _runs(records)}


def _plain(x):
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, Iterable):
        return list(x)
    return str(x)
