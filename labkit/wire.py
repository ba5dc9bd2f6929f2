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
  whose output is S bytes (n-1)/n x S, a broadcast S, a send its message, an all-to-all of S
  bytes all but the piece it keeps for itself ((n-1)/n x S when the pieces are equal: the
  hook is not handed ``all_to_all_single``'s split sizes). On one rank, 0.

``traffic()`` is this process's running tally; the training loop reads it once per step
(``Traffic.take``). With ``timing`` on, each collective's interval in flight (issued to
completed, read on the ``perf_counter`` clock every record uses) is kept too. Its end is read by
one waiting thread (``_Ends``), not by a callback on the backend's thread: a Python callback there
takes the GIL, and while it waits for it, gloo's thread cannot start the next bucket's all-reduce
(DDP on 2 CPU ranks: about 3 % slower per step, ``benchmarks/README.md``).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .predict.collectives import coefficients


def _hook_op_names():
    """The operation names a process-group hook is handed: torch's ``HookOpName``, private (in
    ``torch._C._distributed_c10d``; written for torch 2.14, whose ``ProcessGroup`` has the hooks).
    None on a torch without them: it trains, and counts nothing (NaN, never 0)."""
    try:
        from torch._C._distributed_c10d import HookOpName
    except ImportError:
        return None
    return HookOpName if hasattr(dist.ProcessGroup, "register_pre_hook") else None


def _process_groups() -> list:
    """Every process group this process has made: torch's private registry of them
    (``distributed_c10d._world.pg_map``, written for torch 2.14); the world where it is gone;
    none in a process that set up no group (a loop run in the notebook's own process)."""
    groups = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if groups:
        return list(groups)
    return [dist.group.WORLD] if dist.is_available() and dist.is_initialized() else []


HookOpName = _hook_op_names()
COUNTING = HookOpName is not None
WHY_NOT = "" if COUNTING else f"torch {torch.__version__} has no process-group hooks (2.14 has)"

# the alpha-beta model's name for each operation (a reduce to one root, a gather and a scatter
# cost one message per peer: modelled as point to point)
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
        HookOpName.ALLTOALL: "all_to_all",
    }
    if COUNTING
    else {}
)
# torch's name for each operation, as a person reads it (``Traffic.ops``)
_NAMES = (
    {
        HookOpName.ALLREDUCE: "all_reduce",
        HookOpName.ALLGATHER: "all_gather",
        HookOpName.REDUCE_SCATTER: "reduce_scatter",
        HookOpName.BROADCAST: "broadcast",
        HookOpName.REDUCE: "reduce",
        HookOpName.SEND: "send",
        HookOpName.RECV: "recv",
        HookOpName.GATHER: "gather",
        HookOpName.SCATTER: "scatter",
        HookOpName.ALLTOALL: "all_to_all",
    }
    if COUNTING
    else {}
)
HOOK_ID = 0x1AB  # one id per group: watching a group twice replaces, never doubles


