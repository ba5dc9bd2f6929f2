"""The panels as code drives them: configs from widgets, bad input refused before a run, the
background-thread path redrawing the Output widget, Stop and Interrupt, finished runs kept.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_widgets.py."""

import json
import time

from labkit import RunConfig
from labkit.widgets import pipeline_panel, run_panel
from tests.helpers.panels import progress_texts

SMALL = RunConfig(width=64, depth=2, global_batch=32, dataset_size=512, steps=5, warmup=1)
PLOTLY = "application/vnd.plotly.v1+json"


def shown(panel) -> str:
    """Everything the panel's Output widget holds, as text (tables' HTML, figures' JSON)."""
    return json.dumps([o["data"] for o in panel.out.outputs])


def test_unattended_run_draws_table_and_charts_into_the_panel():
    panel = run_panel(SMALL, selected=("single", "ddp"), run_now=True)
    assert set(panel.table["strategy"]) == {"single", "ddp"}
    assert "done" in panel.status.value
    kinds = [next(iter(o["data"])) for o in panel.out.outputs]
    assert kinds[0] == "text/html" and kinds.count(PLOTLY) == 2  # the table, then 2 charts
    assert "ddp@2" in shown(panel) and PLOTLY in shown(panel)
    assert all(
        bar.value == bar.max == SMALL.steps
        for bar, _ in (row.children for row in panel.bars.children)
    )


def test_a_run_from_the_background_thread_redraws_with_the_new_configuration():
    panel = run_panel(SMALL, selected=("single", "ddp"), run_now=True)
    panel.strategies.value = ("single", "ddp_naive")
    panel.start().join(120)
    assert "ddp_naive@2" in shown(panel) and "ddp@2" not in shown(panel)
    assert PLOTLY in shown(panel) and "done" in panel.status.value


def test_bad_input_is_refused_before_a_run_and_clears_stale_progress():
    panel = run_panel(SMALL, selected=("single", "ddp"), run_now=True)
    before = panel.records
    panel.batch.value = 30  # world sizes 1, 2, 3 and 4: 4 does not divide 30
    panel.world.value = 4
    assert panel.run_button.disabled and "cannot run" in panel.status.value
    assert "not divisible by world size 4" in panel.status.value
    assert panel.bars.children == ()
    assert panel.run() is None and panel.records is before
    panel.batch.value = 32
    assert not panel.run_button.disabled


def _wait_for_bars(panel, timeout=60):
    deadline = time.time() + timeout
    while not panel.bars.children and time.time() < deadline:  # ranks are running
        time.sleep(0.05)


def test_stop_and_interrupt_stop_a_background_run_within_a_second():
    for how, said in (("stop_button", "the Stop button"), ("interrupt", "the kernel's Interrupt")):
        panel = run_panel(SMALL.replace(steps=2000), selected=("ddp",))
        panel.world.value = 2
        thread = panel.start()
        _wait_for_bars(panel)
        t0 = time.time()
        panel.stop_button.click() if how == "stop_button" else panel.interrupt()
        thread.join(30)
        assert not thread.is_alive() and time.time() - t0 < 5
        assert f"stopped</b> by {said}" in panel.status.value
        assert not panel.run_button.disabled


def test_stop_keeps_the_runs_that_had_finished():
    panel = run_panel(SMALL.replace(steps=2000), selected=("single", "ddp"))
    panel.steps.value = 200
    panel.world.value = 2
    thread = panel.start()
    deadline = time.time() + 120
    while len(panel.finished) < 2 and time.time() < deadline:  # both singles finished
        time.sleep(0.05)
    panel.stop()
    thread.join(30)
    assert "showing the runs that had finished" in panel.status.value
    assert "single (" in shown(panel)


