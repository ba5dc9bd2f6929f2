"""labkit.dist: process groups, rank-aware printing and reductions, on 2 real gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from labkit import launch
from labkit.dist import (
    RankContext,
    all_reduce_mean,
    cleanup,
    gather_to_main,
    local_context,
    print0,
    reduce_scalar,
    rprint,
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


def test_session_without_rank_or_environment_says_what_it_needs(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs rank and world_size, or a torchrun environment"):
        with session():
            pass


def test_setup_without_a_port_says_where_to_get_one(monkeypatch):
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ValueError, match=r"no MASTER_PORT: pass master_port="):
        setup(0, 1)
    assert not dist.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal of nccl")
def test_nccl_on_cpu_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")  # never reached: refused first
    with pytest.raises(ValueError, match="on CPU ranks use backend='gloo'"):
        setup(0, 1, backend="nccl")
    assert not dist.is_initialized()


def test_local_context_is_rank_0_of_1_without_a_group():
    ctx = local_context(device="cpu")
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.backend) == (0, 0, 1, None)
    assert ctx.device == torch.device("cpu") and ctx.is_main and not ctx.distributed
    ctx.report(step=1)  # the default report is a harmless no-op
    with pytest.raises(AttributeError):  # frozen: a rank cannot change who it is
        ctx.rank = 1
    assert isinstance(ctx, RankContext)


# ---- rank-aware printing ------------------------------------------------------------------------


def test_print0_and_rprint_on_two_ranks():
    out = launch(ranks.printed, 2, timeout_s=60, device="cpu")
    assert out[0] == "from print0\n[rank 0/2] from rprint\n"
    assert out[1] == "[rank 1/2] from rprint\n"


def test_print0_and_rprint_outside_a_group_follow_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    print0("alone")
    rprint("alone")
    assert capsys.readouterr().out == "alone\n[rank 0/1] alone\n"
    monkeypatch.setenv("RANK", "1")  # e.g. torchrun rank 1 before init
    monkeypatch.setenv("WORLD_SIZE", "2")
    print0("hidden")
    rprint("shown")
    assert capsys.readouterr().out == "[rank 1/2] shown\n"


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


def test_reductions_are_identities_without_a_group():
    assert reduce_scalar(2.5, "sum") == 2.5
    t = torch.tensor([1.0, 3.0])
    assert all_reduce_mean(t) is t and t.tolist() == [1.0, 3.0]
    assert gather_to_main({"a": 1}) == [{"a": 1}]


def test_all_reduce_mean_and_gather_to_main_on_two_ranks():
    def body(ctx):
        t = torch.full((3,), float(ctx.rank * 2))  # rank 0: 0s, rank 1: 2s
        all_reduce_mean(t)
        return t.tolist(), gather_to_main({"rank": ctx.rank, "pid": os.getpid()})

    out = launch(body, 2, timeout_s=60, device="cpu")
    assert [t for t, _ in out] == [[1.0, 1.0, 1.0]] * 2
    gathered, nothing = out[0][1], out[1][1]
    assert [g["rank"] for g in gathered] == [0, 1] and nothing is None


def test_cleanup_is_safe_without_a_group():
    cleanup()
    cleanup()
    assert not dist.is_initialized()
