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
from tests.helpers.traces import EVERY_KIND, crossings, timeline


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
