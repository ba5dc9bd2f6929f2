"""The panels as code drives them: configs from widgets, bad input refused before a run, the
background-thread path redrawing the Output widget, Stop and Interrupt, finished runs kept.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_widgets.py."""

import time

from labkit import RunConfig
from labkit.env import probe
from labkit.widgets import pipeline_panel, run_panel, world_sizes_upto
from tests.helpers.panels import progress_texts

SMALL = RunConfig(width=64, depth=2, global_batch=32, dataset_size=512, steps=5, warmup=1)


def test_world_sizes_upto():
    assert world_sizes_upto(1) == [1]
    assert world_sizes_upto(2) == [1, 2]
    assert world_sizes_upto(6) == [1, 2, 4, 6]


def test_panel_builds_configs_from_its_widgets_and_bounds_the_slider():
    panel = run_panel(SMALL)
    env = probe()
    assert panel.world.max == (
        env.max_world_size if env.device == "cuda" else max(2, 2 * env.max_world_size)
    )
    panel.strategies.value = ("single", "ddp_naive")
    panel.batch.value, panel.world.value = 64, 2
    got = [(c.strategy, c.world_size, c.global_batch) for c in panel.configs() if c.threads is None]
    assert got == [("single", 1, 64), ("ddp_naive", 1, 64), ("ddp_naive", 2, 64)]
    assert panel.status.value.startswith("ready: single")


def test_ready_line_warns_before_a_run_that_oversubscribes_the_cores():
    from labkit.env import cpu_cores
    from labkit.widgets import memory_panel

    panel = pipeline_panel()
    panel.stages.value = 4
    said = "time-share the cores" in panel.status.value
    assert said == (probe().device == "cpu" and cpu_cores() < 4), panel.status.value
    memory = memory_panel()
    memory.world.value = 1
    assert "time-share the cores" not in memory.status.value


def test_stopping_a_simulation_does_not_claim_to_terminate_ranks():
    from labkit.widgets import sched_panel

    panel = sched_panel(jobs=100, policies=("fifo",))
    assert panel.run() is not None  # an earlier run's table and charts stay below
    # maxmin takes ~15 s on 3,000 jobs at 160 % load on one node (~2 s on 4 nodes at 100 %)
    panel.jobs.value, panel.load.value, panel.nodes.value = panel.jobs.max, 1.6, 1
    for policies in (("maxmin",), ("fifo", "maxmin")):
        panel.policies.value = policies
        panel.start()
        deadline = time.time() + 30
        while time.time() < deadline and not progress_texts(panel).get("maxmin"):
            time.sleep(0.02)  # maxmin has reported (fifo, if chosen, is done: ~0.1 s)
        texts = progress_texts(panel)  # a bar per policy: its jobs finished
        assert texts["maxmin"].endswith(f"/{panel.jobs.max:,} jobs finished"), texts
        t0 = time.time()
        panel.stop("the Stop button")
        panel.wait(30)
        assert time.time() - t0 < 1
        said = panel.status.value
        assert "stopped</b> by the Stop button: the simulation was abandoned" in said
        assert "rank" not in said
        if policies == ("maxmin",):  # nothing finished: the output is the earlier run's
            assert "below: an earlier run (100 jobs" in said, said
        else:  # fifo finished: kept and shown, as this run's
            assert "showing the runs that had finished" in said and "earlier" not in said, said
            assert list(panel.table["policy"]) == ["fifo"]
            assert panel.table["jobs"].iloc[0] == panel.jobs.max