def test_pipeline_panel_controls_and_redraw():
    base = SMALL.replace(strategy="pipeline_1f1b", world_size=2, stages=2, microbatches=4)
    panel = pipeline_panel(base)
    panel.schedule.value = "model_parallel"
    assert panel.microbatches.disabled and "M=1" in panel.status.value
    panel.schedule.value = "pipeline_gpipe"
    panel.steps.value = 3
    panel.start().join(120)
    assert panel.result.cfg.steps == 3
    assert "measured, one step (gpipe, P=2, M=4)" in shown(panel) and "replayed" in shown(panel)
    assert "replayed" in panel.status.value and "closed form" in panel.status.value


def test_a_panel_trains_your_own_model():
    from torch import nn

    panel = run_panel(
        SMALL,
        selected=("ddp",),
        run_now=True,
        model_fn=lambda cfg: nn.Sequential(nn.Linear(32, 7), nn.Tanh(), nn.Linear(7, 10)),
    )
    assert panel.error is None and "done" in panel.status.value
    sent = panel.records.groupby("world_size")["comm_bytes"].unique()  # counted on the wire
    assert list(sent[2]) == [4 * (32 * 7 + 7 + 7 * 10 + 10)] and list(sent[1]) == [0]


def test_layout_panel_maps_degrees_to_strategies_and_keeps_each_run_apart():
    from labkit.widgets import layout_panel
    from labkit.widgets.layout_panel import layout_strategy

    assert [layout_strategy(*d) for d in ((1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2),
                                          (2, 1, 2))] == [
        "single", "ddp", "tp", "dp_tp", "pipeline_1f1b", "dp_pp"]  # fmt: skip
    panel = layout_panel(RunConfig(strategy="tp", model="transformer", width=32, steps=3))
    panel.stages.value = 2  # tensor and pipeline together: refused before anything runs
    assert "cannot run: tensor and pipeline" in panel.status.value and panel.run_button.disabled
    panel.stages.value = 1
    assert panel.sp.disabled is False
    panel.model.value = "mlp"  # sequence parallelism needs a sequence
    assert panel.sp.disabled and panel.sp.value is False
    panel.model.value = "transformer"
    for _ in range(2):  # the same configuration twice: two rows, never pooled
        assert panel.run() is not None, panel.error
    table = panel.table()
    assert list(table["run"]) == [1, 2] and set(table["strategy"]) == {"tp"}
    assert table["bytes_sent_per_rank_step"].nunique() == 1  # the same bytes, counted per run
    assert "2 run(s) in the table, one row each" in panel.status.value
    assert PLOTLY in shown(panel)


def test_the_same_configuration_run_three_times_is_three_rows_not_one_pooled_run():
    # before: samples/s 88k -> 176k -> 221k and "1 run(s)": three runs' steps pooled in one row
    from labkit.labs.sync_async import to_target
    from labkit.widgets import sync_panel

    panel = sync_panel(SMALL.replace(steps=10))
    panel.modes.value = ("ddp",)
    for _ in range(3):
        assert panel.run() is not None, panel.error
    table = to_target(panel.records, float("inf"))
    assert list(table["run"]) == ["ddp@2", "ddp@2 repeat 2", "ddp@2 repeat 3"], table
    assert (panel.records.groupby("variant")["step"].nunique() == 10).all()  # each its own steps
    assert "3 run(s) in the table" in panel.status.value


def test_save_trace_writes_the_last_run_as_a_chrome_trace(tmp_path, monkeypatch):
    from labkit.widgets import layout_panel, sched_panel

    monkeypatch.chdir(tmp_path)
    panel = layout_panel(RunConfig(strategy="tp", model="transformer", width=32, steps=3))
    assert panel.trace_button.disabled  # nothing ran yet
    assert panel.run() is not None, panel.error
    assert not panel.trace_button.disabled
    panel.trace_button.click()
    saved = list((tmp_path / "traces").glob("labkit-*.json"))
    assert len(saved) == 1 and str(saved[0].relative_to(tmp_path)) in panel.status.value
    trace = json.loads(saved[0].read_text())
    ranks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert ranks == {"rank 0", "rank 1"}
    steps = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert steps and all(e["dur"] >= 0 for e in steps)
    assert sched_panel().trace_button.layout.display == "none"  # a simulation has no ranks


