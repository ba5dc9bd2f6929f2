"""Job traces: a seeded generator with a Philly-like mix, and a CSV format with a validator.

The generator follows the job-size mix Gavel (Narayanan et al., OSDI'20) published for its
Philly-derived traces: 70 % of jobs ask for 1 GPU, 10 % for 2, 15 % for 4 and 5 % for 8.
Arrivals are a Poisson process (exponential gaps at ``rate_per_hour``). Durations are heavy
tailed, log-uniform in two bands as Gavel's generator draws them: most jobs run 10^1.5 to 10^3
minutes, a fifth 10^3 to 10^4 minutes; scaled here by ``duration_scale`` so a lab can shrink a
trace (the shape is the point).

CSV columns (one job per row; ``#`` lines are comments)::

    job_id,arrival_s,gpus,priority,duration_s,curve

``duration_s`` is how long the job runs alone on ``gpus`` GPUs of one node; its work in samples is
``duration_s x curve(gpus)``. ``curve`` names a curve (``labkit.labs.sched.jobs.PRESETS`` or yours).
"""

from __future__ import annotations

import csv
import io
import math
import random
from collections.abc import Mapping, Sequence

from .jobs import Curve, Job, resolve_curve

PHILLY_MIX = {1: 0.70, 2: 0.10, 4: 0.15, 8: 0.05}
COLUMNS = ("job_id", "arrival_s", "gpus", "priority", "duration_s", "curve")
# duration bands (minutes, log10): most jobs short, a long tail (Gavel's generator's two bands)
SHORT_BAND, LONG_BAND, LONG_SHARE = (1.5, 3.0), (3.0, 4.0), 0.2


# What a start costs a generated job, measured on this lab's machine by benchmarks/elastic.py
# (torchrun on loopback, labkit's toy MLP, 2 ranks): the cold start, first agent up to first
# step, 6.0 s; a restart after a killed worker, kill to the re-formed group's first step, 6.3 s.
# A floor for real jobs, which also load gigabytes of checkpoint and a framework: pass your own
# (``restart_s=0`` for the textbook queueing results, where a preemption is free).
STARTUP_S = 6.0
RESTART_S = 6.3


def generate(
    n: int,
    *,
    rate_per_hour: float = 30.0,
    seed: int = 0,
    mix: Mapping[int, float] | None = None,
    high_priority: float = 0.0,
    curves: Sequence[str] = ("good",),
    duration_scale: float = 1.0,
    curve_table: Mapping[str, Curve] | None = None,
    startup_s: float = STARTUP_S,
    restart_s: float = RESTART_S,
) -> list[Job]:
    """``n`` jobs, the same for the same arguments. ``high_priority``: share of jobs with
    priority 1 (the rest 0); ``curves``: curve names drawn uniformly per job; ``startup_s`` and
    ``restart_s``: what every job pays, holding its GPUs, before its first step and after each
    preemption or resize (default: this machine's measured torchrun start and re-form)."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not rate_per_hour > 0:
        raise ValueError(f"rate_per_hour must be positive, got {rate_per_hour}")
    if not 0 <= high_priority <= 1:
        raise ValueError(f"high_priority is a share of jobs in [0, 1], got {high_priority}")
    if not duration_scale > 0:
        raise ValueError(f"duration_scale must be positive, got {duration_scale}")
    if startup_s < 0 or restart_s < 0:
        raise ValueError(f"startup_s and restart_s are seconds >= 0, got {startup_s}, {restart_s}")
    mix = dict(mix or PHILLY_MIX)
    if any(g < 1 for g in mix) or not math.isclose(sum(mix.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"mix must map GPU counts >= 1 to shares summing to 1, got {mix}")
    table = {name: resolve_curve(name, curve_table) for name in curves}
    rng = random.Random(seed)
    sizes, weights = list(mix), list(mix.values())
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate_per_hour / 3600.0)
        gpus = rng.choices(sizes, weights)[0]
        band = LONG_BAND if rng.random() < LONG_SHARE else SHORT_BAND
        duration = 60.0 * 10 ** rng.uniform(*band) * duration_scale
        priority = 1 if rng.random() < high_priority else 0
        curve = table[rng.choice(list(curves))]
        jobs.append(
            Job(i, round(t, 3), gpus, duration * curve(gpus), curve, priority, startup_s, restart_s)
        )
    return jobs


def to_csv(jobs: Sequence[Job], path: str | None = None) -> str:
    """The trace as CSV text (written to ``path`` too when given)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    for j in jobs:
        w.writerow(
            [
                j.job_id,
                f"{j.arrival_s:.3f}",
                j.gpus,
                j.priority,
                f"{j.work / j.curve(j.gpus):.3f}",
                j.curve.name,
            ]
        )
    text = buf.getvalue()
    if path:
        with open(path, "w") as f:
            f.write(text)
    return text


