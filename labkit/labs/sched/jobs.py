"""A training job as a scheduler sees it, and where its throughput curve comes from.

A job has an arrival time, a size request (GPUs), a priority, an amount of work (samples) and a
throughput curve: samples per second at each worker count. The curve decides everything a policy
can gain by moving GPUs around, so every curve says where it comes from (``Curve.source``):

* ``measured``: labkit runs on this machine (``curve_from_records``: the median step of each
  world size in a ``labkit.experiment`` table);
* ``predicted``: the communication lab's step-time predictor (``labkit.predict.step.scaling``)
  for a named device and interconnect (``labkit.predict.whatif``), via ``curve_from_predictor``;
* ``preset``: a few shipped shapes (``PRESETS``), labelled as such.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ... import registry
from ...predict.collectives import CollectiveModel
from ...predict.step import Layer, Profile, scaling
from ...predict.whatif import DEVICES, INTERCONNECTS

INTRA_NODE = "NVLink 4 (H100)"  # default links inside a node and between nodes
INTER_NODE = "400 Gb/s InfiniBand (NDR)"


@dataclass(frozen=True)
class Curve:
    """Samples per second at each worker count (``points``: {workers: samples/s}); between
    measured counts linear, beyond the largest flat (adding workers there gains nothing).
    ``spread_factor``: throughput multiplier when the workers span more than one node."""

    name: str
    points: tuple[tuple[int, float], ...]
    source: str = "preset"
    spread_factor: float = 1.0

    def __post_init__(self):
        pts = tuple(sorted((int(k), float(v)) for k, v in dict(self.points).items()))
        if not pts or pts[0][0] != 1:
            raise ValueError(f"curve {self.name!r} needs a throughput at 1 worker")
        if any(k < 1 or not v > 0 or not math.isfinite(v) for k, v in pts):
            raise ValueError(
                f"curve {self.name!r}: worker counts must be >= 1 and throughputs "
                f"positive, got {pts}"
            )
        if not 0 < self.spread_factor <= 1:
            raise ValueError(
                f"curve {self.name!r}: spread_factor must be in (0, 1], got {self.spread_factor}"
            )
        object.__setattr__(self, "points", pts)
        object.__setattr__(self, "_ks", [k for k, _ in pts])

    def __call__(self, workers: int, spread: bool = False) -> float:
        if workers <= 0:
            return 0.0
        ks, pts = self._ks, self.points
        i = bisect.bisect_left(ks, workers)
        if i < len(ks) and ks[i] == workers:
            v = pts[i][1]
        elif i >= len(ks):
            v = pts[-1][1]
        else:  # between two counts: a straight line
            (k0, v0), (k1, v1) = pts[i - 1], pts[i]
            v = v0 + (v1 - v0) * (workers - k0) / (k1 - k0)
        return v * self.spread_factor if spread else v

    @property
    def max_workers(self) -> int:
        return self.points[-1][0]

    def speedup(self, workers: int) -> float:
        return self(workers) / self(1)

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "spread_factor": self.spread_factor,
            "points": [list(p) for p in self.points],
        }


def amdahl(
    name: str,
    serial: float,
    max_workers: int = 16,
    spread_factor: float = 1.0,
    source: str = "preset",
) -> Curve:
    """speed-up 1 / (serial + (1 - serial) / k): ``serial`` 0 scales linearly."""
    pts = {k: 1.0 / (serial + (1 - serial) / k) for k in _counts(max_workers)}
    return Curve(name, tuple(pts.items()), source, spread_factor)


def _counts(max_workers: int) -> list[int]:
    return sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, max_workers} & set(range(1, max_workers + 1)))


# Shapes labelled as presets (not measurements): perfect scaling, a compute-bound model that
# scales well, and a communication-bound one that stops gaining after a few workers.
PRESETS: dict[str, Curve] = {
    "linear": amdahl("linear", 0.0, spread_factor=1.0, source="preset (ideal)"),
    "good": amdahl("good", 0.05, spread_factor=0.9, source="preset (Amdahl, 5 % serial)"),
    "poor": amdahl("poor", 0.3, spread_factor=0.6, source="preset (Amdahl, 30 % serial)"),
}


# Published sizes of two well-known models, as a predictor profile (per-sample forward FLOPs and
# parameter bytes in fp32); compute is spread over a few equal blocks, which is all DDP's bucket
# overlap needs to see. Labelled "preset profile": these are not measurements.
MODEL_PRESETS = {
    "resnet50": {"params": 25.6e6, "gflops": 4.1, "blocks": 8},  # He et al. 2016
    "bert-base": {"params": 110e6, "gflops": 22.0, "blocks": 12},  # seq 128; Devlin et al.
}


def preset_profile(model: str, batch: int = 256) -> Profile:
    """A predictor profile from a model's published parameter count and FLOPs (a preset)."""
    if model not in MODEL_PRESETS:
        raise ValueError(
            f"unknown model preset {model!r}: choose one of {', '.join(MODEL_PRESETS)}"
        )
    spec = MODEL_PRESETS[model]
    n = spec["blocks"]
    grad = int(4 * spec["params"] / n)
    flops = spec["gflops"] * 1e9 / n
    # times are placeholders until on_device() rescales them from the FLOPs
    layers = tuple(Layer(f"block {i}", 1e-3, 2e-3, (grad,), flops=flops) for i in range(n))
    return Profile(batch=batch, layers=layers, source=f"preset profile ({model})")


