"""The mixture-of-experts dispatch exercise (notebook 15) graded on real ranks: the blank is "not
written yet", the solution in solutions/ passes, and each catalogued wrong answer gets its own
message (rows not put back in place; dropped rows sent and computed; dropped rows sent, then
zeroed)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit import exercises
from tests.ranks.test_exercises import solution


def test_the_blank_is_not_written_yet_and_the_solution_passes():
    def my_moe_dispatch(x, expert, experts_here, num_experts):
        raise NotImplementedError("your dispatch and combine")

    blank = exercises.check("moe_dispatch", my_moe_dispatch)
    assert blank.passed is None and "NotImplementedError" in blank.message
    verdict = exercises.check("moe_dispatch", solution("moe_dispatch", "my_moe_dispatch"))
    assert verdict.passed is True, verdict.message
    for n in (2, 3):  # the counts (E int64), the kept rows out, the outputs back: no more
        for r in verdict.details[n]:
            assert r["payload"] == 6 * 8 + (r["kept"] + r["computed"]) * 4 * 8


def _dispatch(x, expert, experts_here, num_experts, *, keep_dropped=False, unpermute=True):
    """A learner's dispatch with one of two mistakes switched on."""
    n, per = dist.get_world_size(), num_experts // dist.get_world_size()
    sent_expert = expert.clamp(min=0) if keep_dropped else expert
    kept = torch.nonzero(sent_expert >= 0).flatten()
    order = kept[torch.argsort(sent_expert[kept], stable=True)]
    counts = torch.bincount(sent_expert[order], minlength=num_experts)
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts)
    arriving = arriving.view(n, per)
    send, recv = counts.view(n, per).sum(1).tolist(), arriving.sum(1).tolist()
    rows = x.new_empty(sum(recv), x.shape[1])
    dist.all_to_all_single(rows, x[order], recv, send)
    which = dist.get_rank() * per + torch.arange(per).repeat(n).repeat_interleave(
        arriving.flatten()
    )
    out = torch.empty_like(rows)
    for e, module in experts_here.items():
        out[which == e] = module(rows[which == e])
    back = x.new_empty(len(order), x.shape[1])
    dist.all_to_all_single(back, out, send, recv)
    y = torch.zeros_like(x)
    if unpermute:
        y[order] = back
    else:
        y[kept] = back  # the outputs in the order they were sent: sorted by expert
    return y


def test_each_common_wrong_dispatch_gets_its_message():
    def forgot_to_unpermute(x, expert, experts_here, num_experts):
        return _dispatch(x, expert, experts_here, num_experts, unpermute=False)

    def sent_dropped_rows(x, expert, experts_here, num_experts):  # counted the dropped tokens
        return _dispatch(x, expert, experts_here, num_experts, keep_dropped=True)

    def sent_dropped_rows_then_zeroed(x, expert, experts_here, num_experts):
        y = _dispatch(x, expert, experts_here, num_experts, keep_dropped=True)
        y[expert < 0] = 0
        return y

    cases = {
        forgot_to_unpermute: "Un-permute",
        sent_dropped_rows: "dropped rows (expert -1) came back non-zero",
        sent_dropped_rows_then_zeroed: "dropped rows\n(expert -1) travelled too".replace("\n", " "),
    }
    for fn, said in cases.items():
        verdict = exercises.check("moe_dispatch", fn)
        assert verdict.passed is False and said in verdict.message, (fn.__name__, verdict.message)
