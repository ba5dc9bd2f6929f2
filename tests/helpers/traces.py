"""A Chrome trace's complete events read back per thread, and the strategies traced for it."""

from __future__ import annotations

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
    "cp": {"model": "transformer"},  # context parallel: a sequence to split
    "ep": {"model": "transformer", "experts": 4},  # expert parallel: experts to spread
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
