"""Bytes counted where they travel (labkit.wire) against the formulas, strategy by strategy.

Each count comes from the process group's own hooks, which see the tensors every collective is
handed; each expected value comes from the model's parameters (counted here, apart) and the
ring formulas. A hook that was not installed, a ``no_sync`` that did not hold, or a strategy
that sent something else would change the count, not the formula.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_wire.py."""

from __future__ import annotations

from types import SimpleNamespace

from labkit.wire import HookOpName, sent


def test_sent_follows_the_ring_algorithms():
    def args(name, payload_out=0, root=0):
        return SimpleNamespace(name=name, root=root, output_tensors=_bytes(payload_out))

    assert sent(args(HookOpName.ALLREDUCE), 1000, 4, 0) == 1500  # 2(n-1)/n
    assert sent(args(HookOpName.REDUCE_SCATTER), 1000, 4, 0) == 750  # (n-1)/n of the input
    assert sent(args(HookOpName.ALLGATHER, payload_out=4000), 1000, 4, 0) == 3000  # of the output
    # a broadcast chain from root 2 on 4 ranks: 2 -> 3 -> 0 -> 1, rank 1 forwards nothing
    assert [sent(args(HookOpName.BROADCAST, root=2), 100, 4, r) for r in range(4)] == [
        100, 0, 100, 100
    ]  # fmt: skip
    assert sent(args(HookOpName.SEND), 100, 4, 0) == 100
    assert sent(args(HookOpName.RECV), 100, 4, 0) == 0
    assert sent(args(HookOpName.ALLREDUCE), 1000, 1, 0) == 0  # alone: nothing leaves the rank


def _bytes(n: int):
    class Tensor:
        def numel(self):
            return n

        def element_size(self):
            return 1

    return [Tensor()] if n else []


def test_a_loop_in_a_process_without_a_group_trains_and_counts_nothing():
    """labkit.dist.local_context: rank 0 of 1 without a process group (the notebook's own
    process); there is no group to watch, so the loop trains and the byte columns say 0."""
    from labkit.config import RunConfig
    from labkit.dist import local_context
    from labkit.strategies import run_rank

    cfg = RunConfig(strategy="single", world_size=1, steps=2, warmup=0, width=16, depth=1)
    records = run_rank(local_context("cpu"), cfg)["records"]
    assert len(records) == 2 and all(r["comm_calls"] == 0 for r in records)
