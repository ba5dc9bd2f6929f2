"""What crosses the wire, counted where it travels: hooks on the process group itself.

A ``ProcessGroup`` (torch 2.14) calls its pre-hooks with the tensors every collective is handed,
and its post-hooks with the work it issued. labkit registers one of each on every group its
ranks use (``watch``), so DDP's C++ reducer, FSDP, ZeRO, DTensor's functional collectives,
hand-written ``dist.all_reduce`` calls and point-to-point messages are all counted the same
way, below every strategy: no strategy carries counting code, and a compression hook that was
never installed cannot be counted as if it were.

Two quantities per operation:

* ``payload``: bytes of the tensors handed to it (an all-reduce's buffer, an all-gather's input
  shard, a reduce-scatter's input, a message sent; 0 for a message received);
* ``sent``: bytes this rank puts on the wire for it under the ring algorithms: the ``b``
  coefficient of the alpha-beta model the predictor uses (``labkit.predict.collectives``, the
  convention of nccl-tests' bus bandwidth) times the message size. An all-reduce of S bytes on
  n ranks sends 2(n-1)/n x S per rank, a reduce-scatter of S bytes (n-1)/n x S, an all-gather
  whose output is S bytes (n-1)/n x S, a broadcast S, a send its message. On one rank, 0.

``traffic()`` is this process's running tally; the training loop reads it once per step
(``Traffic.take``). With ``timing`` on, each collective's interval in flight (issued to
completed, read from its future on the ``perf_counter`` clock every record uses) is kept too.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .predict.collectives import coefficients

try:  # the process-group hooks of torch 2.14; an older torch trains, and counts nothing (NaN)
    from torch._C._distributed_c10d import HookOpName
except ImportError:
    HookOpName = None
COUNTING = HookOpName is not None and hasattr(dist.ProcessGroup, "register_pre_hook")
WHY_NOT = "" if COUNTING else f"torch {torch.__version__} has no process-group hooks (2.14 has)"

# the alpha-beta model's name for each operation (a reduce to one root, a gather, a scatter and
# an all-to-all cost one message per peer: modelled as point to point)
_OPS = (
    {
        HookOpName.ALLREDUCE: "all_reduce",
        HookOpName.ALLGATHER: "all_gather",
        HookOpName.REDUCE_SCATTER: "reduce_scatter",
        HookOpName.BROADCAST: "broadcast",
        HookOpName.REDUCE: "broadcast",
        HookOpName.SEND: "p2p",
        HookOpName.RECV: "p2p",
        HookOpName.GATHER: "p2p",
        HookOpName.SCATTER: "p2p",
        HookOpName.ALLTOALL: "p2p",
    }
    if COUNTING
    else {}
)
HOOK_ID = 0x1AB  # one id per group: watching a group twice replaces, never doubles


@dataclass
class Traffic:
    """Operations, payload and bytes sent since the last ``take()``; with ``timing`` on, the
    interval each collective was in flight."""

    calls: int = 0
    payload: int = 0
    sent: float = 0.0
    untimed: int = 0  # operations whose interval in flight is unknown (gloo's point to point)
    pending: int = 0  # timed operations whose completion callback has not run yet
    timing: bool = False
    spans: list[tuple[str, float, float, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _settled: threading.Event = field(default_factory=threading.Event, repr=False)

    def add(self, op: str, payload: int, sent: float) -> None:
        with self._lock:  # the autograd thread (DDP's reducer) issues collectives too
            self.calls += 1
            self.payload += payload
            self.sent += sent

    def span(self, op: str, start: float, end: float, payload: int) -> None:
        with self._lock:  # completion callbacks run on the backend's threads
            self.spans.append((op, start, end, payload))
            self.pending = max(0, self.pending - 1)
            if not self.pending:
                self._settled.set()

    def take(self, settle_s: float = 0.05) -> dict:
        """What happened since the last call, then count afresh: ``comm_calls``,
        ``comm_payload_bytes``, ``comm_bytes`` (sent, ring convention), ``comm_in_flight_s``
        (seconds during which any timed collective was in flight: the union of their
        intervals), ``comm_untimed`` (operations that were not timed) and the intervals
        themselves (``spans``: op, start, end, payload). A collective that completed (DDP
        waits for its buckets before backward returns) may still have its completion callback
        queued on the backend's thread: wait up to ``settle_s`` for those."""
        if self.pending:  # released the moment the last callback runs (no polling)
            self._settled.wait(settle_s)
        with self._lock:
            spans, self.spans, self.pending = (
                self.spans,
                [],
                0,
            )  # a lost callback: not waited on again
            out = {
                "comm_calls": self.calls,
                "comm_payload_bytes": self.payload,
                "comm_bytes": int(round(self.sent)),
                "comm_untimed": self.untimed,
            }
            if not COUNTING:  # unknown, not zero
                out = dict.fromkeys(out, float("nan"))
            self.calls, self.payload, self.sent, self.untimed = 0, 0, 0.0, 0
        busy, end = 0.0, float("-inf")
        for _, a, b, _ in sorted(spans, key=lambda s: s[1]):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        return {**out, "comm_in_flight_s": busy, "spans": spans}


