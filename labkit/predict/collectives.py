"""The alpha-beta model of a collective, and its fit to measurements.

A collective on ``n`` ranks moving a message of ``S`` bytes takes

    t = a(op, n) * alpha + b(op, n) * S / beta

where ``alpha`` is the latency of one step (a message hop) and ``beta`` the bandwidth of one
link. The coefficients are those of the ring algorithms (Thakur, Rabenseifner and Gropp 2005;
the nccl-tests "bus bandwidth" factors are the ``b`` below):

    all_reduce       ring reduce-scatter then ring all-gather   a = 2(n-1)   b = 2(n-1)/n
    all_gather       ring, S = the gathered (output) size        a = n-1      b = (n-1)/n
    reduce_scatter   ring, S = the scattered (input) size        a = n-1      b = (n-1)/n
    broadcast        pipelined chain                              a = 1        b = 1
    all_to_all       pairwise exchange, S = one rank's input      a = n-1      b = (n-1)/n
                     (n-1 messages of S/n: each rank keeps its own piece; not in ``OPS``)

Which algorithm a backend really runs: NCCL picks ring or tree per size and topology; gloo's
CPU all-reduce is a ring (``gloo::allreduce``; torch never selects its bcube) and its
broadcast a tree from the root. At n = 2 every one of these sends the same bytes over the one
link, so the fit is exact in form there; at larger n the fitted alpha absorbs the difference.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def coefficients(op: str, world_size: int) -> tuple[float, float]:
    """``(a, b)`` of ``t = a * alpha + b * S / beta`` for ``op`` on ``world_size`` ranks."""
    n = world_size
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {n}")
    if n == 1:
        return 0.0, 0.0  # nothing leaves the rank
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return float(n - 1), (n - 1) / n
    if op in ("broadcast", "p2p"):  # p2p: one send to a neighbour
        return 1.0, 1.0
    if op == "all_to_all":  # expert and Ulysses parallelism's exchange
        return float(n - 1), (n - 1) / n
    raise ValueError(f"unknown collective {op!r}: choose one of {', '.join(OPS)} or p2p")


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw as nccl-tests defines it (the ``b`` coefficient; 1 for broadcast)."""
    if world_size == 1:
        return 1.0
    return coefficients(op, world_size)[1]


@dataclass(frozen=True)
class AlphaBeta:
    """One link: ``alpha_s`` seconds per hop, ``beta`` bytes per second. ``source`` says where
    the numbers come from ("fitted on this machine", "published", ...)."""

    alpha_s: float
    beta: float
    source: str = ""

    def time(self, op: str, nbytes: float, world_size: int) -> float:
        a, b = coefficients(op, world_size)
        return a * self.alpha_s + b * nbytes / self.beta


@dataclass(frozen=True)
class CollectiveModel:
    """Per-op alpha-beta fits (``ops``), with a default for ops that were not measured."""

    ops: dict
    default: str = "all_reduce"

    def link(self, op: str) -> AlphaBeta:
        return self.ops.get(op) or self.ops[self.default]

    def time(self, op: str, nbytes: float, world_size: int) -> float:
        return self.link(op).time(op, nbytes, world_size)

    def scaled(self, factor: float) -> CollectiveModel:
        """Every op ``factor`` times as slow (latency and bandwidth alike)."""
        return replace(
            self,
            ops={
                op: AlphaBeta(ab.alpha_s * factor, ab.beta / factor, ab.source)
                for op, ab in self.ops.items()
            },
        )

    @classmethod
    def uniform(cls, link: AlphaBeta) -> CollectiveModel:
        """One link for every op (a published interconnect)."""
        return cls({"all_reduce": link})


