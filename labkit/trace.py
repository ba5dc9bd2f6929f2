"""A run in the field's own tools: records as a Chrome trace (Trace Event Format) that Perfetto
(ui.perfetto.dev) and ``chrome://tracing`` open.

One process per rank ("rank N", with its node under torchrun, and the run's label when a file
holds several runs), two threads in each: **compute**, where the step's phases follow each other
as complete events (``ph: "X"``) in the order the training loop runs them, and **communication
in flight**, one event per collective from issue to completion, counted and timed where it
travels (``labkit.wire``). On the compute thread, exposed communication is the part of the step
that waited for a collective; what the other thread shows beyond it was hidden behind compute.
Pipelines show each stage's forward and backward of every micro-batch instead, with the stage
and micro-batch in their arguments. Each step starts with an instant event; checkpoint saves
and a job's re-forms (a new attempt under torchrun) are marked too. Every time is on the one
clock the records share (``perf_counter``, from the run's first step), in microseconds.

Phases are a step's totals: with gradient accumulation, each phase's micro-batches are summed
into one block (the record keeps no finer split). The phases of a step add up to its measured
``step_s`` here as in the tables.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import pandas as pd

from .rank.probes import PHASES
from .records import BUSY_SHARE, cpu_share, labels

COMPUTE, COMM = 0, 1  # thread ids in each rank's process


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
        origins = run.groupby("step")["start_s"].min().to_dict()  # pipelines: each step's start
        for rank, g in run.groupby("rank"):
            pid = run_index * 1000 + int(rank)
            name = f"rank {int(rank)}" + (f" ({label})" if len(runs) > 1 else "")
            if "node" in g:
                name += f", node {g['node'].iloc[0]}"
            events += _names(pid, name, run_index * 1000 + int(rank))
            events += _rank_events(pid, g.sort_values("step"), origins)
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


def _rank_events(pid: int, g: pd.DataFrame, origins: dict) -> list[dict]:
    events, attempt = [], None
    for rec in g.to_dict("records"):
        start = rec["start_s"]
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
        if isinstance(rec.get("events"), list) and rec["events"]:  # a pipeline stage
            events += _pipeline(pid, rec, origins[rec["step"]])
        else:
            t = start
            for phase in PHASES:
                dur = float(rec.get(f"{phase}_s", 0.0) or 0.0)
                if dur > 0:
                    events.append(
                        _complete(pid, COMPUTE, _phase_name(phase), t, dur, {"step": step})
                    )
                    t += dur
        for op, a, b, nbytes in rec.get("comm_spans") or []:
            events.append(
                _complete(pid, COMM, op, a, max(0.0, b - a), {"step": step, "bytes": nbytes})
            )
        saved = rec.get("checkpoint_start_s")
        if saved is not None and not (isinstance(saved, float) and math.isnan(saved)):
            events.append(
                _complete(
                    pid, COMPUTE, "checkpoint save", saved, rec["checkpoint_s"], {"step": step}
                )  # fmt: skip
            )
    return events


def _pipeline(pid: int, rec: dict, origin: float) -> list[dict]:
    """A stage's step: data, the barrier, each micro-batch's F and B where it ran (its events
    are kept from the step's earliest start on any stage, ``origin``), the optimizer at the
    end; the receives' waits fall between the F/B blocks."""
    start, step = rec["start_s"], int(rec["step"])
    out = []
    for phase, at in (("data", start), ("wait", start + rec.get("data_s", 0.0))):
        if rec.get(f"{phase}_s", 0.0) > 0:
            out.append(_complete(pid, COMPUTE, _phase_name(phase), at, rec[f"{phase}_s"],
                                 {"step": step}))  # fmt: skip
    for e in rec["events"]:
        name = {"F": "forward", "B": "backward"}[e["kind"]] + f" mb {e['microbatch']}"
        args = {"step": step, "stage": int(e["stage"]), "microbatch": int(e["microbatch"])}
        out.append(_complete(pid, COMPUTE, name, origin + e["start"], e["end"] - e["start"], args))
    end = start + rec["step_s"]
    if rec.get("optimizer_s", 0.0) > 0:
        out.append(_complete(pid, COMPUTE, "optimizer", end - rec["optimizer_s"],
                             rec["optimizer_s"], {"step": step}))  # fmt: skip
    return out


def _phase_name(phase: str) -> str:
    return {"comm": "comm (exposed)", "wait": "wait for the others"}.get(phase, phase)


def _complete(pid: int, tid: int, name: str, start: float, dur: float, args: dict) -> dict:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start),
            "dur": _us(max(0.0, dur)), "args": args}  # fmt: skip


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
