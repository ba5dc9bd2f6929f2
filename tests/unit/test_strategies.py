"""Data-parallel runs summarised from records, and the grid of configurations they come from.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_strategies.py."""

import math

import pandas as pd
import pytest
import torch

from labkit import RunConfig, experiment
from labkit.records import summarize

SMALL = RunConfig(width=64, depth=2, global_batch=32, dataset_size=512, steps=4, warmup=1)


def test_summarize_computes_aggregates_from_records():
    rows = []
    runs = [("single", 1, 2, 0.10), ("single", 1, 1, 0.16), ("ddp", 2, 1, 0.08)]
    for strategy, ws, threads, step_s in runs:
        for rank in range(ws):
            for step in range(3):  # rank 1 is the straggler: it gates the step
                rows.append(
                    {
                        "strategy": strategy,
                        "world_size": ws,
                        "threads": threads,
                        "rank": rank,
                        "step": step,
                        "step_s": step_s + 0.02 * rank,
                        "comm_s": 0.01 * ws,
                        "global_batch": 64,
                        "loss": 1.0 + step,
                        "peak_mem_bytes": 2**20,
                        "compute_cpu_share": 0.2 + 0.35 * ws,
                    }
                )
    table = summarize(pd.DataFrame(rows)).set_index("run")
    assert list(table.index) == ["single (2 threads)", "single (1 thread)", "ddp@2"]
    assert table.loc["single (2 threads)", "samples_per_s"] == pytest.approx(640)
    assert table.loc["ddp@2", "step_ms"] == pytest.approx(100)  # max over ranks
    assert table.loc["ddp@2", "speedup_all_cores"] == pytest.approx(1.0)  # vs single, 2 threads
    assert table.loc["ddp@2", "speedup_same_cores"] == pytest.approx(1.6)  # vs single, 1 thread
    assert table.loc["ddp@2", "efficiency"] == pytest.approx(0.8)
    assert table.loc["ddp@2", "comm_share"] == pytest.approx(0.2)
    assert table.loc["ddp@2", "loss"] == 3.0  # the last step's
    assert table["busy"].tolist() == [True, True, False]  # cpu share 0.55 < 0.6


def test_grid_adds_single_on_one_ranks_share_of_the_cores():
    from labkit.env import cpu_cores

    if torch.cuda.is_available() or cpu_cores() < 2:
        pytest.skip("the rank-share baseline is a CPU idea and needs 2+ cores")
    configs = experiment.grid(SMALL, ["single", "ddp"], [1, 2])
    singles = [c.threads for c in configs if c.strategy == "single"]
    assert singles == [None, cpu_cores() // 2]


def test_grid_and_bad_input():
    configs = experiment.grid(SMALL, ["single", "ddp"], [1, 2])
    assert [(c.strategy, c.world_size) for c in configs if c.threads is None] == [
        ("single", 1),
        ("ddp", 1),
        ("ddp", 2),
    ]
    with pytest.raises(ValueError, match="unknown strategy 'horovod'"):
        experiment.grid(SMALL, ["horovod"], [2])
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        experiment.grid(SMALL, ["ddp"], [3])
    assert math.isclose(SMALL.replace(world_size=4).batch_per_rank, 8)