_TRAFFIC = Traffic()


def traffic() -> Traffic:
    """This process's tally (one per rank process)."""
    return _TRAFFIC


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def sent(args, payload: int, n: int, me: int) -> float:
    """Bytes this rank (group rank ``me`` of ``n``) sends for one operation, ring algorithms."""
    if n == 1 or args.name == HookOpName.RECV:
        return 0.0
    name, root = args.name, args.root
    if name == HookOpName.ALLGATHER:  # the model reads the gathered output's size
        return coefficients("all_gather", n)[1] * _nbytes(args.output_tensors)
    if name in (HookOpName.ALLREDUCE, HookOpName.REDUCE_SCATTER):
        return coefficients(_OPS[name], n)[1] * payload
    if name == HookOpName.BROADCAST:  # a chain from the root: all but its last link forward S
        return 0.0 if me == (root - 1) % n else float(payload)
    if name in (HookOpName.REDUCE, HookOpName.GATHER):  # into the root: the others send S
        return 0.0 if me == root else float(payload)
    if name == HookOpName.SCATTER:  # the root sends every other rank its piece
        return payload * (n - 1) / n if me == root else 0.0
    if name == HookOpName.ALLTOALL:  # every rank keeps its own piece
        return payload * (n - 1) / n
    return float(payload)  # a send


def watch(group: dist.ProcessGroup | None = None) -> None:
    """Count every operation ``group`` (default: the world) is handed, into ``traffic()``."""
    if not COUNTING:
        return
    pg = group if group is not None else dist.group.WORLD
    n, issued = pg.size(), {}

    def pre(args) -> None:
        op = _OPS.get(args.name)
        if op is None:  # barrier, split: no payload
            return
        payload = 0 if args.name == HookOpName.RECV else _nbytes(args.input_tensors)
        _TRAFFIC.add(op, payload, sent(args, payload, n, pg.rank()))
        if _TRAFFIC.timing:
            issued[args.op_id] = (op, time.perf_counter(), payload)

    def post(args) -> None:
        start = issued.pop(args.op_id, None)
        if start is None:
            return
        op, t0, payload = start
        try:
            future = args.work.get_future()
        except (RuntimeError, AttributeError):  # gloo's point-to-point work has no future
            _TRAFFIC.untimed += 1
            return

        def done(fut):
            _TRAFFIC.span(op, t0, time.perf_counter(), payload)

        with _TRAFFIC._lock:
            _TRAFFIC.pending += 1
            _TRAFFIC._settled.clear()
        future.then(done)

    pg.register_pre_hook(HOOK_ID, pre)
    pg.register_post_hook(HOOK_ID, post)


def watch_all() -> None:
    """``watch`` every process group this process has made (the world, DDP's, a device mesh's,
    an averager's): called by the training loop once the strategy has built its groups."""
    groups = getattr(dist.distributed_c10d._world, "pg_map", None) or {dist.group.WORLD: None}
    for pg in list(groups):
        watch(pg)


def unwatch(group: dist.ProcessGroup | None = None) -> None:
    """Stop counting ``group`` (default: the world): a baseline with nothing labkit adds."""
    if not COUNTING:
        return
    pg = group if group is not None else dist.group.WORLD
    pg.unregister_pre_hook(HOOK_ID)
    pg.unregister_post_hook(HOOK_ID)
