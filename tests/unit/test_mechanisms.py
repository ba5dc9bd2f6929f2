"""The mechanisms the lessons draw: each picture's data comes from running the mechanism (gloo
ranks as threads, torch's fake process group), and is checked here against what the
collective's definition, torch's own all-reduce, the cost model and the schedule theory say."""

from __future__ import annotations

import pytest
import torch

from labkit.dist import fake_rank, on_threads
from labkit.labs import mechanisms as m
from labkit.pipeline_schedules import stage_actions
from labkit.plots import mechanisms as pm
from labkit.predict.collectives import coefficients
from labkit.predict.schedule import theory_bubble

N = 4
A = m.owner


def test_each_collective_moves_the_chunks_its_definition_says():
    own = [[f"{A(r)}{c}" for c in range(N)] for r in range(N)]
    sums = [f"Σ{c}" for c in range(N)]
    pieces = [f"{A(r)}{r}" for r in range(N)]
    expected = {
        "all_reduce": [sums] * N,
        "reduce_scatter": [[f"Σ{r}"] for r in range(N)],
        "all_gather": [pieces] * N,
        "broadcast": [own[0]] * N,
        "all_to_all": [[f"{A(k)}{r}" for k in range(N)] for r in range(N)],
        "scatter": [[f"A{r}"] for r in range(N)],
        "gather": [pieces] + [[p] for p in pieces[1:]],
    }
    for op, after in expected.items():
        c = m.collective(op, N)
        assert c.after == after, op
    reduce = m.collective("reduce", N)
    assert reduce.after[0] == sums and reduce.before == own


def test_a_sum_counts_every_rank_s_chunk_exactly_once():
    c = m.collective("all_reduce", N)
    for after in c.sums:  # row c: one unit at (r, c) for every rank r, nothing else
        expected = torch.zeros(N, N * N, dtype=torch.float64)
        for chunk in range(N):
            expected[chunk, [r * N + chunk for r in range(N)]] = 1.0
        assert torch.equal(after, expected)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_the_ring_ends_where_torch_s_all_reduce_does_and_sends_what_the_cost_model_says(n):
    steps = m.ring(n)
    assert len(steps) == 1 + 2 * (n - 1)
    assert steps[-1].held == m.collective("all_reduce", n).after
    assert [s.phase for s in steps[1:]] == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    # each rank sent 2(n-1) chunks of 1/n: the all-reduce's b coefficient, 2(n-1)/n of the data
    assert all(
        k / n == pytest.approx(coefficients("all_reduce", n)[1]) for k in steps[-1].elements_sent
    )
    # after the reduce-scatter each rank holds one complete sum: chunk r+1
    middle = steps[n - 1]
    assert [row[(r + 1) % n] for r, row in enumerate(middle.held)] == [
        f"Σ{(r + 1) % n}" for r in range(n)
    ]


def test_the_ring_sums_real_numbers_as_gloo_s_all_reduce_does():
    def both(group):
        g = torch.Generator().manual_seed(group.rank())
        x = torch.randn(12, generator=g, dtype=torch.float64)
        ours = m.ring_all_reduce(x.clone(), group)
        theirs = x.clone()
        group.allreduce([theirs]).wait()
        return ours, theirs

    for ours, theirs in on_threads(both, 3):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_the_ring_refuses_a_tensor_it_cannot_cut_evenly():
    with pytest.raises(ValueError, match="multiple of 3"):
        on_threads(lambda group: m.ring_all_reduce(torch.zeros(4), group), 3, timeout_s=5)


def test_a_failing_rank_thread_raises_its_own_error_not_a_peer_s_timeout():
    def fail_on_one(group):
        if group.rank() == 1:
            raise KeyError("rank 1 broke")
        group.allreduce([torch.zeros(1)]).wait()

    with pytest.raises(KeyError, match="rank 1 broke"):
        on_threads(fail_on_one, 2, timeout_s=2)


def test_bad_requests_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="all_reduce"):
        m.collective("allreduce")
    with pytest.raises(ValueError, match="2..8"):
        m.ring(9)
    with pytest.raises(ValueError, match="fsdp"):
        m.shards("zero2")
    with pytest.raises(ValueError, match="divides"):
        m.shards("hsdp", 4, shard_size=3)
    with pytest.raises(ValueError, match="1f1b"):
        m.pipeline_order("1f2b")


def test_fake_rank_refuses_a_second_group_and_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="0..3"):
        with fake_rank(4, 4):
            pass
    with fake_rank(0, 4) as ctx:
        assert ctx.world_size == 4 and torch.distributed.get_world_size() == 4
        with pytest.raises(RuntimeError, match="cleanup"):
            with fake_rank(1, 4):
                pass
    assert not torch.distributed.is_initialized()


