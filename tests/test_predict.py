"""labkit.predict: the schedule simulator on hand-computed schedules, and measured costs read
back from simulated events."""
from __future__ import annotations

import pytest

from labkit import timeline
from labkit.predict import ScheduleCosts, costs_from_steps, predict_step, simulate


def _by_key(events):
    return {(e["kind"], e["stage"], e["microbatch"]): (e["start"], e["end"]) for e in events}


def test_a_handoff_delays_each_dependent_action_exactly():
    # P=2, M=1, F=1, B=2, hand-off 0.5: F0 [0,1], F1 [1.5,2.5], B1 [2.5,4.5], B0 [5,7]
    events = _by_key(simulate("gpipe", 1, ScheduleCosts.uniform(2, 1.0, 2.0, 0.5)))
    assert events == {("F", 0, 0): (0.0, 1.0), ("F", 1, 0): (1.5, 2.5),
                      ("B", 1, 0): (2.5, 4.5), ("B", 0, 0): (5.0, 7.0)}
    out = predict_step("gpipe", 1, ScheduleCosts.uniform(2, 1.0, 2.0, 0.5))
    assert out["span_s"] == 7.0 and out["bubble"] == pytest.approx(4 / 7)


def test_a_dispatch_gap_separates_consecutive_actions_on_a_stage():
    # P=2, M=2, GPipe, F=B=1, no hand-off, 0.25 between two actions of a stage (worked by hand)
    costs = ScheduleCosts.uniform(2, 1.0, 1.0, 0.0, gap_s=0.25)
    events = _by_key(simulate("gpipe", 2, costs))
    assert events[("F", 0, 1)] == (1.25, 2.25)          # stage 0: free at 1, plus the gap
    assert events[("F", 1, 0)] == (1.0, 2.0)            # a stage's first action pays no gap
    assert events[("F", 1, 1)] == (2.25, 3.25)
    assert events[("B", 1, 0)] == (3.5, 4.5)
    assert events[("B", 0, 1)] == (5.75, 6.75)
    assert predict_step("gpipe", 2, costs)["bubble"] == pytest.approx(1 - 4 / 6.75)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (3, 2), (4, 8)])
def test_free_handoffs_give_the_closed_form(schedule, stages, microbatches):
    out = predict_step(schedule, microbatches, ScheduleCosts.uniform(stages, 1.0, 2.0))
    for bubble in out["bubble_per_stage"].values():
        assert bubble == pytest.approx(timeline.theory_bubble(stages, microbatches))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3])
def test_costs_read_back_from_simulated_events(schedule, stages):
    # unequal stages and a hand-off: the reader must recover what the simulator was given
    costs = ScheduleCosts(tuple(1.0 + 0.5 * s for s in range(stages)),
                          tuple(2.0 + 0.25 * s for s in range(stages)),
                          (0.3,) * (stages - 1), (0.0,) * stages)
    events = simulate(schedule, 4, costs)
    got = costs_from_steps([events, events], stages)
    assert got.forward_s == pytest.approx(costs.forward_s)
    assert got.backward_s == pytest.approx(costs.backward_s)
    assert got.handoff_s == pytest.approx(costs.handoff_s)
    assert got.gap_s == pytest.approx(costs.gap_s, abs=1e-12)
    assert predict_step(schedule, 4, got)["bubble"] == pytest.approx(
        predict_step(schedule, 4, costs)["bubble"])
