"""Charts show the values their axes claim: checked on the figures' own data."""

import pandas as pd

from labkit.plots import communication, scheduling


def test_bandwidth_ceilings_are_lines_at_their_value_and_leave_the_log_axis_alone():
    # before: the ceilings' annotations were placed in log10 units and the axis ran to 10^32
    table = pd.DataFrame(
        {"op": "all_reduce", "bytes": [1024, 2**20], "busbw": [0.05, 2.0], "algbw": [0.05, 2.0],
         "p10_s": [1e-5, 5e-4], "p90_s": [3e-5, 6e-4], "world_size": 2, "backend": "gloo"}
    )  # fmt: skip
    fig = communication.bandwidth(table, ceilings={"memcpy": 12.5, "loopback TCP": 3.0})
    assert not fig.layout.annotations and not fig.layout.shapes
    ceilings = {t.name: list(t.y) for t in fig.data if t.name.startswith("ceiling")}
    assert ceilings == {"ceiling: memcpy 12.5 GB/s": [12.5, 12.5],
                        "ceiling: loopback TCP 3.0 GB/s": [3.0, 3.0]}  # fmt: skip
    assert max(max(t.y) for t in fig.data) == 12.5  # nothing else reaches beyond the data


def test_policy_bars_show_hours_for_seconds():
    # before: 7,200 s was drawn as 25,920,000 "h" (divided by 1/3600 instead of by 3600)
    table = pd.DataFrame({"policy": ["fifo", "las"], "mean_jct_s": [7200.0, 3600.0],
                          "p95_jct_s": [36000.0, 18000.0]})  # fmt: skip
    fig = scheduling.policy_bars(table)
    assert list(fig.data[0].y) == [2.0, 1.0] and list(fig.data[1].y) == [10.0, 5.0]
    assert fig.data[0].name == "mean jct (h)"