@dataclass
class Traffic:
    """Operations, payload and bytes sent since the last ``take()``; with ``timing`` on, the
    interval each collective was in flight.

    A timed collective's interval ends where ``_Ends`` reads the clock, after waiting for it,
    and is put on a queue (``queue.SimpleQueue``: no Python lock, no condition); ``take``
    collects them."""

    calls: int = 0
    payload: int = 0
    sent: float = 0.0
    untimed: int = 0  # operations whose interval in flight is unknown (gloo's point to point)
    issued: int = 0  # timed operations since the last take: each puts one interval on _done
    timing: bool = False
    # with a dict here (``count_ops``), each operation is also tallied by (name, group size):
    # [calls, payload, sent]; ``take`` hands it over as ``comm_ops``
    ops: dict | None = None
    # the tagged groups' operations (``tag``): {tag: {operation: [calls, payload, sent]}}, every
    # tag a watched group carries listed (empty when it was handed nothing); ``take`` hands it
    # over as ``comm_tagged``
    tagged: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _done: queue.SimpleQueue = field(default_factory=queue.SimpleQueue, repr=False)

    def take(self, settle_s: float = 0.05) -> dict:
        """What happened since the last call, then count afresh: ``comm_calls``,
        ``comm_payload_bytes``, ``comm_bytes`` (sent, ring convention), ``comm_in_flight_s``
        (seconds during which any timed collective was in flight: the union of their
        intervals), ``comm_untimed`` (operations that were not timed) and the intervals
        themselves (``spans``: op, start, end, payload). A collective that completed (DDP
        waits for its buckets before backward returns) may not have had its end read yet by
        ``_Ends``' thread: wait up to ``settle_s`` in all for those."""
        with self._lock:
            issued, self.issued = self.issued, 0
            out = {
                "comm_calls": self.calls,
                "comm_payload_bytes": self.payload,
                "comm_bytes": int(round(self.sent)),
                "comm_untimed": self.untimed,
            }
            if not COUNTING:  # unknown, not zero
                out = dict.fromkeys(out, float("nan"))
            self.calls, self.payload, self.sent, self.untimed = 0, 0, 0.0, 0
            if self.ops is not None:
                out["comm_ops"] = {key: tuple(row) for key, row in self.ops.items()}
                self.ops = {}
            if self.tagged:
                out["comm_tagged"] = {
                    name: {op: tuple(row) for op, row in ops.items()}
                    for name, ops in self.tagged.items()
                }
                self.tagged = {name: {} for name in self.tagged}
        spans, deadline = [], None
        for _ in range(issued):  # released the moment each end is queued (no polling)
            try:
                spans.append(self._done.get_nowait())
                continue
            except queue.Empty:
                deadline = deadline or time.perf_counter() + settle_s
            try:
                spans.append(self._done.get(timeout=max(0.0, deadline - time.perf_counter())))
            except queue.Empty:  # an end never read: not waited on again
                break
        busy, end = 0.0, float("-inf")
        for _, a, b, _ in sorted(spans, key=lambda s: s[1]):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        return {**out, "comm_in_flight_s": busy, "spans": spans}


_TRAFFIC = Traffic()


class _Ends:
    """The thread that reads when each timed collective of a gloo group completed: it waits for
    their futures in the order they were issued, reads the clock and queues the interval. gloo's
    futures hold CPU tensors, so a wait joins no stream. One per process, started the first time
    it is needed. A collective that completes before the one issued ahead of it (gloo runs two
    at once) has its end read when that one's is: its interval lies inside the earlier one's,
    so the time any collective was in flight (``comm_in_flight_s``) is unchanged."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # ranks run as threads of one process start it once

    def put(self, item: tuple) -> None:
        """Read when ``item``'s future (future, op, start, payload) completes."""
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    thread = threading.Thread(target=self._run, name="labkit-wire", daemon=True)
                    thread.start()
                    self._thread = thread
        self._queue.put(item)

    def _run(self) -> None:
        while True:
            future, op, t0, payload = self._queue.get()
            try:
                future.wait()
            except Exception:  # a failed collective: its caller's own wait raises the error
                pass
            _ended(op, t0, payload)


_ENDS = _Ends()


def _ended(op: str, t0: float, payload: int) -> None:
    """A timed collective issued at ``t0`` has ended now: queue its interval for ``take``."""
    _TRAFFIC._done.put((op, t0, time.perf_counter(), payload))


def _backend(pg: dist.ProcessGroup) -> str:
    """The name of ``pg``'s backend ("gloo", "nccl", a dry run's), "" where torch cannot say."""
    try:
        return str(dist.get_backend(pg))
    except (RuntimeError, ValueError):
        return ""


def traffic() -> Traffic:
    """This process's tally (one per rank process)."""
    return _TRAFFIC


_TAGS: dict = {}  # process group -> the name its traffic is also tallied under (``tag``)


def tag(group: dist.ProcessGroup, name: str) -> None:
    """Also tally what ``group`` is handed under ``name`` (``Traffic.tagged``; the records'
    ``comm_bytes_<name>`` columns): a device mesh's dimensions are distinct process groups, so
    each dimension's bytes are counted apart (``labkit.strategies.mesh4d``). Tag a group before
    the loop watches it (``watch_all``), or ``watch`` it again after."""
    _TAGS[group] = name