def test_what_each_rank_keeps_adds_up_to_the_model_under_each_strategy():
    for strategy, copies in (("ddp", N), ("zero1", None), ("fsdp", 1), ("hsdp", 2)):
        t = m.shards(strategy, N, shard_size=2)
        held = t.groupby(["kind", "tensor"])["held"].sum()
        total = t.groupby(["kind", "tensor"])["total"].first()
        if strategy == "zero1":  # states partitioned, whole tensors; the rest everywhere
            assert (held["optimizer"] == total["optimizer"]).all()
            assert (held["parameters"] == N * total["parameters"]).all()
            assert set(t[t["kind"] == "optimizer"]["share"]) == {0.0, 1.0}
        else:  # every element kept by `copies` ranks
            assert (held == copies * total).all(), strategy


def test_the_executor_s_order_in_unit_time_has_the_bubble_theory_gives():
    P, M = 4, 8
    for schedule in ("gpipe", "1f1b"):
        events = m.pipeline_order(schedule, P, M)
        for s in range(P):  # each stage runs the executor's order
            mine = sorted((e for e in events if e["stage"] == s), key=lambda e: e["start"])
            assert [(e["kind"], e["microbatch"]) for e in mine] == stage_actions(schedule, P, M, s)
        span = max(e["end"] for e in events)
        busy = M * 3.0  # per stage: M forwards of 1 and M backwards of 2
        assert 1 - busy / span == pytest.approx(theory_bubble(P, M))


def test_the_figures_show_what_ran():
    c = m.collective("reduce_scatter", N)
    fig = pm.collective(c)
    assert [list(map(list, t.text)) for t in fig.data] == [
        [row + [""] * (N - len(row)) for row in side] for side in (c.before, c.after)
    ]
    steps = m.ring(N)
    ring = pm.ring(steps)
    assert len(ring.frames) == len(steps)
    assert [list(row) for row in ring.frames[-1].data[0].text] == steps[-1].held
    table = m.shards("fsdp", N)
    assert len(pm.shards(table).data) == 3
    events = m.pipeline_order("1f1b", 2, 3)
    fig = pm.pipeline_order(events, "1f1b")
    assert sum(len(t.x) for t in fig.frames[-1].data) == len(events)


def test_the_tensor_parallel_cut_is_the_hand_written_split_and_adds_up():
    """tp_dtensor's plan (the library) and tp.py's Megatron split (by hand) give every rank the
    same slices; split weights add up to the whole over the ranks, the rest is on each."""
    import torch.distributed as dist

    from labkit.config import RunConfig
    from labkit.models import make_model
    from labkit.strategies import tp

    t = m.shards("tp_dtensor", 2)
    params = t[t["kind"] == "parameters"]
    for r in (0, 1):
        with fake_rank(r, 2):
            torch.manual_seed(0)
            cfg = RunConfig(model="transformer", width=32, depth=1, heads=2)
            hand = tp.parallelize(make_model(cfg), dist.group.WORLD)
            by_hand = {name: tuple(p.shape) for name, p in hand.named_parameters()}
        mine = params[params["rank"] == r]
        assert dict(zip(mine["tensor"], mine["local_shape"])) == by_hand
    held = params.groupby("tensor")["held"].sum()
    total = params.groupby("tensor")["total"].first()
    split = params.groupby("tensor")["placement"].first().str.startswith("S")
    assert (held[split] == total[split]).all() and (held[~split] == 2 * total[~split]).all()
    placement = params.groupby("tensor")["placement"].first()
    assert placement["1.attn.qkv.weight"] == placement["1.mlp.fc1.weight"] == "S(0)"
    assert placement["1.attn.proj.weight"] == placement["1.mlp.fc2.weight"] == "S(1)"
    fig = pm.tensor_cut(t)
    assert len(fig.layout.shapes) == 4 * 2  # four weights, one slice per rank
    assert [a.text for a in fig.layout.annotations].count("<b>g</b>") == 2


def test_ddp_buckets_refuses_a_strategy_without_buckets_and_draws_each_bucket_in_its_lane():
    from labkit import RunConfig

    with pytest.raises(ValueError, match="grad_sync='buckets'"):
        m.ddp_buckets(RunConfig(strategy="ddp_naive", world_size=2))  # before anything runs
    import pandas as pd

    # two buckets in flight at once: the second takes a lane of its own
    rows = [
        (0, "compute", "forward", 0.0, 1.0, 0),
        (0, "compute", "backward", 1.0, 3.0, 0),
        (0, "all-reduce", "all_reduce", 1.5, 2.5, 2**20),
        (0, "all-reduce", "all_reduce", 2.0, 3.0, 2**10),
    ]
    columns = ["rank", "lane", "name", "start", "end", "bytes"]
    fig = pm.ddp_buckets(pd.DataFrame(rows, columns=columns))
    lanes = [t.y[0] for t in fig.data]
    assert lanes == ["rank 0", "rank 0", "rank 0 all-reduce", "rank 0 all-reduce (2)"]
    assert [t.text[0] for t in fig.data[2:]] == ["1.0 MiB", "1 KiB"]
    assert [t.base[0] for t in fig.data] == [0.0, 1e3, 1.5e3, 2e3]  # ms from the step's start
