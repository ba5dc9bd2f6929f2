"""The loop trains, the watch watches: phases that nest still add up to the step, one record
builder, one activation rule for the shared loop and the pipeline schedules, and a loop with no
instrumentation in it."""

from __future__ import annotations

import inspect
import math
import re
import time

import pytest
import torch
from torch import nn

from labkit import RunConfig
from labkit.dist import RankContext
from labkit.rank import loop
from labkit.rank.memory_meter import MemoryMeter
from labkit.rank.probes import PHASES, TIME_COLUMNS
from labkit.rank.recorder import Recorder
from labkit.rank.watch import Watch

NAP_S = 0.01
CFG = RunConfig(strategy="ddp", world_size=2, global_batch=64)
CTX = RankContext(1, 1, 2, torch.device("cpu"), None)


def test_a_phase_inside_another_ends_its_time_so_far_and_the_step_still_adds_up():
    watch = Watch(CFG, CTX)
    watch.probe.start()
    with watch.phase("comm"):
        time.sleep(NAP_S)
        with watch.phase("wait"):  # the balancer's arrival inside the gradient sync
            time.sleep(2 * NAP_S)
        time.sleep(NAP_S)
    timing = watch.probe.finish()
    assert 2 * NAP_S <= timing["wait_s"] < 2 * NAP_S + 0.5 * NAP_S + 0.01
    assert timing["comm_s"] >= 2 * NAP_S
    phases = sum(timing[f"{p}_s"] for p in PHASES)
    assert math.isclose(phases, timing["step_s"], rel_tol=0, abs_tol=1e-6)


def test_participants_act_inside_the_phase_they_perturb():
    class Sleeper:  # a straggler: its sleep belongs to the phase it slows down
        def exit(self, phase):
            if phase.name == "backward":
                time.sleep(2 * NAP_S)

    watch = Watch(CFG, CTX, Sleeper())
    watch._on_exit = [watch.parts[0].exit]  # what begin() wires, without a process group
    watch.probe.start()
    with watch.phase("forward"):
        pass
    with watch.phase("backward"):
        pass
    timing = watch.probe.finish()
    assert timing["backward_s"] >= 2 * NAP_S and timing["forward_s"] < NAP_S


def test_the_one_record_builder_lays_out_the_documented_columns():
    timing = dict.fromkeys(TIME_COLUMNS, 0.001) | {
        "start_s": 12.5,
        "compute_cpu_share": 0.9,
        "comm_total_s": 0.002,
    }
    traffic = {"comm_bytes": 1024, "comm_calls": 2, "comm_payload_bytes": 1024}
    rec = Recorder(CFG, CTX).build(3, torch.tensor(0.25), 32, timing, traffic, microbatches=4)
    assert {
        "strategy": "ddp",
        "world_size": 2,
        "rank": 1,
        "device": "cpu",
        "global_batch": 64,
        "accumulate": 1,
    }.items() <= rec.items()
    assert (rec["step"], rec["shard_loss"], rec["samples"]) == (3, 0.25, 32)
    assert isinstance(rec["shard_loss"], float)  # a tensor loss is turned into a number
    assert rec["threads"] == torch.get_num_threads() and rec["start_s"] == 12.5
    assert set(TIME_COLUMNS) <= set(rec) and rec["comm_total_s"] == 0.002
    assert rec["comm_bytes"] == 1024 and isinstance(rec["comm_bytes"], int)
    assert (rec["comm_calls"], rec["comm_payload_bytes"]) == (2, 1024)
    assert rec["peak_mem_bytes"] > 0 and rec["microbatches"] == 4
    assert all(not isinstance(v, (dict, list, torch.Tensor)) for v in rec.values())
    # a stage with no loss, and an asynchronous worker whose loss is its own
    assert math.isnan(Recorder(CFG, CTX).build(0, None, 8, timing, traffic)["shard_loss"])
    worker = Recorder(CFG, CTX, loss_as="worker_loss", role="worker")
    rec = worker.build(0, 0.5, 8, timing, traffic)
    assert math.isnan(rec["shard_loss"]) and rec["worker_loss"] == 0.5
    assert rec["role"] == "worker"


def _forward(meter, model, x, key):
    with meter.forward(x, key=key):
        return model(x).sum()


def test_one_activation_rule_for_accumulation_and_for_a_pipeline_schedule():
    """What a micro-batch's forward saved is held until its backward: gradient accumulation
    holds one micro-batch's at a time, GPipe all of them at once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    one = 5 * 16 * 4  # ReLU's output (the second Linear's input), saved once: fp32 5x16
    x = [torch.randn(5, 8) for _ in range(3)]

    accumulating = MemoryMeter(model, opt)
    for m in range(3):
        _forward(accumulating, model, x[m], None).backward()
        accumulating.backward_done()
    assert accumulating.columns()["mem_activations_bytes"] == one

    gpipe = MemoryMeter(model, opt, every_step=True)
    gpipe.begin(0)
    losses = [_forward(gpipe, model, x[m], m) for m in range(3)]
    for m, loss in enumerate(losses):
        loss.backward()
        gpipe.backward_done(m)
    assert gpipe.peaks() == {"activations_peak": 3, "activation_bytes_peak": 3 * one}
    assert gpipe.columns()["mem_activations_bytes"] == 3 * one
    assert gpipe.columns()["mem_rest_bytes"] == 5 * 8 * 4  # the data: counted once, not held


def test_a_meter_counts_one_step_unless_told_to_follow_every_step():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    meter = MemoryMeter(model, torch.optim.SGD(model.parameters(), lr=0.1), at_step=1)
    meter.begin(0)
    _forward(meter, model, torch.randn(5, 8), None)
    assert meter.columns()["mem_activations_bytes"] == 0 and meter.peaks()["activations_peak"] == 0
    meter.begin(1)
    _forward(meter, model, torch.randn(5, 8), None)
    assert meter.columns()["mem_activations_bytes"] == 5 * 16 * 4


@pytest.mark.parametrize(
    "word",
    [
        "probe",
        "record",
        "wire",
        "traffic",
        "balanc",
        "sleep",
        "meter",
        "resume",
        "pace",
        "profil",
        "time",
        "progress",
        "straggl",
        "slow",
    ],  # fmt: skip
)
def test_the_training_loop_holds_no_instrumentation(word):
    """What a learner reads when they follow a strategy into the loop: training only (habit
    20); everything that watches or perturbs it attaches through the watch."""
    body = inspect.getsource(loop.train_loop)
    code = "\n".join(line.split("#")[0] for line in body.split('"""')[2].splitlines())
    assert not re.search(rf"\b{word}", code, re.IGNORECASE), word
    assert len(body.splitlines()) <= 60
