"""Context parallelism: the sequence split across ranks, attention computed as a ring.

A transformer's activations grow with the sequence length s, and attention's scores with s^2
(Korthikanti et al. 2022's 5*a*s/h term, ``labkit.predict.memory.layer_activations``). Splitting
the *sequence* over N ranks divides every activation by N: the embedding, the LayerNorms, the
MLP and the head are per token, so each rank runs them on its own slice of positions, holding
the whole model (like data parallelism, its gradients are summed over the group after
backward). Only attention mixes tokens: a query needs every key and value before it.

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889):
each rank keeps its queries; the keys and values travel round a ring of ranks, one block per
step, sent to the right neighbour while the block received from the left is being used. After
N steps every query has met every key. Softmax is not a sum, but the online softmax of Milakov &
Gimelshein 2018 (arXiv:1805.02867, as in FlashAttention, Dao et al. 2022, arXiv:2205.14135)
makes it one: a block's partial output ``o_b`` (softmax over that block's keys) and its
log-sum-exp ``l_b`` combine with the running ``(o, l)`` as

    l' = log(exp(l) + exp(l_b)),    o' = exp(l - l') * o + exp(l_b - l') * o_b

(``combine``), exactly softmax over all keys seen so far. Causal masking across blocks: a key
block entirely after a query block is skipped, the diagonal one masked inside, the rest computed
whole. Backward recomputes each block's probabilities from the saved log-sum-exp and sends the
keys and values round the ring again, each block's gradient dK, dV travelling with it, added to
by every rank it visits, and arriving home after N - 1 hops (``RingAttention.backward``; picotron
and zhuzilin/ring-flash-attention do the same).

With the sequence cut in N contiguous slices, causal work is uneven: rank 0's queries see only
their own keys, rank N-1's see everyone's. Zig-zag placement (the Llama 3 paper, Dubey et al.
2024, arXiv:2407.21783, section 3.3.2) cuts it in 2N chunks and gives rank r chunks r and
2N-1-r: an early and a late one, the same work on every rank (``schedule`` says which blocks
each rank computes at each step, the pictures and the counts read it).

Every message is a point-to-point send/receive on the process group passed in (the
``ProcessGroup``'s own ``send``/``recv``, what ``dist.isend``/``dist.irecv`` call, so the same
code runs between processes and between the thread ranks of ``labkit.dist.on_threads``), so
``labkit.wire`` counts it. ``cp_ulysses.py`` is the all-to-all alternative.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..config import RunConfig
from ..dist import RankContext, all_reduce_flat
from ..factories import Factories
from ..models import Block, Embed, Head
from ..rank.loop import build_model, train_loop
from .tp import same_batches

FULL, DIAGONAL, SKIPPED = "full", "diagonal", "skipped"
KV, DKV = 0, 1  # message tags: keys/values, and their gradients, may be in flight together


# ---- where each position lives ------------------------------------------------------------------


def chunk_ids(rank: int, n: int, layout: str) -> tuple[int, ...]:
    """The chunks of the sequence ``rank`` holds, in its local order: ``contiguous``, chunk
    ``rank`` of N; ``zigzag``, chunks ``rank`` and ``2N - 1 - rank`` of 2N."""
    if layout == "zigzag":
        return (rank, 2 * n - 1 - rank)
    if layout == "contiguous":
        return (rank,)
    raise ValueError(f"unknown layout {layout!r}: choose 'contiguous' or 'zigzag'")


def chunk_len(n: int, seq_len: int, layout: str) -> int:
    """Positions per chunk: s / N (contiguous) or s / 2N (zig-zag)."""
    pieces = n * len(chunk_ids(0, n, layout))
    if seq_len % pieces:
        raise ValueError(
            f"sequence length {seq_len} does not split into {pieces} equal chunks ({layout} "
            f"placement on {n} ranks): pick a sequence length that is a multiple of {pieces}"
        )
    return seq_len // pieces


def positions(rank: int, n: int, seq_len: int, layout: str) -> torch.Tensor:
    """The global positions ``rank`` holds, in its local order."""
    c = chunk_len(n, seq_len, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, n, layout)])


def last_position_owner(n: int, seq_len: int, layout: str) -> int:
    """The rank holding position s - 1, the one the head reads (N - 1 contiguous, 0 zig-zag)."""
    return next(r for r in range(n) if int(positions(r, n, seq_len, layout)[-1]) == seq_len - 1)


# ---- the schedule: which query block meets which key block, at which step -----------------------


@dataclass(frozen=True)
class Tile:
    """One query chunk against one key chunk: ``q`` and ``k`` are indices into the rank's own
    chunks and the visiting ones (0 or 1), ``q_chunk``/``k_chunk`` the chunks' global indices;
    ``kind`` FULL (every key before every query), DIAGONAL (the same chunk: masked inside),
    SKIPPED (every key after every query: nothing to compute)."""

    q: int
    k: int
    q_chunk: int
    k_chunk: int
    kind: str


@dataclass(frozen=True)
class Step:
    """Step ``step`` of the ring on one rank: it holds the keys and values of ``kv_from``."""

    step: int
    kv_from: int
    tiles: tuple[Tile, ...]


def tiles(q_chunks, k_chunks, causal: bool = True) -> tuple[Tile, ...]:
    """Every (query chunk, key chunk) pair, and what causal masking leaves of it."""
    out = []
    for qi, qc in enumerate(q_chunks):
        for ki, kc in enumerate(k_chunks):
            kind = FULL if not causal or kc < qc else DIAGONAL if kc == qc else SKIPPED
            out.append(Tile(qi, ki, qc, kc, kind))
    return tuple(out)


def schedule(rank: int, n: int, layout: str, causal: bool = True) -> list[Step]:
    """What ``rank`` computes at each of the ring's N steps: at step s it holds the keys and
    values of rank (rank - s) mod N (its own at step 0). The forward, the backward, the work
    counts and the pictures all read this one list."""
    mine = chunk_ids(rank, n, layout)
    return [
        Step(s, (rank - s) % n, tiles(mine, chunk_ids((rank - s) % n, n, layout), causal))
        for s in range(n)
    ]


@dataclass
class AttentionWork:
    """What one rank's attention computed (added to by ``RingAttention``): tiles by kind,
    multiply-add FLOPs forward and backward (a computed tile costs its whole c x c block: the
    diagonal one is computed, then masked, as a fused kernel does), and seconds spent computing
    (communication waits excluded)."""

    tiles: dict = field(default_factory=lambda: dict.fromkeys((FULL, DIAGONAL, SKIPPED), 0))
    flops_forward: float = 0.0
    flops_backward: float = 0.0
    compute_s: float = 0.0


# ---- one block, forward and backward ------------------------------------------------------------


def combine(out, lse, block_out, block_lse):
    """The online softmax's merge: the running output ``out`` (softmax over the keys seen so
    far) and its log-sum-exp ``lse`` (one per query), with a new block's ``block_out`` and
    ``block_lse``; returns the output and log-sum-exp over both sets of keys. ``lse`` and
    ``block_lse`` have ``out``'s shape without its last dimension."""
    new = torch.logaddexp(lse, block_lse)
    return (
        torch.exp(lse - new).unsqueeze(-1) * out
        + torch.exp(block_lse - new).unsqueeze(-1) * block_out,
        new,
    )


