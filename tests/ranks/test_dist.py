"""labkit.dist: process groups, rank-aware printing and reductions, on 2 real gloo ranks.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_dist.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from labkit import launch
from labkit.dist import (
    all_reduce_mean,
    gather_to_main,
    reduce_scalar,
    session,
    setup,
)
from tests.helpers import ranks

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


# ---- process groups -----------------------------------------------------------------------------


def test_seed_style_setup_and_cleanup_with_launch_setup_false():
    out = launch(ranks.seed_style, 2, timeout_s=60, device="cpu", setup=False)
    for rank, r in enumerate(out):
        before = r["before"]
        # no group yet: the rank itself calls setup(), from the torchrun-style environment
        assert before["backend"] is None and not before["distributed"]
        assert not before["initialized"]
        env = before["env"]
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert r["inner"] == {"rank": rank, "world_size": 2, "backend": "gloo", "sum": 3.0}
        assert r["cleaned"]
    assert out[0]["before"]["env"]["MASTER_PORT"] == out[1]["before"]["env"]["MASTER_PORT"]


def test_a_forgotten_cleanup_is_done_by_the_launcher(tmp_path):
    # the lesson's function sets up a group and never destroys it; each rank notes (in a file,
    # since the rank's process is gone afterwards) when destroy_process_group is really called
    def forgets_cleanup(ctx, folder):
        real = dist.destroy_process_group

        def noted(*args, **kwargs):
            open(f"{folder}/destroyed-{ctx.rank}", "w").close()
            return real(*args, **kwargs)

        dist.destroy_process_group = noted
        setup(ctx.rank, ctx.world_size)
        dist.barrier()
        return dist.is_initialized()

    got = launch(forgets_cleanup, 2, (str(tmp_path),), timeout_s=60, device="cpu", setup=False)
    assert got == [True, True]  # the group was still up when the function returned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["destroyed-0", "destroyed-1"]


def test_session_from_the_environment_always_destroys_the_group():
    def body(ctx):
        seen = {}
        try:
            with session(device="cpu", timeout_s=30) as inner:  # RANK etc. from the env
                seen = {
                    "rank": inner.rank,
                    "world_size": inner.world_size,
                    "backend": inner.backend,
                    "distributed": inner.distributed,
                }
                dist.barrier()
                raise RuntimeError("training failed inside the session")
        except RuntimeError as exc:
            seen["error"] = str(exc)
        seen["initialized_after"] = dist.is_initialized()
        return seen

    out = launch(body, 2, timeout_s=60, device="cpu", setup=False)
    for rank, r in enumerate(out):
        assert r == {
            "rank": rank,
            "world_size": 2,
            "backend": "gloo",
            "distributed": True,
            "error": "training failed inside the session",
            "initialized_after": False,
        }


# ---- rank-aware printing ------------------------------------------------------------------------


def test_print0_and_rprint_on_two_ranks():
    out = launch(ranks.printed, 2, timeout_s=60, device="cpu")
    assert out[0] == "from print0\n[rank 0/2] from rprint\n"
    assert out[1] == "[rank 1/2] from rprint\n"


# ---- reductions ---------------------------------------------------------------------------------


def test_reduce_scalar_sum_mean_max_min_over_two_ranks():
    out = launch(ranks.reductions, 2, timeout_s=60, device="cpu")
    assert out == [{"sum": 3.0, "mean": 1.5, "max": 2.0, "min": 1.0}] * 2


def test_reduce_scalar_rejects_an_unknown_op_on_a_rank():
    def bad_op(ctx):
        try:
            reduce_scalar(1.0, "median")
        except ValueError as exc:
            return str(exc)
        return "no error"

    out = launch(bad_op, 2, timeout_s=60, device="cpu")
    assert all("op must be one of sum, mean, max, min" in msg for msg in out), out


def test_all_reduce_mean_and_gather_to_main_on_two_ranks():
    def body(ctx):
        t = torch.full((3,), float(ctx.rank * 2))  # rank 0: 0s, rank 1: 2s
        all_reduce_mean(t)
        return t.tolist(), gather_to_main({"rank": ctx.rank, "pid": os.getpid()})

    out = launch(body, 2, timeout_s=60, device="cpu")
    assert [t for t, _ in out] == [[1.0, 1.0, 1.0]] * 2
    gathered, nothing = out[0][1], out[1][1]
    assert [g["rank"] for g in gathered] == [0, 1] and nothing is None
