"""Context parallelism by all-to-all (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509).

The sequence is split over N ranks as in ring attention (``cp.py``: the same embedding, MLP and
head on each rank's slice, the same gradient sum after backward); attention is done the other
way round. Heads are independent of each other, so instead of moving keys and values past every
query, one all-to-all regroups q, k and v from "my positions, every head" to "every position, my
H/N heads": each rank then runs ordinary (causal) attention over the whole sequence for its
heads, and one more all-to-all turns the output back into "my positions, every head". Backward is
the same all-to-alls in reverse: four per layer each way (q, k, v, out; then dO, dQ, dK, dV).

Each all-to-all keeps 1/N of its input and sends the rest: (N-1)/N of one b x s/N x h tensor per
rank. Four of them per layer forward is 4 (N-1)/N^2 of the sequence's b x s x h per rank, falling
as N grows, where the ring sends 2 (N-1)/N of it, which rises towards 2: Ulysses moves fewer
bytes, but N must divide the number of heads: every rank holds whole heads. The whole sequence
meets on every rank, so the causal work is even with either placement; zig-zag only reorders
the positions, put back in order before attention.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import RunConfig
from ..dist import RankContext
from ..factories import Factories
from .cp import positions, run_split


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x``'s dim 0 cut in N equal pieces, piece j sent to rank j; returns the pieces received,
    piece j from rank j (the ``ProcessGroup``'s own all-to-all: gloo's runs on CPU)."""
    x = x.contiguous()  # the collective reads and writes memory in order
    out = torch.empty_like(x)
    group.alltoall_base(out, x, [], [], dist.AllToAllOptions()).wait()
    return out


def _order(group, seq_len: int, layout: str) -> torch.Tensor:
    """The global position of each place in the gathered sequence (rank 0's slice first)."""
    n = group.size()
    return torch.cat([positions(r, n, seq_len, layout) for r in range(n)])


def seq_to_heads(x: torch.Tensor, group, order: torch.Tensor) -> torch.Tensor:
    """(batch, H, s/N, d) holding my positions -> (batch, H/N, s, d) holding my heads, the
    positions in order."""
    n = group.size()
    b, h, s_local, d = x.shape
    pieces = x.view(b, n, h // n, s_local, d).movedim(1, 0)  # piece j: rank j's heads
    got = all_to_all(pieces, group)  # piece j: my heads at rank j's positions
    gathered = got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s_local, d)
    return gathered[:, :, torch.argsort(order).to(x.device)]


def heads_to_seq(y: torch.Tensor, group, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: (batch, H/N, s, d) -> (batch, H, s/N, d)."""
    n = group.size()
    b, hn, s, d = y.shape
    pieces = y[:, :, order.to(y.device)].view(b, hn, n, s // n, d).movedim(2, 0)
    got = all_to_all(pieces, group)  # piece j: rank j's heads at my positions
    return got.permute(1, 0, 2, 3, 4).reshape(b, n * hn, s // n, d)


class SeqToHeads(torch.autograd.Function):
    """``seq_to_heads`` forward; its inverse all-to-all backward."""

    @staticmethod
    def forward(ctx, x, group, order):
        ctx.group, ctx.order = group, order
        return seq_to_heads(x, group, order)

    @staticmethod
    def backward(ctx, grad):
        return heads_to_seq(grad.contiguous(), ctx.group, ctx.order), None, None


class HeadsToSeq(torch.autograd.Function):
    """``heads_to_seq`` forward; its inverse all-to-all backward."""

    @staticmethod
    def forward(ctx, y, group, order):
        ctx.group, ctx.order = group, order
        return heads_to_seq(y, group, order)

    @staticmethod
    def backward(ctx, grad):
        return seq_to_heads(grad.contiguous(), ctx.group, ctx.order), None, None


def ulysses_attention(q, k, v, group, layout: str = "contiguous", causal: bool = True):
    """Attention of this rank's positions (q, k, v: batch, H, s/N, head_dim): all-to-all to
    H/N heads over the whole sequence, dense attention, all-to-all back."""
    n = group.size()
    if q.shape[1] % n:
        raise ValueError(
            f"{q.shape[1]} heads do not split over {n} ranks: Ulysses gives each rank whole "
            f"heads, pick a number of heads that is a multiple of {n}"
        )
    order = _order(group, q.shape[2] * n, layout)
    q, k, v = (SeqToHeads.apply(t, group, order) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return HeadsToSeq.apply(out, group, order)


def ulysses(group, layout: str, causal: bool = True) -> Callable:
    """``attend(q, k, v)`` for ``cp.SplitAttention``: all-to-all attention on ``group``."""
    return lambda q, k, v: ulysses_attention(q, k, v, group, layout, causal)


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    return run_split(cfg, ctx, fns, ulysses)