def fit(
    op: str, world_size: int, sizes: Sequence[float], times: Sequence[float], source: str = "fitted"
) -> AlphaBeta:
    """Least-squares alpha and beta from measured (bytes, seconds), relative error weighted (a
    1 KiB and a 64 MiB point count alike). Exact on noise-free data; never negative."""
    a, b = coefficients(op, world_size)
    if a == 0:
        raise ValueError("a one-rank collective moves nothing: fit on world_size >= 2")
    pts = [(s, t) for s, t in zip(sizes, times) if t > 0 and math.isfinite(t)]
    if len(pts) < 2:
        raise ValueError(f"need at least 2 measured sizes to fit alpha and beta, got {len(pts)}")
    # unknowns u = alpha, v = 1/beta; rows (a, b*S)/t . (u, v) = 1
    rows = [(a / t, b * s / t) for s, t in pts]
    u, v = _lstsq2(rows, [1.0] * len(rows))
    if v <= 0:  # latency alone explains it: bandwidth unbounded
        u, v = sum(r[0] for r in rows) / sum(r[0] ** 2 for r in rows), 0.0
    elif u < 0:  # bandwidth alone explains it: no latency
        u, v = 0.0, sum(r[1] for r in rows) / sum(r[1] ** 2 for r in rows)
    return AlphaBeta(u, 1.0 / v if v > 0 else math.inf, source)


def _lstsq2(rows: Sequence[tuple[float, float]], rhs: Sequence[float]) -> tuple[float, float]:
    """The 2-unknown normal equations, solved directly (no numpy needed for two columns)."""
    s11 = sum(r[0] * r[0] for r in rows)
    s12 = sum(r[0] * r[1] for r in rows)
    s22 = sum(r[1] * r[1] for r in rows)
    y1 = sum(r[0] * y for r, y in zip(rows, rhs))
    y2 = sum(r[1] * y for r, y in zip(rows, rhs))
    det = s11 * s22 - s12 * s12
    if det <= 1e-12 * s11 * s22:
        raise ValueError(
            "sizes too alike to separate latency from bandwidth: measure a wider range"
        )
    return (y1 * s22 - y2 * s12) / det, (y2 * s11 - y1 * s12) / det


def held_out_fit(
    op: str,
    world_size: int,
    sizes: Sequence[float],
    times: Sequence[float],
    min_bytes: float = 64 * 1024,
) -> tuple[AlphaBeta, list[dict]]:
    """Fit on every other size (the smallest and largest always in), predict the rest.

    Returns the fit and one row per held-out size: bytes, measured, predicted, relative error;
    ``min_bytes`` marks which held-out rows the error goal speaks about (``counted``)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    train = {order[0], order[-1]} | {order[k] for k in range(0, len(order), 2)}
    held = [i for i in order if i not in train]
    model = fit(
        op,
        world_size,
        [sizes[i] for i in sorted(train)],
        [times[i] for i in sorted(train)],
        source=f"fitted on {len(train)} sizes",
    )
    rows = []
    for i in held:
        pred = model.time(op, sizes[i], world_size)
        rows.append(
            {
                "op": op,
                "bytes": sizes[i],
                "measured_s": times[i],
                "predicted_s": pred,
                "error": abs(pred - times[i]) / times[i],
                "counted": sizes[i] >= min_bytes,
            }
        )
    return model, rows


def fit_table(rows: Iterable[dict], world_size: int, on: str = "mean_s") -> CollectiveModel:
    """A ``CollectiveModel`` from benchmark rows (``op``, ``bytes`` and the seconds in ``on``:
    ``labkit.labs.comm`` rows carry ``mean_s`` and ``time_s``, the median), one fit per op."""
    by_op: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append((r["bytes"], r[on] if on in r else r["time_s"]))
    fits = {
        op: fit(op, world_size, *zip(*pts), source=f"fitted on this machine (n={world_size})")
        for op, pts in by_op.items()
        if len(pts) >= 2
    }
    if not fits:
        raise ValueError("no op was measured at two sizes or more: nothing to fit")
    return CollectiveModel(fits, default="all_reduce" if "all_reduce" in fits else next(iter(fits)))


def fit_band(rows: Iterable[dict], world_size: int) -> tuple[CollectiveModel, CollectiveModel]:
    """The collectives fitted on their 10th and on their 90th percentile times (the comm
    benchmark's ``p10_s``/``p90_s``): the spread the step-time predictor carries into its band."""
    rows = list(rows)
    return fit_table(rows, world_size, on="p10_s"), fit_table(rows, world_size, on="p90_s")