def parse_csv(
    text: str,
    curves: Mapping[str, Curve] | None = None,
    *,
    startup_s: float = STARTUP_S,
    restart_s: float = RESTART_S,
) -> list[Job]:
    """Jobs from CSV text; a bad value raises ValueError naming its row (the file's line number)
    and column, and what to write instead. Starts and restarts cost what ``generate``'s do."""
    lines = [
        (i + 1, line)
        for i, line in enumerate(text.splitlines())
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not lines:
        raise ValueError(
            f"the trace is empty: write a header line {','.join(COLUMNS)} and one row per job"
        )
    header_no, header = lines[0]
    names = [h.strip() for h in next(csv.reader([header]))]
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise ValueError(
            f"line {header_no}: the header lacks column(s) {', '.join(missing)}; "
            f"expected {','.join(COLUMNS)}"
        )
    jobs, seen = [], {}
    for line_no, line in lines[1:]:
        cells = next(csv.reader([line]))
        if len(cells) != len(names):
            raise ValueError(f"line {line_no}: {len(cells)} values for {len(names)} columns")
        row = dict(zip(names, (c.strip() for c in cells)))

        def bad(col: str, why: str, line_no=line_no, row=row):
            return ValueError(f"line {line_no}, column {col}: {row[col]!r} {why}")

        def number(col: str, cast=float, low=0.0, strict=False, row=row):
            try:
                v = cast(row[col])
            except ValueError:
                raise bad(
                    col, f"is not {'a whole number' if cast is int else 'a number'}"
                ) from None
            if not math.isfinite(v) or v < low or (strict and v == low):
                raise bad(col, f"must be {'>' if strict else '>='} {low:g}")
            return v

        job_id = number("job_id", int)
        if job_id in seen:
            raise bad("job_id", f"repeats the id of line {seen[job_id]}: ids must be unique")
        seen[job_id] = line_no
        arrival = number("arrival_s")
        gpus = number("gpus", int, 1)
        priority = number("priority", int)
        duration = number("duration_s", float, 0.0, strict=True)
        try:
            curve = resolve_curve(row["curve"], curves)
        except ValueError as exc:
            raise bad("curve", "is not a known curve: " + str(exc).split(": ", 1)[1]) from None
        jobs.append(
            Job(
                job_id, arrival, gpus, duration * curve(gpus), curve, priority, startup_s, restart_s
            )
        )
    if not jobs:
        raise ValueError(f"the trace has a header but no jobs (after line {header_no})")
    return sorted(jobs, key=lambda j: (j.arrival_s, j.job_id))


def load(path: str, curves: Mapping[str, Curve] | None = None) -> list[Job]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path}: {exc.strerror}") from None
    try:
        return parse_csv(text, curves)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def check_fits(jobs: Sequence[Job], total_gpus: int) -> None:
    """Refuse a trace with a job no cluster of ``total_gpus`` can ever run."""
    big = [j for j in jobs if j.gpus > total_gpus]
    if big:
        raise ValueError(
            f"job {big[0].job_id} asks for {big[0].gpus} GPUs but the cluster has "
            f"{total_gpus}: grow the cluster or shrink the job"
        )


def mean_gpu_hours(mix: Mapping[int, float] | None = None, duration_scale: float = 1.0) -> float:
    """Expected GPU-hours of one generated job (request x duration alone)."""
    mix = dict(mix or PHILLY_MIX)

    def band_mean(a: float, b: float) -> float:  # E[10^U(a, b)]
        return (10**b - 10**a) / ((b - a) * math.log(10))

    minutes = (1 - LONG_SHARE) * band_mean(*SHORT_BAND) + LONG_SHARE * band_mean(*LONG_BAND)
    return sum(g * w for g, w in mix.items()) * minutes / 60 * duration_scale


def rate_for_load(
    load: float,
    total_gpus: int,
    mix: Mapping[int, float] | None = None,
    duration_scale: float = 1.0,
) -> float:
    """Arrivals per hour at which jobs ask for ``load`` x the cluster's GPU-hours on average."""
    if not load > 0:
        raise ValueError(f"load must be positive, got {load}")
    return load * total_gpus / mean_gpu_hours(mix, duration_scale)
