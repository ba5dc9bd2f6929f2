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


def test_tables_for_people_round_by_quantity_and_name_the_unit():
    # what panels showed: world sizes as "1.0", samples/s as 17769.524823, MiB to six decimals,
    # bytes with no unit; one formatter now reads every panel's table
    from labkit.report import readable

    raw = pd.DataFrame(
        {
            "run": ["ddp@2", "single"],
            "world_size": [2.0, 1.0],
            "samples_per_s": [17769.524823, 880.0],
            "step_ms": [12.34567, 7.0],
            "comm_bytes": [4194304.0, 0.0],
            "peak_mib": [12.345678, 1.5],
            "cpu_share": [0.934, 1.0],
            "error": [-0.052, float("nan")],
            "busy": [True, False],
        }
    )
    shown = readable(raw)
    assert list(shown.columns) == [
        "run",
        "world size",
        "samples/s",
        "step (ms)",
        "comm bytes",
        "peak (MiB)",
        "cpu share",
        "error",
        "busy",
    ]
    assert shown.iloc[0].tolist() == [
        "ddp@2",
        "2",
        "17,770",
        "12.3",
        "4 MiB",
        "12.3",
        "93%",
        "-5%",
        "yes",
    ]
    assert shown.iloc[1].tolist() == ["single", "1", "880", "7.0", "0 B", "1.5", "100%", "", ""]
    # a number with no unit in its name: four significant digits, no exponent
    plain = readable(pd.DataFrame({"gpu_hours": [12093.4, 0.72334]}))["gpu hours"].tolist()
    assert plain == ["12,093", "0.7233"]


def test_every_panel_table_goes_through_the_one_formatter():
    from labkit.widgets.base import mime_output

    out = mime_output(pd.DataFrame({"world_size": [2.0], "step_ms": [3.14159]}))
    assert "step (ms)" in out["data"]["text/html"] and "3.1" in out["data"]["text/plain"]
    assert "2.0" not in out["data"]["text/plain"] and "3.14159" not in out["data"]["text/html"]


def test_sync_lanes_lay_each_rank_s_steps_end_to_end_from_the_records():
    import pandas as pd

    from labkit.plots.sync_async import lanes

    rows = []
    for strategy in ("ddp", "local_sgd"):
        for rank in (0, 1):
            for step in range(3):
                comm = 0.002 if strategy == "ddp" or step == 2 else 0.0
                phases = dict(data_s=0.001, forward_s=0.002, backward_s=0.003, wait_s=0.0)
                rows.append(
                    dict(strategy=strategy, world_size=2, rank=rank, step=step,
                         start_s=10.0 + 0.01 * step, comm_s=comm, optimizer_s=0.001, **phases)
                )  # fmt: skip
    fig = lanes(pd.DataFrame(rows), steps=2)
    by_name = {t.name: t for t in fig.data}
    assert len(by_name["comm"].x) == 4  # ddp's two steps on two ranks; local SGD's step 2 cut
    assert len(by_name["compute"].x) == 8 and not len(by_name["wait"].x)
    # on each lane a step's segments follow each other: the optimizer starts where comm ends
    ddp = [i for i, lane in enumerate(by_name["comm"].y) if lane.startswith("ddp")]
    for i in ddp:
        assert (
            abs(by_name["comm"].base[i] + by_name["comm"].x[i] - by_name["optimizer"].base[i])
            < 1e-9
        )
    assert min(by_name["compute"].base) == 0.0  # each run from its first measured step
