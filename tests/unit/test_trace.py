"""Chrome traces of runs (labkit.trace): what a trace reader needs, and the records' numbers.

Perfetto's trace processor cannot be installed offline here, so the trace is checked against
the Trace Event Format's documented fields (the JSON object form: ``traceEvents``; complete
events ``ph: "X"`` with ``ts`` and ``dur`` in microseconds; instant events ``ph: "i"`` with a
scope; metadata events ``ph: "M"`` naming processes and threads) by a reader written here from
that document, not by labkit's writer, and against the records it was made from: for one
strategy of each kind, events on every thread nest, a rank's steps follow each other, each
step's events add up to its measured ``step_s`` and each phase to its column, and the median
step, gated by the slowest rank, is the table's.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_trace.py."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import registry
from labkit.trace import to_chrome_trace

# one strategy of each kind in labkit.registry, both pipeline schedules, and both ways of
# being asynchronous (a parameter server's updates, Hogwild's shared model)
EVERY_KIND = {
    "single": {"world_size": 1},
    "ddp": {},
    "fsdp": {},
    "pipeline_gpipe": {},
    "pipeline_1f1b": {},
    "tp": {},
    "dp_tp": {"world_size": 4, "tp": 2},
    "dp_pp": {"world_size": 4},
    "local_sgd": {"period": 2},
    "async_ps": {"world_size": 3},
    "hogwild": {},
}
NS = 1000  # the trace's times are microseconds; compared here in integer nanoseconds


def timeline(trace: dict) -> dict:
    """Per (pid, tid), the complete events as (start ns, end ns, event); per pid, its rank."""
    ranks = {e["pid"]: int(e["args"]["name"].split()[1]) for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}  # fmt: skip
    threads: dict = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            span = (round(e["ts"] * NS), round((e["ts"] + e["dur"]) * NS), e)
            threads.setdefault((e["pid"], e["tid"]), []).append(span)
    return {"ranks": ranks, "threads": threads}


def crossings(spans: list) -> list:
    """Pairs of events on one thread that overlap without one holding the other."""
    return [
        (a[2]["name"], b[2]["name"])
        for i, a in enumerate(spans)
        for b in spans[i + 1 :]
        if max(a[0], b[0]) < min(a[1], b[1])  # they overlap
        and not (a[0] <= b[0] and b[1] <= a[1])
        and not (b[0] <= a[0] and a[1] <= b[1])
    ]


def test_the_traced_strategies_cover_every_kind():
    assert {registry.get(name).kind for name in EVERY_KIND} == set(registry.KINDS)


def test_collectives_in_flight_at_once_are_drawn_on_threads_of_their_own():
    # an all-gather prefetched while a reduce-scatter is in flight (FSDP's backward can do it)
    spans = [["reduce_scatter", 0.010, 0.014, 64], ["all_gather", 0.012, 0.016, 64],
             ["all_gather", 0.0145, 0.015, 64], ["all_reduce", 0.016, 0.017, 8]]  # fmt: skip
    rec = {"strategy": "fsdp", "world_size": 2, "threads": 1, "rank": 0, "step": 0,
           "start_s": 0.009, "step_s": 0.009, "forward_s": 0.003, "backward_s": 0.006,
           "comm_spans": spans}  # fmt: skip
    trace = to_chrome_trace(pd.DataFrame([rec]))
    got = timeline(trace)
    comm = {tid: ss for (_, tid), ss in got["threads"].items() if tid > 0}
    assert all(crossings(ss) == [] for ss in comm.values())
    drawn = sorted((s[0], s[1], s[2]["name"]) for ss in comm.values() for s in ss)
    assert drawn == [(round(a * 1e9), round(b * 1e9), op) for op, a, b, _ in spans]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}  # fmt: skip
    assert set(comm) <= set(names) and len(comm) == 2  # the first free thread, not one each


def test_no_records_says_so():
    with pytest.raises(ValueError, match="no records"):
        to_chrome_trace(pd.DataFrame())