@functools.cache
def _above_diagonal(c: int, device: torch.device) -> torch.Tensor:
    """The c x c mask of the keys after each query (one per size: every layer reuses it)."""
    return torch.ones(c, c, dtype=torch.bool, device=device).triu(1)


def _scores(q, k, scale: float, diagonal: bool):
    s = (q * scale) @ k.transpose(-2, -1)
    if diagonal:  # the same chunk: a query sees keys up to its own position
        s.masked_fill_(_above_diagonal(s.shape[-1], s.device), float("-inf"))
    return s


def block_forward(q, k, v, scale: float, diagonal: bool):
    """Softmax attention of queries ``q`` over one block of keys: its output and log-sum-exp
    (the softmax's normaliser, ``log sum_j exp(s_j)``, kept per query)."""
    s = _scores(q, k, scale, diagonal)
    top = s.amax(dim=-1, keepdim=True)  # subtracted before exp: no overflow
    p = s.sub_(top).exp_()  # in place: the scores are not needed again
    total = p.sum(dim=-1, keepdim=True)
    return (p @ v).div_(total), (top + total.log()).squeeze(-1)


def block_backward(q, k, v, dout, lse, delta, scale: float, diagonal: bool):
    """Gradients of one block from the saved log-sum-exp (the probabilities recomputed, as
    FlashAttention's backward does): dQ's share from this block, dK and dV of this block.
    ``delta`` = rowsum(dO * O), the softmax's backward term."""
    p = _scores(q, k, scale, diagonal).sub_(lse.unsqueeze(-1)).exp_()
    dv = p.transpose(-2, -1) @ dout
    ds = p.mul_((dout @ v.transpose(-2, -1)).sub_(delta.unsqueeze(-1)))  # dS = P * (dP - delta)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv


