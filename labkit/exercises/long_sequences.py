"""Lesson 14 (long sequences): ring attention's step, the online-softmax merge."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..launch import launch
from ._core import Verdict, exercise

NAME = "ring_attention_step"


def _reference(out, lse, block_out, block_lse):
    from ..strategies.cp import combine

    return combine(out, lse, block_out, block_lse)


def _cases() -> list[tuple]:
    """Running results and blocks to merge: log-sum-exps that differ (which block weighs
    more), and large ones (exp of them overflows)."""
    g = torch.Generator().manual_seed(0)
    shape = (2, 3, 5, 4)  # batch, heads, queries, head_dim
    out, block = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))
    lse = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    block_lse = lse + 2 * torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    return [(out, lse, block, block_lse), (out, lse + 1000.0, block, block_lse + 1000.0)]


def _close(a, b) -> bool:
    return torch.is_tensor(a) and a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-9)


def _wrong(fn: Callable) -> str | None:
    """The learner's words for what is wrong with ``fn`` on the crafted cases, None if right."""
    for i, (out, lse, block, block_lse) in enumerate(_cases()):
        got = fn(out.clone(), lse.clone(), block.clone(), block_lse.clone())
        if not (isinstance(got, tuple) and len(got) == 2):
            return (
                "Return two things, the merged output and the merged log-sum-exp: "
                "`return new_out, new_lse` (the next block is merged into both)."
            )
        got_out, got_lse = got
        want_out, want_lse = _reference(out, lse, block, block_lse)
        if _close(got_out, want_out) and _close(got_lse, want_lse):
            continue
        if i == 1 and not (torch.isfinite(got_out).all() and torch.isfinite(got_lse).all()):
            return (
                "Right for small scores, but with log-sum-exps near 1000 your merge returned "
                "inf or nan: exp(1000) overflows. Never exponentiate a log-sum-exp alone: "
                "new_lse = torch.logaddexp(lse, block_lse), and the weights exp(lse - new_lse) "
                "and exp(block_lse - new_lse) are at most 1."
            )
        if _close(got_out, out + block):
            return (
                "You added the two outputs. Each is already an average over its own keys (its "
                "softmax weights sum to 1), so the sum's weights sum to 2. Weight each by its "
                "block's share of the whole softmax: exp(lse - new_lse) and "
                "exp(block_lse - new_lse)."
            )
        if _close(got_out, (out + block) / 2):
            return (
                "You averaged the two outputs with equal weights: right only when both blocks "
                "have the same log-sum-exp. The block whose keys scored higher must weigh more: "
                "exp(lse - new_lse) for the running output, exp(block_lse - new_lse) for the "
                "block's."
            )
        if _close(got_lse, torch.maximum(lse, block_lse)):
            return (
                "Your log-sum-exp is the larger of the two, which forgets the other block's keys. "
                "Both blocks' keys are in the softmax's denominator: new_lse = log(exp(lse) + "
                "exp(block_lse)), torch.logaddexp(lse, block_lse)."
            )
        new = torch.logaddexp(lse, block_lse)
        if _close(got_out, out + torch.exp(block_lse - new).unsqueeze(-1) * block):
            return (
                "The running output was not rescaled. Its weights were normalised over the keys "
                "seen so far; with the new block's keys in the denominator they shrink by "
                "exp(lse - new_lse): multiply it by that before adding the block's share."
            )
        if _close(got_out, want_out):
            return (
                "The output is right, but the log-sum-exp you return is not log(exp(lse) + "
                "exp(block_lse)): the next block is merged with it, so it must be the new one."
            )
        return (
            f"The merged output differs from softmax over both blocks' keys by up to "
            f"{float((got_out - want_out).abs().max()):.3g}. new_lse = logaddexp(lse, "
            f"block_lse); new_out = exp(lse - new_lse) * out + exp(block_lse - new_lse) * "
            f"block_out (the weights need a last dimension: .unsqueeze(-1))."
        )
    return None


def _ring_rank(ctx, fn) -> dict:
    """The ring attention of ``labkit.strategies.cp`` with the learner's merge, forward and
    backward, against dense attention on the whole sequence (float64)."""
    import torch.distributed as dist

    from ..strategies.cp import positions, ring_attention

    n, r = ctx.world_size, ctx.rank
    seq = 8 * n
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 2, seq, 4, generator=g, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    dense = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True)
    dense.backward(dout)
    pos = positions(r, n, seq, "zigzag")
    mine = [t[:, :, pos].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, dist.group.WORLD, "zigzag", True, None, fn)
    out.backward(dout[:, :, pos])
    got = [out.detach()] + [t.grad for t in mine]
    want = [dense.detach()] + [t.grad for t in whole]
    return {"diff": max(float((a - b[:, :, pos]).abs().max()) for a, b in zip(got, want))}


@exercise(
    NAME,
    lesson="14",
    what="ring attention's step: a block's partial result merged by log-sum-exp",
    solution="my_combine",
)
def grade_ring_attention_step(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(out, lse, block_out, block_lse) -> (out, lse)``: the online softmax's merge of a
    block's attention (its output over its keys and their log-sum-exp, one per query) with the
    running one. Graded on crafted blocks against the merge the ring uses (each common wrong
    answer named), then inside ring attention on 2 and 3 real ranks (zig-zag, causal):
    forward and backward against dense attention on the whole sequence."""
    try:
        wrong = _wrong(fn)
    except NotImplementedError:
        return Verdict(
            NAME,
            None,
            "Fill in the function's body (it still raises NotImplementedError), then run this "
            "cell again.",
        )
    except Exception as exc:  # the learner's code raised: say what, and the likely why
        said = f"Your function raised {type(exc).__name__}: {str(exc).splitlines()[0]}."
        if "must match the size" in str(exc):
            said += (
                " The weights exp(lse - new_lse) have one number per query, the outputs one "
                "vector per query: give the weights a last dimension, .unsqueeze(-1)."
            )
        return Verdict(NAME, False, said)
    if wrong:
        return Verdict(NAME, False, wrong)
    details = {}
    for n in (2, 3):
        ranks = launch(_ring_rank, n, args=(fn,), device="cpu", timeout_s=timeout_s)
        details[n] = ranks
        worst = max(res["diff"] for res in ranks)
        if worst > 1e-9:
            return Verdict(
                NAME,
                False,
                f"Your merge is right on the test blocks, but inside the ring on {n} ranks the "
                f"attention differs from dense attention by {worst:.3g}: does it change its "
                f"arguments in place, or depend on their shapes?",
                details,
            )
    return Verdict(
        NAME,
        True,
        "Your merge gives softmax over both blocks' keys, stays finite at large scores, and "
        "inside ring attention on 2 and 3 ranks (zig-zag, causal) the output and dQ, dK, dV "
        "equal dense attention's.",
        details,
    )
