"""The load-balancing lab with real ranks on gloo: a slowdown slows its rank and only it, shares
that follow throughput give exactly single-device training's update, Join lets uneven ranks
finish while the run without it ends in a clear error inside its timeout, and cost-aware
sharding evens out padded work. The throughput goal is a benchmark, not a timed test.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_balance.py."""

from __future__ import annotations

import pandas as pd
import pytest

from labkit import RunConfig, records, shares
from labkit.labs import cost_split, uneven
from labkit.predict import step
from labkit.predict.collectives import AlphaBeta, CollectiveModel

# ---- parsing, shares, validation ------------------------------------------------------------


def test_slowdown_spellings_agree():
    want = ((0, 1.5, 10), (1, 2.0, None))
    assert shares.parse_slowdown("1:2, 0:1.5@10") == want
    assert shares.parse_slowdown({1: 2, 0: (1.5)}) == ((0, 1.5, None), (1, 2.0, None))
    assert shares.parse_slowdown([(1, 2), (0, 1.5, 10)]) == want
    assert RunConfig(strategy="ddp_naive", slowdown="1:2").slowdown == ((1, 2.0, None),)
    assert shares.format_slowdown(want) == "0:1.5@10,1:2"
    assert shares.slowdown_at(want, 0, 9) == 1.0 and shares.slowdown_at(want, 0, 10) == 1.5
    assert shares.slowdown_at(want, 1, -2) == 2.0  # warm-up too


@pytest.mark.parametrize(
    "bad, match",
    [("1", "RANK:FACTOR"), ("1:x", "RANK:FACTOR"), ("1:0.5", "below 1"), ("1:2,1:3", "twice")],
)
def test_bad_slowdown_says_how(bad, match):
    with pytest.raises(ValueError, match=match):
        shares.parse_slowdown(bad)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(strategy="local_sgd", skew=0.5), "set strategy='ddp' or 'ddp_naive'"),
        (dict(slowdown="2:2"), "ranks 0..1"),
        (dict(accumulate=2), "accumulate=1"),
        (dict(rebalance="sometimes"), "unknown rebalance 'sometimes'"),
        (dict(skew=-1), "skew must be >= 0"),
    ],
)
def test_balancing_config_errors_name_the_fix(changes, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**{**dict(strategy="ddp_naive", slowdown="1:2"), **changes})


def test_split_is_whole_proportional_and_complete():
    assert shares.split(64, [1, 1]) == [32, 32]
    assert shares.split(64, [2, 1]) == [43, 21]
    assert shares.split(10, [1, 0, 0]) == [8, 1, 1]  # everyone keeps at least one
    assert sum(shares.split(1000, [0.3, 1.7, 2.2, 5.0])) == 1000
    assert shares.skew_weights(3, 1.0) == [1.0, 1.5, 2.0]


def test_predictor_static_runs_at_the_stragglers_pace_dynamic_evens_it_out():
    layer = step.Layer("l", forward_s=0.01, backward_s=0.02, grad_bytes=(4,))
    prof = step.Profile(batch=32, layers=(layer,))
    free = CollectiveModel({"all_reduce": AlphaBeta(0.0, float("inf"))})
    static = step.predict_balance(prof, free, 2, 64, [1.0, 2.0])
    dynamic = step.predict_balance(prof, free, 2, 64, [1.0, 2.0], policy="dynamic")
    assert static["shares"] == [32, 32] and static["step_s"] == pytest.approx(0.06)
    assert static["throughput_fraction"] == pytest.approx(2 / 3)
    assert dynamic["shares"] == [43, 21]
    assert dynamic["throughput_fraction"] > 0.97
    assert max(dynamic["wait_s"]) < 0.002 and static["wait_s"][0] == pytest.approx(0.03)


def test_throughput_fraction_from_records():
    # rank 0 computes 10 ms and waits 10; rank 1 computes 20: half of rank 0's time is wasted
    recs = pd.DataFrame(
        [
            dict(rank=0, step=s, samples=32, step_s=0.025, wait_s=0.010, comm_s=0.005)
            for s in range(3)
        ]
        + [
            dict(rank=1, step=s, samples=32, step_s=0.025, wait_s=0.0, comm_s=0.005)
            for s in range(3)
        ]
    )
    got = records.throughput(recs)
    assert got["samples_per_s_run"] == pytest.approx(64 / 0.025)
    assert got["ideal_samples_per_s"] == pytest.approx(32 / 0.010 + 32 / 0.020)
    assert got["wait_share"] == pytest.approx(0.2)


def test_sampler_padding_counts_repeats_and_drops():
    rows = uneven.sampler_padding(10, 4).set_index("drop_last")
    assert rows.loc[False, "repeated"] == 2 and rows.loc[False, "dropped"] == 0
    assert rows.loc[True, "dropped"] == 2 and rows.loc[True, "repeated"] == 0


# ---- variable-cost samples -------------------------------------------------------------------


def test_cost_aware_sharding_evens_out_padded_work():
    ds = cost_split.VariableLengthTokens(512, seed=1)
    worse = 0
    for k in range(8):
        lengths = [int(n) for n in ds.lengths[64 * k : 64 * (k + 1)]]
        cost = {
            p: [
                cost_split.padded_cost([lengths[i] for i in part])
                for part in cost_split.shard(lengths, 2, p)
            ]
            for p in ("random", "cost")
        }
        assert sorted(i for part in cost_split.shard(lengths, 2, "cost") for i in part) == list(
            range(64)
        )  # every sample, once
        assert max(cost["cost"]) <= max(cost["random"])
        worse += max(cost["cost"]) < 0.8 * max(cost["random"])
    assert worse >= 6  # usually far less padding on the busiest


def test_sharding_measurement_has_a_row_per_policy_step_and_rank():
    rows = cost_split.measure(cost_split.VariableLengthTokens(256), 2, 32, steps=2, repeats=1)
    assert len(rows) == 2 * 2 * 2
    assert set(cost_split.step_table(rows)["policy"]) == {"random", "cost"}