# ---- the ring -----------------------------------------------------------------------------------


def _pass_right(group, out: torch.Tensor, tag: int):
    """Send ``out`` to the right neighbour and receive the same shape from the left, both posted
    before either is waited on (every rank does the same: nothing waits on a peer that waits).
    Returns the buffer being received, the pending send and the pending receive."""
    n, r = group.size(), group.rank()
    into = torch.empty_like(out)
    sending = group.send([out], (r + 1) % n, tag)
    return into, [sending], [group.recv([into], (r - 1) % n, tag)]


def _wait(works) -> None:
    for w in works:
        w.wait()


def _rows(i: int, c: int) -> slice:
    return slice(i * c, (i + 1) * c)


class RingAttention(torch.autograd.Function):
    """``softmax(q k^T / sqrt(d)) v`` with q, k, v of shape (batch, heads, local positions,
    head_dim) holding this rank's chunks (``chunk_ids``); see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout, causal, work, merge=combine):
        n = group.size()
        steps = schedule(group.rank(), n, layout, causal)
        c = q.shape[2] // len(chunk_ids(0, n, layout))  # positions per chunk
        scale = q.shape[-1] ** -0.5
        outs: list = [None] * (q.shape[2] // c)  # per query chunk: (output, log-sum-exp)
        kv = torch.stack((k, v)).contiguous()
        for step in steps:
            last = step.step == n - 1
            nxt, *pending = (None, [], []) if last else _pass_right(group, kv, KV)
            t0 = time.perf_counter()
            for t in step.tiles:
                if work is not None:
                    work.tiles[t.kind] += 1
                if t.kind == SKIPPED:
                    continue
                rows, cols = _rows(t.q, c), _rows(t.k, c)
                o, lse = block_forward(
                    q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], scale, t.kind == DIAGONAL
                )
                outs[t.q] = (o, lse) if outs[t.q] is None else merge(*outs[t.q], o, lse)
                if work is not None:
                    work.flops_forward += 4 * q[:, :, rows].numel() * c
            if work is not None:
                work.compute_s += time.perf_counter() - t0
            _wait(pending[0] + pending[1])
            kv = nxt
        # laid out (batch, positions, heads, head_dim) in memory, as torch's attention returns
        # it: the output projection's input is then a view of it, not a second saved copy
        out = torch.cat([o for o, _ in outs], dim=2).transpose(1, 2).contiguous().transpose(1, 2)
        lse = torch.cat([s for _, s in outs], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.steps, ctx.c, ctx.scale, ctx.work = group, steps, c, scale, work
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, steps, c, scale, work = ctx.group, ctx.steps, ctx.c, ctx.scale, ctx.work
        n = group.size()
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack((k, v)).contiguous()
        own = arriving = None  # this rank's dK, dV; the accumulator on its way here
        received: list = []
        sending: list = []
        for step in steps:
            last = step.step == n - 1
            nxt, *pending = (None, [], []) if last else _pass_right(group, kv, KV)
            t0 = time.perf_counter()
            dkv = torch.zeros_like(kv)  # what this rank's queries add to the visiting dK, dV
            for t in step.tiles:
                if t.kind == SKIPPED:
                    continue
                rows, cols = _rows(t.q, c), _rows(t.k, c)
                dq_t, dk_t, dv_t = block_backward(
                    q[:, :, rows],
                    kv[0][:, :, cols],
                    kv[1][:, :, cols],
                    dout[:, :, rows],
                    lse[:, :, rows],
                    delta[:, :, rows],
                    scale,
                    t.kind == DIAGONAL,
                )
                dq[:, :, rows] += dq_t
                dkv[0][:, :, cols] += dk_t
                dkv[1][:, :, cols] += dv_t
                if work is not None:
                    work.flops_backward += 10 * q[:, :, rows].numel() * c
            if work is not None:
                work.compute_s += time.perf_counter() - t0
            if step.step == 0:
                own = dkv  # this rank's own block: it stays until the others' shares come home
            else:  # the visiting block's accumulator: add to it, pass it on towards its owner
                if arriving is not None:  # what the ranks before this one added to it
                    _wait(received)
                    dkv += arriving
                _wait(sending)
                # sent right; from the left comes the accumulator of the next step's block
                arriving, sending, received = _pass_right(group, dkv, DKV)
                in_flight = dkv  # kept alive until its send completes  # noqa: F841
            _wait(pending[0] + pending[1])
            kv = nxt
        if arriving is not None:  # every other rank's share of this rank's own dK, dV
            _wait(received)
            own = own + arriving
        _wait(sending)
        return dq, own[0], own[1], None, None, None, None, None


def ring_attention(
    q, k, v, group, layout: str = "zigzag", causal: bool = True, work=None, merge=combine
):
    """Attention of this rank's queries over the whole sequence, keys and values passed round
    ``group``'s ring (``RingAttention``); ``work``: an ``AttentionWork`` to count into;
    ``merge``: the online-softmax merge (``combine``; the graded exercise plugs its own in)."""
    return RingAttention.apply(q, k, v, group, layout, causal, work, merge)


# ---- the model with its sequence split ----------------------------------------------------------


class SliceEmbed(nn.Module):
    """The dense ``Embed``'s own parameters (same names), applied to this rank's positions
    only: each position's features projected, plus the learned embedding of *its* position."""

    def __init__(self, dense: Embed, positions: torch.Tensor):
        super().__init__()
        self.proj, self.pos = dense.proj, dense.pos
        self.positions = positions  # a plain attribute, not a buffer: the state's names stay

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, in): the whole sample
        idx = self.positions.to(x.device)
        return self.proj(x[:, idx]) + self.pos[idx]


