"""The run panel: bounded slider, configs from widgets, unattended run, Stop."""
import time

from labkit import RunConfig
from labkit.env import probe
from labkit.widgets import run_panel, world_sizes_upto

SMALL = RunConfig(width=64, depth=2, global_batch=32, dataset_size=512, steps=5, warmup=1)


def test_world_sizes_upto():
    assert world_sizes_upto(1) == [1]
    assert world_sizes_upto(2) == [1, 2]
    assert world_sizes_upto(6) == [1, 2, 4, 6]


def test_panel_builds_configs_from_its_widgets_and_bounds_the_slider():
    panel = run_panel(SMALL, run_now=False)
    env = probe()
    assert panel.world.max == (env.max_world_size if env.device == "cuda"
                               else max(2, 2 * env.max_world_size))
    panel.strategies.value = ("single", "ddp_naive")
    panel.batch.value, panel.world.value = 64, 2
    got = [(c.strategy, c.world_size, c.global_batch) for c in panel.configs()]
    assert got == [("single", 1, 64), ("ddp_naive", 1, 64), ("ddp_naive", 2, 64)]


def test_panel_runs_its_default_selection_unattended():
    panel = run_panel(SMALL, selected=("single", "ddp"))
    assert set(panel.table["strategy"]) == {"single", "ddp"}
    assert "done" in panel.status.value
    assert all(bar.value == SMALL.warmup + SMALL.steps for bar in panel.bars.children)


def test_bad_input_is_shown_in_the_panel_and_keeps_previous_results():
    panel = run_panel(SMALL, selected=("single",))
    before = panel.records
    panel.batch.value = 31                    # not divisible by world size 2
    panel.world.value = 2
    panel.strategies.value = ("ddp",)
    assert panel.run() is None
    assert "not divisible" in panel.status.value and panel.records is before


def test_stop_button_cancels_a_background_run():
    panel = run_panel(SMALL.replace(steps=2000), selected=("ddp",), run_now=False)
    thread = panel.start()
    deadline = time.time() + 60
    while not panel.bars.children and time.time() < deadline:   # wait until ranks are running
        time.sleep(0.05)
    panel.stop_button.click()
    thread.join(30)
    assert not thread.is_alive()
    assert "stopped" in panel.status.value
    assert not panel.run_button.disabled