def test_stopping_an_elastic_run_answers_within_a_second_and_leaves_no_process():
    import psutil

    from labkit.widgets import elastic_panel

    panel = elastic_panel(SMALL.replace(strategy="ddp", steps=2000, pace_s=0.05, timeout_s=60))
    panel.start()
    deadline = time.time() + 60
    while time.time() < deadline and "step" not in "".join(progress_texts(panel).values()):
        time.sleep(0.05)  # torchrun's agent and its worker are training
    job = panel.job
    procs = [psutil.Process(a.proc.pid) for a in job.agents]
    procs += [c for p in procs for c in p.children(recursive=True)]
    assert len(procs) >= 2, procs  # an agent and its worker
    t0 = time.time()
    panel.stop("the Stop button")
    panel.wait(30)
    assert time.time() - t0 < 1.5, time.time() - t0
    assert "stopped</b> by the Stop button" in panel.status.value
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_elastic_panel_buttons_add_kill_and_remove_a_node():
    """What a person clicks: Add a node (world size 1 -> 2), Kill a worker (torchrun restarts
    the group from its checkpoint: a new attempt, the same world size), Remove a node (2 -> 1);
    each change is read from the workers' own step records, not from the panel's buttons."""
    from labkit.widgets import elastic_panel

    panel = elastic_panel(SMALL.replace(strategy="ddp", steps=100_000, pace_s=0.02, timeout_s=60))
    panel.every.value = 5

    def now():
        steps = panel.job.steps() if panel.job is not None else ()
        return steps.iloc[-1] if len(steps) else None

    def until(ok, timeout_s=120):
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            row = now()
            if row is not None and ok(row):
                return row
            time.sleep(0.1)
        raise AssertionError(f"not reached in {timeout_s} s: {now()}")

    panel.start()
    try:
        first = until(lambda r: r["world_size"] == 1 and r["step"] >= 5)
        panel.add_button.click()
        joined = until(lambda r: r["world_size"] == 2)
        assert joined["attempt"] > first["attempt"]  # a join re-forms the group
        until(lambda r: r["world_size"] == 2 and r["step"] >= joined["step"] + 5)
        panel.kill_button.click()
        killed = until(lambda r: r["attempt"] > joined["attempt"] and r["world_size"] == 2)
        until(lambda r: r["attempt"] == killed["attempt"] and r["step"] >= killed["step"] + 5)
        panel.remove_button.click()
        left = until(lambda r: r["world_size"] == 1)
        assert left["attempt"] > killed["attempt"]
        assert [e["event"] for e in panel.job.events] == ["join", "join", "kill", "leave"]
    finally:
        panel.stop("the Stop button")
        panel.wait(30)


def test_a_panel_clock_moves_every_second_while_a_run_reports_nothing():
    """Work that reports rarely (a large model's step on a CPU) still shows the panel alive:
    the clock beside the buttons counts the seconds since Run, then says how long it took."""
    panel = run_panel(SMALL.replace(steps=6, pace_s=0.5), strategies=["ddp"], selected=("ddp",))
    panel.world.value = 2
    seen, t0 = [], time.time()

    def quiet(*_):  # no progress bar moves: only the clock can
        pass

    panel._progress = quiet
    panel.start()
    while panel._thread.is_alive() and time.time() - t0 < 60:
        seen.append((time.time() - t0, panel.clock.value))
        time.sleep(0.1)
    panel.wait(30)
    changes = [t for (t, v), (_, before) in zip(seen[1:], seen) if v != before]
    assert seen[-1][0] > 3 and len(changes) >= 3, seen  # 6 steps of at least 0.5 s each
    assert max(b - a for a, b in zip([0.0, *changes], changes)) < 1.5, changes
    assert panel.error is None and panel.clock.value.startswith("<small>took "), panel.clock.value
