"""How a global batch is shared among unequal ranks: who is slow, who holds more data, and
whole-sample shares in proportion to weights.

Pure functions of the configuration, read by ``RunConfig``'s validation, the rank-side balancer
(``labkit.rank.balancer``) and the step-time predictor (``labkit.predict.step``) alike.
"""

from __future__ import annotations

import math


def parse_slowdown(spec) -> tuple[tuple[int, float, int | None], ...]:
    """``"1:2"``, ``"1:2@10,0:1.5"``, ``{1: 2.0}`` or ``((1, 2.0), (0, 1.5, 10))`` ->
    ``((rank, factor, from_step), ...)``; ``from_step`` None: from the first step (warm-up too)."""
    if spec is None or spec == "" or spec == ():
        return ()
    if isinstance(spec, str):
        items = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            rank_factor, _, start = part.partition("@")
            rank, sep, factor = rank_factor.partition(":")
            try:
                items.append((int(rank), float(factor), int(start) if start else None))
            except ValueError:
                raise ValueError(
                    f"slowdown {part!r} is not RANK:FACTOR[@STEP], e.g. '1:2' (rank 1 "
                    f"computes 2x slower) or '1:2@10' (from step 10)"
                ) from None
            if not sep:
                raise ValueError(f"slowdown {part!r} is not RANK:FACTOR[@STEP], e.g. '1:2'")
        spec = items
    elif isinstance(spec, dict):
        spec = list(spec.items())
    out = []
    for item in spec:
        rank, factor, start = (tuple(item) + (None,))[:3]
        if int(rank) != rank or rank < 0:
            raise ValueError(f"slowdown rank must be a whole number >= 0, got {rank!r}")
        if not float(factor) >= 1:
            raise ValueError(
                f"slowdown factor {factor} for rank {rank} is below 1: a rank cannot "
                f"be made faster than its device; slow the other ranks down instead"
            )
        out.append((int(rank), float(factor), None if start is None else int(start)))
    if len({r for r, _, _ in out}) != len(out):
        raise ValueError(f"slowdown names a rank twice: {spec!r}")
    return tuple(sorted(out))


def format_slowdown(slowdown) -> str:
    """The CLI spelling of a parsed slowdown: ``"1:2"``, ``"1:2@10"``."""
    return ",".join(f"{r}:{f:g}" + ("" if s is None else f"@{s}") for r, f, s in slowdown)


def slowdown_at(slowdown, rank: int, step: int) -> float:
    """How many times slower ``rank`` computes at ``step`` (negative steps are warm-up)."""
    for r, factor, start in slowdown:
        if r == rank and (start is None or step >= start):
            return factor
    return 1.0


def skew_weights(world_size: int, skew: float) -> list[float]:
    """Data held per rank, relative: 1 for rank 0 up to 1 + skew for the last, linearly."""
    if world_size == 1:
        return [1.0]
    return [1.0 + skew * r / (world_size - 1) for r in range(world_size)]


def split(total: int, weights, minimum: int = 1) -> list[int]:
    """``total`` samples in whole shares proportional to ``weights`` (largest remainder), each at
    least ``minimum``."""
    n = len(weights)
    if total < minimum * n:
        raise ValueError(f"{total} samples cannot give {n} ranks {minimum} each")
    w = [max(0.0, float(x)) for x in weights]
    if not sum(w) > 0 or not all(math.isfinite(x) for x in w):
        w = [1.0] * n
    exact = [total * x / sum(w) for x in w]
    shares = [max(minimum, math.floor(e)) for e in exact]
    while sum(shares) < total:  # the largest remainders get one more
        r = max(range(n), key=lambda r: (exact[r] - shares[r], -r))
        shares[r] += 1
    while sum(shares) > total:  # minimums pushed it over: take from the most
        r = max(
            (r for r in range(n) if shares[r] > minimum),
            key=lambda r: (shares[r] - exact[r], shares[r]),
        )
        shares[r] -= 1
    return shares
