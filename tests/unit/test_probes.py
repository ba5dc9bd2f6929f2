"""StepProbe: phase times add up to the step, communication is split where it belongs, probing is
cheap. (Records built from them: tests/unit/test_watch.py.)

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_probes.py."""

from __future__ import annotations

import math
import time

import torch

from labkit.models import mlp
from labkit.rank.probes import (
    PHASES,
    TIME_COLUMNS,
    StepProbe,
    grad_bytes,
    probe_overhead_s,
)
from tests.helpers.probes import timed_step

NAP_S = 0.01  # long enough to see, short enough to keep tests fast


def test_phase_times_add_up_to_step_s_and_each_covers_its_work():
    probe = StepProbe(torch.device("cpu"))
    naps = {"data": NAP_S, "forward": 2 * NAP_S, "backward": 3 * NAP_S, "optimizer": NAP_S}
    rec = timed_step(probe, naps)
    phases = sum(rec[f"{p}_s"] for p in PHASES)
    assert math.isclose(phases, rec["step_s"], rel_tol=0, abs_tol=1e-6)
    for phase, nap in naps.items():
        assert rec[f"{phase}_s"] >= nap  # sleep never returns early: a lower bound only
    assert rec["comm_s"] >= 0.0


def test_timing_columns_cover_every_phase_and_say_what_was_in_flight():
    traffic = {"comm_bytes": 1024, "comm_calls": 2, "comm_payload_bytes": 1024,
               "comm_in_flight_s": 0.5, "comm_untimed": 0}  # fmt: skip
    timing = timed_step(StepProbe("cpu"), {"comm": NAP_S}, traffic=traffic)
    assert set(TIME_COLUMNS) <= set(timing) and timing["start_s"] > 0
    assert timing["comm_total_s"] == 0.5  # every collective timed: their time in flight
    untimed = timed_step(StepProbe("cpu"), {"comm": NAP_S})  # none timed: the phase itself
    assert untimed["comm_total_s"] == untimed["comm_s"] >= NAP_S
    assert all(isinstance(v, float) for v in timing.values())


def test_comm_baseline_moves_exposed_communication_out_of_backward():
    probe = StepProbe("cpu")
    rec = timed_step(probe, {"backward": 3 * NAP_S}, comm_baseline_s=NAP_S)
    # backward is trimmed to the no-communication baseline; the rest is exposed communication
    assert math.isclose(rec["backward_s"], NAP_S, abs_tol=1e-9)
    assert rec["comm_s"] >= 2 * NAP_S - 1e-6
    total = sum(rec[f"{p}_s"] for p in PHASES)
    assert math.isclose(total, rec["step_s"], rel_tol=0, abs_tol=1e-6)


def test_a_baseline_longer_than_backward_exposes_nothing():
    rec = timed_step(StepProbe("cpu"), {"backward": NAP_S}, comm_baseline_s=10.0)
    assert rec["comm_s"] < NAP_S and rec["backward_s"] >= NAP_S


def test_a_repeated_phase_accumulates():
    probe = StepProbe("cpu")
    probe.start()
    for _ in range(3):  # e.g. one forward mark per micro-batch
        time.sleep(NAP_S)
        probe.mark("forward")
    rec = probe.finish()
    assert rec["forward_s"] >= 3 * NAP_S
    assert math.isclose(rec["forward_s"], rec["step_s"], abs_tol=1e-6)


def test_probe_overhead_is_small():
    # Nominally microseconds; 1 ms per step would still be invisible beside a training step,
    # and leaves room for a loaded 2-core CI machine.
    overhead = probe_overhead_s("cpu", steps=500)
    assert 0 < overhead < 1e-3, f"{overhead * 1e6:.0f} us per probed step"


def test_time_columns_match_phases():
    assert TIME_COLUMNS == tuple(f"{p}_s" for p in PHASES) + ("step_s",)
    # "wait": a rank's time waiting for the others (the load-balancing lab's arrival point, a
    # pipeline's barrier); "other": between the timed phases (a pipeline schedule's bookkeeping)
    assert PHASES == (
        "data", "forward", "backward", "wait", "comm", "sync_overhead", "optimizer", "other"
    )  # fmt: skip


def test_grad_bytes_counts_trainable_parameters_once():
    model = mlp(8, 16, 2, 4)
    n = sum(p.numel() for p in model.parameters())
    assert grad_bytes(model) == 4 * n  # float32
    model[0].requires_grad_(False)
    frozen = sum(p.numel() for p in model[0].parameters())
    assert grad_bytes(model) == 4 * (n - frozen)
    assert grad_bytes(model.to(torch.float64)) == 8 * (n - frozen)
