"""labkit.predict: the schedule simulator on hand-computed schedules, and measured costs read
back from simulated events.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_predict.py."""

from __future__ import annotations

import random

import pytest

from labkit.pipeline_schedules import SCHEDULES, check, spec
from labkit.predict import ScheduleCosts, costs_from_steps, predict_step, simulate
from labkit.predict.schedule import theory_bubble


def _by_key(events):
    return {(e["kind"], e["stage"], e["microbatch"]): (e["start"], e["end"]) for e in events}


def test_a_handoff_delays_each_dependent_action_exactly():
    # P=2, M=1, F=1, B=2, hand-off 0.5: F0 [0,1], F1 [1.5,2.5], B1 [2.5,4.5], B0 [5,7]
    events = _by_key(simulate("gpipe", 1, ScheduleCosts.uniform(2, 1.0, 2.0, 0.5)))
    assert events == {
        ("F", 0, 0): (0.0, 1.0),
        ("F", 1, 0): (1.5, 2.5),
        ("B", 1, 0): (2.5, 4.5),
        ("B", 0, 0): (5.0, 7.0),
    }
    out = predict_step("gpipe", 1, ScheduleCosts.uniform(2, 1.0, 2.0, 0.5))
    assert out["span_s"] == 7.0 and out["bubble"] == pytest.approx(4 / 7)


def test_a_dispatch_gap_separates_consecutive_actions_on_a_stage():
    # P=2, M=2, GPipe, F=B=1, no hand-off, 0.25 between two actions of a stage (worked by hand)
    costs = ScheduleCosts.uniform(2, 1.0, 1.0, 0.0, gap_s=0.25)
    events = _by_key(simulate("gpipe", 2, costs))
    assert events[("F", 0, 1)] == (1.25, 2.25)  # stage 0: free at 1, plus the gap
    assert events[("F", 1, 0)] == (1.0, 2.0)  # a stage's first action pays no gap
    assert events[("F", 1, 1)] == (2.25, 3.25)
    assert events[("B", 1, 0)] == (3.5, 4.5)
    assert events[("B", 0, 1)] == (5.75, 6.75)
    assert predict_step("gpipe", 2, costs)["bubble"] == pytest.approx(1 - 4 / 6.75)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,microbatches", [(2, 1), (2, 4), (3, 2), (4, 8)])
def test_free_handoffs_give_the_closed_form(schedule, stages, microbatches):
    out = predict_step(schedule, microbatches, ScheduleCosts.uniform(stages, 1.0, 2.0))
    for bubble in out["bubble_per_stage"].values():
        assert bubble == pytest.approx(theory_bubble(stages, microbatches))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 3])
def test_costs_read_back_from_simulated_events(schedule, stages):
    # unequal stages and a hand-off: the reader must recover what the simulator was given
    costs = ScheduleCosts(
        tuple(1.0 + 0.5 * s for s in range(stages)),
        tuple(2.0 + 0.25 * s for s in range(stages)),
        (0.3,) * (stages - 1),
        (0.0,) * stages,
    )
    events = simulate(schedule, 4, costs)
    got = costs_from_steps([events, events], stages)
    assert got.forward_s == pytest.approx(costs.forward_s)
    assert got.backward_s == pytest.approx(costs.backward_s)
    assert got.handoff_s == pytest.approx(costs.handoff_s)
    assert got.gap_s == pytest.approx(costs.gap_s, abs=1e-12)
    assert predict_step(schedule, 4, got)["bubble"] == pytest.approx(
        predict_step(schedule, 4, costs)["bubble"]
    )


def test_noisy_costs_predict_the_expected_bubble_not_the_bubble_at_the_means():
    # P=2, M=2, GPipe, every cost 1 except stage 1's forwards, each 0 or 2 (mean 1). Worked by
    # hand over the four equally likely (a, b): stage 1's second forward ends at
    # max(1 + a, 2) + b, the span is that plus 3, and the mean bubble is 1 - (6 + a + b) / (2 span):
    # spans 5, 7, 6, 8 and bubbles 2/5, 3/7, 1/3, 3/8. At the means (a = b = 1): span 6, bubble 1/3.
    costs = ScheduleCosts(
        (1.0, 1.0), (1.0, 1.0), (0.0,), (0.0, 0.0), samples={("F", 1): (0.0, 2.0)}
    )
    at_means = predict_step("gpipe", 2, costs, draws=0)
    assert at_means["span_s"] == 6.0 and at_means["bubble"] == pytest.approx(1 / 3)
    expected = predict_step("gpipe", 2, costs, draws=4000)
    assert expected["span_s"] == pytest.approx(26 / 4, abs=0.06)
    assert expected["bubble"] == pytest.approx((2 / 5 + 3 / 7 + 1 / 3 + 3 / 8) / 4, abs=0.004)
    assert expected["events"] == at_means["events"]  # the Gantt shows the means' schedule
    assert predict_step("gpipe", 2, costs)["bubble"] == predict_step("gpipe", 2, costs)["bubble"]


