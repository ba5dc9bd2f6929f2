"""labkit.dist without a process group: what set-up needs and refuses, printing and reductions.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_dist.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

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

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")


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


def test_reductions_are_identities_without_a_group():
    assert reduce_scalar(2.5, "sum") == 2.5
    t = torch.tensor([1.0, 3.0])
    assert all_reduce_mean(t) is t and t.tolist() == [1.0, 3.0]
    assert gather_to_main({"a": 1}) == [{"a": 1}]


def test_cleanup_is_safe_without_a_group():
    cleanup()
    cleanup()
    assert not dist.is_initialized()