def count_ops(on: bool = True) -> None:
    """Also tally every operation by its name and group size (``Traffic.ops``): what a dry run
    reports per collective (``labkit.labs.dryrun``), and a real run beside it."""
    with _TRAFFIC._lock:
        _TRAFFIC.ops = {} if on else None


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _payload(tensors: list[torch.Tensor]) -> int:
    """``_nbytes`` of the tensors a collective is handed (most often one)."""
    return tensors[0].nbytes if len(tensors) == 1 else sum(t.nbytes for t in tensors)


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
    if name == HookOpName.ALLTOALL:  # every rank keeps its own piece: in a list, exactly that
        if len(args.input_tensors) == n:  # one; of one tensor, 1/n of it, which is exact for
            return float(payload - args.input_tensors[me].nbytes)  # equal splits (the hook is
        return payload * (n - 1) / n  # not handed all_to_all_single's split sizes)
    return float(payload)  # a send


def watch(group: dist.ProcessGroup | None = None) -> None:
    """Count every operation ``group`` (default: the world) is handed, into ``traffic()``."""
    if not COUNTING:
        return
    pg = group if group is not None else dist.group.WORLD
    n, me, started, lock = pg.size(), pg.rank(), {}, _TRAFFIC._lock
    gloo = _backend(pg) == "gloo"
    # The hooks run inside every collective (DDP's: inside backward), so they do as little as
    # they can: operations keyed by their value (hashing torch's enum is a call into C++ each
    # time), and the share of the payload an all-reduce or reduce-scatter puts on the wire
    # worked out once per group (``sent`` says the same for every operation)
    ops = {int(name): op for name, op in _OPS.items()}
    shares = {
        int(name): coefficients(_OPS[name], n)[1]
        for name in (HookOpName.ALLREDUCE, HookOpName.REDUCE_SCATTER)
    }
    recv = int(HookOpName.RECV)
    names = {int(name): _NAMES[name] for name in _OPS}
    label = _TAGS.get(pg)
    if label is not None:
        with lock:
            _TRAFFIC.tagged.setdefault(label, {})

    def pre(args) -> None:
        kind = int(args.name)
        op = ops.get(kind)
        if op is None:  # barrier, split: no payload
            return
        payload = 0 if kind == recv else _payload(args.input_tensors)
        share = shares.get(kind)
        on_wire = sent(args, payload, n, me) if share is None else share * payload
        with lock:  # the autograd thread (DDP's reducer) issues collectives too
            _TRAFFIC.calls += 1
            _TRAFFIC.payload += payload
            _TRAFFIC.sent += on_wire
            if _TRAFFIC.ops is not None:
                row = _TRAFFIC.ops.setdefault((names[kind], n), [0, 0, 0.0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + payload, row[2] + on_wire
            if label is not None:
                row = _TRAFFIC.tagged.setdefault(label, {}).setdefault(names[kind], [0, 0, 0.0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + payload, row[2] + on_wire
        if _TRAFFIC.timing:
            started[args.op_id] = (op, time.perf_counter(), payload)

    def post(args) -> None:
        start = started.pop(args.op_id, None)
        if start is None:
            return
        op, t0, payload = start
        try:
            future = args.work.get_future()
        except (RuntimeError, AttributeError):  # gloo's point-to-point work has no future
            with _TRAFFIC._lock:
                _TRAFFIC.untimed += 1
            return
        with _TRAFFIC._lock:
            _TRAFFIC.issued += 1
        if future.done():  # finished as it was issued (a dry run's backend)
            _ended(op, t0, payload)
        elif gloo:
            _ENDS.put((future, op, t0, payload))
        else:  # another backend's future may carry CUDA streams, which a wait would join:
            # read the clock in its completion callback, on the backend's thread
            future.add_done_callback(lambda fut: _ended(op, t0, payload))

    pg.register_pre_hook(HOOK_ID, pre)
    pg.register_post_hook(HOOK_ID, post)


def watch_all() -> None:
    """``watch`` every process group this process has made (the world, DDP's, a device mesh's,
    an averager's): called by the training loop once the strategy has built its groups."""
    for pg in _process_groups():
        watch(pg)


def unwatch(group: dist.ProcessGroup | None = None) -> None:
    """Stop counting ``group`` (default: the world): a baseline with nothing labkit adds."""
    if not COUNTING:
        return
    pg = group if group is not None else dist.group.WORLD
    pg.unregister_pre_hook(HOOK_ID)
    pg.unregister_post_hook(HOOK_ID)