class SplitAttention(nn.Module):
    """The dense ``SelfAttention``'s ``qkv`` and ``proj`` (same names) on this rank's positions,
    with ``attend(q, k, v)`` (ring or all-to-all) in place of the dense softmax."""

    def __init__(self, dense: nn.Module, attend: Callable):
        super().__init__()
        self.head_dim, self.qkv, self.proj = dense.head_dim, dense.qkv, dense.proj
        self.attend = attend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]
        q, k, v = qkv.view(b, s, -1, 3, self.head_dim).transpose(1, 2).unbind(3)
        out = self.attend(q.contiguous(), k.contiguous(), v.contiguous())
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class LastPosition(torch.autograd.Function):
    """The hidden state of position s - 1, broadcast from the rank holding it, so that every
    rank computes the head and the loss on the same numbers (one loss for the batch).
    Backward: every rank holds the same, whole, gradient of it; only the owner passes it on
    (summing them would count it N times), the others' slices receive nothing."""

    @staticmethod
    def forward(ctx, x, group, owner):
        ctx.group, ctx.owner, ctx.shape = group, owner, x.shape
        last = x[:, -1:].contiguous() if group.rank() == owner else x.new_empty(x[:, -1:].shape)
        opts = dist.BroadcastOptions()
        opts.rootRank = owner
        group.broadcast([last], opts).wait()
        return last

    @staticmethod
    def backward(ctx, grad):
        dx = grad.new_zeros(ctx.shape)
        if ctx.group.rank() == ctx.owner:
            dx[:, -1:] = grad
        return dx, None, None