def test_flops_per_sample_counts_what_the_formula_says():
    """FlopCounterMode on the meta device against the MLP's formula: a forward computes
    2·in·out per Linear; backward computes each weight's gradient (2·in·out) and each input's,
    except the first layer's (the data need no gradient)."""
    from labkit import RunConfig
    from labkit.labs.compute_profile import flops_per_sample

    cfg = RunConfig(width=96, depth=3, in_features=32, classes=10)
    dims = [(32, 96), (96, 96), (96, 96), (96, 10)]
    forward, backward = flops_per_sample(cfg)
    assert forward == sum(2 * a * b for a, b in dims)
    assert backward == 2 * forward - 2 * dims[0][0] * dims[0][1]


def test_a_wrap_link_used_only_while_its_rank_was_busy_reads_without_a_sample():
    # three ranks, chunk 3 on rank 0 takes chunk 2's output across the wrap link (rank 2 -> 0);
    # rank 0 is still busy when it arrives, so that link has no hand-off sample. CI's run of
    # interleaved on three ranks hit exactly this and the reader indexed past the measured links
    def ev(stage, chunk, m, start, end):
        return dict(stage=stage, chunk=chunk, microbatch=m, kind="F", start=start, end=end)

    events = [
        ev(0, 0, 0, 0.0, 1.0),
        ev(1, 1, 0, 1.1, 2.1),
        ev(2, 2, 0, 2.2, 3.2),
        ev(0, 0, 1, 1.0, 4.0),  # rank 0 busy past chunk 2's end
        ev(0, 3, 0, 4.0, 5.0),
    ]
    got = costs_from_steps([events], 3)
    assert got.handoff_s == pytest.approx((0.1, 0.1))  # the two neighbour links, no wrap
    assert got.mean("hop", 2) == pytest.approx(0.1)  # the wrap reads as the links' mean
    assert got.samples[("gap", 0)] == pytest.approx((0.0, 0.0))  # both of rank 0's follow-ons


def test_the_reader_takes_any_jittered_run_of_every_schedule():
    # real runs are simulated runs plus a machine's noise: each action late by a random amount
    # and longer by another. Whatever the noise, the costs read back must drive the predictor
    # (CI's wrap-link IndexError came from such a run; the reader before its fix fails here)
    rng = random.Random(1)

    def draw(k, lo, hi):
        return tuple(rng.uniform(lo, hi) for _ in range(k))

    for _ in range(400):
        schedule = rng.choice(list(SCHEDULES))
        v = spec(schedule).virtual or rng.choice([1, 2])
        P, M = rng.choice([2, 3, 4]), rng.choice([1, 2, 3, 4, 6, 8])
        n = P * v
        try:  # the configurations a run would accept
            check(schedule, schedule, P, M, v, layers=n, impl="torch")
        except ValueError:
            continue
        costs = ScheduleCosts(
            draw(n, 0.1, 3), draw(n, 0.1, 3), draw(P, 0, 2), draw(P, 0, 0.5),
            input_s=draw(n, 0.1, 2), weight_s=draw(n, 0.1, 2), virtual=v,
        )  # fmt: skip
        events = simulate(schedule, M, costs)
        steps = []
        for _ in range(rng.choice([1, 2, 3])):
            noisy = [dict(e) for e in events]
            for e in noisy:
                late = rng.uniform(0, 1)
                e["start"] += late
                e["end"] += late + rng.uniform(0, 0.5)
            steps.append(noisy)
        got = costs_from_steps(steps, P)
        assert got.virtual == v
        out = predict_step(schedule, M, got, draws=2)
        assert out["span_s"] > 0 and 0 <= out["bubble"] < 1