def curve_from_predictor(
    model: str | Profile,
    device: str = "H100 SXM",
    intra: str = INTRA_NODE,
    inter: str = INTER_NODE,
    max_workers: int = 16,
    batch_per_rank: int = 256,
    strategy: str = "ddp",
) -> Curve:
    """Throughput over worker counts from ``labkit.predict.step.scaling`` (weak scaling, the
    per-rank batch fixed) with the workers on ``intra``-node links; ``spread_factor`` is the
    predicted throughput on ``inter``-node links over that, at ``max_workers`` (the
    placement penalty the simulator applies to a job spread over nodes)."""
    for name, table in (("device", DEVICES), ("intra", INTERCONNECTS), ("inter", INTERCONNECTS)):
        value = {"device": device, "intra": intra, "inter": inter}[name]
        if value not in table:
            raise ValueError(
                f"{name} {value!r} is not a predictor preset: choose one of {', '.join(table)}"
            )
    profile = preset_profile(model, batch_per_rank) if isinstance(model, str) else model
    dev = DEVICES[device]
    if dev.flops_per_s is not None:
        profile = profile.on_device(dev.flops_per_s, dev.name)
    counts = _counts(max_workers)

    def rates(link: str) -> dict[int, float]:
        rows = scaling(
            profile, CollectiveModel.uniform(INTERCONNECTS[link]), strategy, counts, batch_per_rank
        )
        return {n: r["samples_per_s"] for n, r in zip(counts, rows)}

    near, far = rates(intra), rates(inter)
    factor = min(1.0, far[counts[-1]] / near[counts[-1]]) if counts[-1] > 1 else 1.0
    label = model if isinstance(model, str) else "profile"
    return Curve(
        f"{label} on {device}",
        tuple(near.items()),
        f"predicted (labkit.predict.step, {device}, {intra} in a node, {inter} across)",
        factor,
    )


def curve_from_records(table, name: str = "measured", spread_factor: float = 1.0) -> Curve:
    """A curve from ``labkit.records.summarize``'s table (one row per world size of one
    model): samples/s of the fastest data-parallel row at each world size."""
    names = [n for n, s in registry.STRATEGIES.items() if s.reference or s.replicated]
    rows = table[table["strategy"].isin(names)]
    if rows.empty:
        raise ValueError(f"the table has no {'/'.join(names)} rows to take a curve from")
    pts = rows.groupby("world_size")["samples_per_s"].max().to_dict()
    busy = bool(table["busy"].any()) if "busy" in table else False
    return Curve(
        name,
        tuple(pts.items()),
        "measured on this machine" + (" (busy: CPU share low)" if busy else ""),
        spread_factor,
    )


@dataclass
class Job:
    """One job of a trace. ``work`` in samples; ``gpus`` the request (what static policies give);
    the simulator fills in the outcome fields."""

    job_id: int
    arrival_s: float
    gpus: int
    work: float
    curve: Curve
    priority: int = 0
    startup_s: float = 0.0  # first launch: processes up, model built
    restart_s: float = 0.0  # every later start: checkpoint saved + re-launch + resume
    # ---- outcome (filled by the simulator)
    start_s: float | None = None
    finish_s: float | None = None
    restarts: int = 0
    gpu_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def duration_alone_s(self) -> float:
        """Seconds at the requested GPUs on one node, with nothing else running."""
        return self.startup_s + self.work / self.curve(self.gpus)

    @property
    def jct_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def fresh(self) -> Job:
        """A copy with no outcome (a trace is reused across policies)."""
        return Job(
            self.job_id,
            self.arrival_s,
            self.gpus,
            self.work,
            self.curve,
            self.priority,
            self.startup_s,
            self.restart_s,
        )


def resolve_curve(name: str, curves: Mapping[str, Curve] | None = None) -> Curve:
    """A curve by name: yours first, then the presets."""
    if curves and name in curves:
        return curves[name]
    if name in PRESETS:
        return PRESETS[name]
    known = sorted({*(curves or {}), *PRESETS})
    raise ValueError(
        f"unknown curve {name!r}: choose one of {', '.join(known)} or pass "
        f"curves={{'{name}': Curve(...)}}"
    )