class FromLastPosition(nn.Module):
    """``LastPosition`` as a module: what fills the head's ``from_shard`` seam."""

    def __init__(self, group, owner: int):
        super().__init__()
        self.group, self.owner = group, owner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LastPosition.apply(x, self.group, self.owner)


def parallelize(
    model: nn.Module, group, layout: str, attend: Callable, seq_len: int | None = None
) -> nn.Module:
    """Split labkit's transformer along the sequence over ``group``, in place: the embedding
    on this rank's positions, each block's attention through ``attend``, the head fed the last
    position from its owner. Parameter names stay the dense model's."""
    embeds = [m for m in model.modules() if isinstance(m, Embed)]
    if not embeds or not any(isinstance(m, Block) for m in model.modules()):
        raise ValueError(
            "context parallelism splits labkit's transformer along its sequence: use "
            "model='transformer'"
        )
    n, r = group.size(), group.rank()
    seq_len = seq_len or embeds[0].pos.shape[0]
    mine = positions(r, n, seq_len, layout)
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if isinstance(child, Embed):
                setattr(parent, name, SliceEmbed(child, mine))
            elif isinstance(child, Block):
                child.attn = SplitAttention(child.attn, attend)
            elif isinstance(child, Head):
                child.from_shard = FromLastPosition(group, last_position_owner(n, seq_len, layout))
    return model


def allreduce_partial_grads(model: nn.Module, group) -> None:
    """After backward: every parameter but the head's saw only this rank's positions, so its
    gradient is a partial sum: add them up over the group, in one message. The head computed
    on the same broadcast numbers everywhere: its gradient is already whole."""
    head = {id(p) for m in model.modules() if isinstance(m, Head) for p in m.parameters()}
    grads = [p.grad for p in model.parameters() if id(p) not in head and p.grad is not None]
    if grads and group.size() > 1:
        all_reduce_flat(grads, group)


# ---- the strategy -------------------------------------------------------------------------------


def cp_group(cfg: RunConfig, ctx: RankContext):
    """The ranks that split the sequence: here, all of them (``dp_cp`` runs several groups)."""
    return dist.new_group(list(range(ctx.world_size)))


def ring(group, layout: str, causal: bool = True, work: AttentionWork | None = None) -> Callable:
    """``attend(q, k, v)`` for ``SplitAttention``: ring attention on ``group``."""
    return lambda q, k, v: ring_attention(q, k, v, group, layout, causal, work)


def run_split(cfg: RunConfig, ctx: RankContext, fns: Factories, attention: Callable) -> dict:
    """A context-parallel run: ``attention(group, layout)`` builds the attention (ring or
    all-to-all); every rank trains the same global batch, its slice of the sequence."""
    group = cp_group(cfg, ctx)
    model = build_model(cfg, ctx, fns)
    model = parallelize(model, group, cfg.cp_layout, attention(group, cfg.cp_layout), cfg.seq_len)
    data = same_batches(cfg, fns)

    def sync_grads() -> None:
        allreduce_partial_grads(model, group)

    return train_loop(cfg, ctx, model, data, fns=fns, sync_grads=sync_grads)


def run(cfg: RunConfig, ctx: RankContext, fns: Factories) -> dict:
    return run_split(cfg, ctx, fns, ring)
