"""Predict a pipeline step by simulating its schedule on measured costs.

The order each stage runs its actions in is the executor's (``labkit.pipeline_schedules``). The
closed form (P-1)/(M+P-1) assumes P equal stages, free hand-offs and no time between one action and
the next. Real stages differ; every hand-off between ranks is a point-to-point message; and every
action costs its stage some dispatch (posting a send, allocating a receive buffer). Next to a small
micro-batch's compute these are not small (how large on gloo: benchmarks/README.md, "Behind the
code"). The simulation below keeps the schedule's order and dependencies and charges each action its
stage's duration, each hand-off its boundary's time and each action its stage's dispatch gap, all
measured (``costs_from_steps``), so it predicts the idle share that the closed form cannot.

Measured costs are not constants: on a shared CPU one hand-off in several takes several times the
others, one micro-batch in several pays a scheduler tick. A step's span is a max-plus expression of
its costs (an action starts at the later of its stage's freedom and its input's arrival), and the
expectation of a max exceeds the max of the expectations, so a schedule simulated on mean costs
under-predicts the idle share, the more so the more waits the schedule has (more micro-batches).
``predict_step`` therefore averages the simulation over draws from the measured samples (how much
closer that lands: benchmarks/README.md, "Behind the code").
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..pipeline_schedules import stage_actions  # the order the executor runs: one definition


@dataclass(frozen=True)
class ScheduleCosts:
    """Seconds per micro-batch on each stage, and per hand-off across each stage boundary."""

    forward_s: tuple[float, ...]  # one per stage
    backward_s: tuple[float, ...]  # one per stage
    handoff_s: tuple[float, ...]  # one per boundary (stage s <-> s+1), P-1 of them
    gap_s: tuple[float, ...] = ()  # per stage: dispatch between two actions (default 0)
    # the measured values behind each mean, keyed ("F", stage), ("B", stage), ("hop", boundary),
    # ("gap", stage); when present, predict_step draws from them instead of using the means
    samples: Mapping[tuple[str, int], tuple[float, ...]] | None = field(
        default=None, compare=False, hash=False
    )

    @property
    def stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(
        cls,
        stages: int,
        forward_s: float = 1.0,
        backward_s: float = 2.0,
        handoff_s: float = 0.0,
        gap_s: float = 0.0,
    ) -> ScheduleCosts:
        return cls(
            (forward_s,) * stages,
            (backward_s,) * stages,
            (handoff_s,) * (stages - 1),
            (gap_s,) * stages,
        )

    def mean(self, kind: str, index: int) -> float:
        """The mean cost of one action ("F", "B"), hand-off ("hop") or dispatch gap ("gap";
        0 when the costs carry none)."""
        if kind == "gap":
            return self.gap_s[index] if self.gap_s else 0.0
        return {"F": self.forward_s, "B": self.backward_s, "hop": self.handoff_s}[kind][index]


def simulate(
    schedule: str, microbatches: int, costs: ScheduleCosts, rng: random.Random | None = None
) -> list[dict]:
    """The events of one step: an action starts once its stage is free (plus its dispatch gap,
    after the stage's first action) and its input (the previous stage's F, or the next stage's
    B) has arrived; arriving costs the boundary's hand-off. ``schedule``: "gpipe", "1f1b" or
    "model_parallel" (GPipe's order with M=1). Every cost is its mean; with ``rng``, each
    action, hand-off and gap draws its own from ``costs.samples`` (one draw of the step)."""
    P = costs.stages
    samples = costs.samples or {}

    def cost(kind: str, index: int) -> float:
        xs = samples.get((kind, index)) if rng is not None else None
        return rng.choice(xs) if xs else costs.mean(kind, index)

    queues = [stage_actions(schedule, P, microbatches, s) for s in range(P)]
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) -> end
    free, pos, events = [0.0] * P, [0] * P, []
    while any(pos[s] < len(queues[s]) for s in range(P)):
        progressed = False
        for s in range(P):
            while pos[s] < len(queues[s]):
                kind, m = queues[s][pos[s]]
                if kind == "F":
                    dep, boundary = (("F", s - 1, m), s - 1) if s > 0 else (None, None)
                elif s < P - 1:
                    dep, boundary = ("B", s + 1, m), s
                else:
                    dep, boundary = ("F", s, m), None
                if dep is not None and dep not in done:
                    break
                hop = cost("hop", boundary) if boundary is not None else 0.0
                free_at = free[s] + (cost("gap", s) if pos[s] else 0.0)
                start = max(free_at, 0.0 if dep is None else done[dep] + hop)
                end = start + cost(kind, s)
                done[(kind, s, m)] = free[s] = end
                events.append(
                    {"stage": s, "microbatch": m, "kind": kind, "start": start, "end": end}
                )
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks at positions {pos}")
    return events


def bubble_per_stage(
    events: Sequence[dict], window: tuple[float, float] | None = None
) -> dict[int, float]:
    """Each stage's idle share of the window (default: first event anywhere to last anywhere)."""
    if not events:
        return {}
    lo, hi = window or (min(e["start"] for e in events), max(e["end"] for e in events))
    busy: dict[int, float] = {}
    for e in events:
        busy[e["stage"]] = busy.get(e["stage"], 0.0) + (e["end"] - e["start"])
    return {s: max(0.0, 1.0 - b / (hi - lo)) if hi > lo else 0.0 for s, b in sorted(busy.items())}


def costs_from_steps(steps: Sequence[Sequence[dict]], stages: int) -> ScheduleCosts:
    """Costs from measured steps (each a list of every stage's events on one clock): the mean
    of each, and every sample behind it (``ScheduleCosts.samples``).

    Means, not medians: on a shared CPU one action in several pays a scheduler tick; a median
    drops those ticks, while the real span pays them (by how much: benchmarks/README.md,
    "Behind the code").

    Two passes over each stage's actions in order. Hand-off samples: an action whose input
    came from another stage and whose stage was idle when that input's producer finished
    waited from that finish to its own start. Dispatch-gap samples: an action whose input had
    arrived (producer's end plus the boundary's mean hand-off) by the time its stage finished
    the previous action waited from that finish to its own start. Actions that waited for
    something else are left out of both.
    """
    dur: dict[tuple[int, str], list[float]] = {}
    hop: dict[int, list[float]] = {}
    gap: dict[int, list[float]] = {}
    waits = []  # (stage, boundary, dep_end, prev_end, start) per action
    for events in steps:
        end = {(e["kind"], e["stage"], e["microbatch"]): e["end"] for e in events}
        for s in range(stages):
            prev_end = None
            for e in sorted((e for e in events if e["stage"] == s), key=lambda e: e["start"]):
                dur.setdefault((s, e["kind"]), []).append(e["end"] - e["start"])
                m, kind = e["microbatch"], e["kind"]
                dep = (
                    ("F", s - 1, m)
                    if kind == "F" and s > 0
                    else ("B", s + 1, m)
                    if kind == "B" and s < stages - 1
                    else None
                )
                dep_end = end.get(dep)
                waits.append(
                    (s, None if dep is None else min(s, dep[1]), dep_end, prev_end, e["start"])
                )
                if dep_end is not None and (prev_end is None or dep_end >= prev_end):
                    hop.setdefault(min(s, dep[1]), []).append(e["start"] - dep_end)
                prev_end = e["end"]

    def mean(xs) -> float:
        return max(0.0, statistics.fmean(xs)) if xs else 0.0

    handoff = tuple(mean(hop.get(b)) for b in range(stages - 1))
    for s, boundary, dep_end, prev_end, start in waits:
        if prev_end is not None and (dep_end is None or dep_end + handoff[boundary] <= prev_end):
            gap.setdefault(s, []).append(start - prev_end)
    samples = {
        **{(kind, s): tuple(max(0.0, x) for x in v) for (s, kind), v in dur.items()},
        **{("hop", b): tuple(max(0.0, x) for x in v) for b, v in hop.items()},
        **{("gap", s): tuple(max(0.0, x) for x in v) for s, v in gap.items()},
    }
    return ScheduleCosts(
        tuple(mean(dur.get((s, "F"))) for s in range(stages)),
        tuple(mean(dur.get((s, "B"))) for s in range(stages)),
        handoff,
        tuple(mean(gap.get(s)) for s in range(stages)),
        samples,
    )


def _span(events: Sequence[dict]) -> float:
    return max(e["end"] for e in events) - min(e["start"] for e in events)


def predict_step(
    schedule: str, microbatches: int, costs: ScheduleCosts, draws: int = 128, seed: int = 0
) -> dict:
    """Predicted span of the step's compute, bubble per stage and mean bubble, and the events of
    the schedule simulated on the mean costs (the predicted Gantt). With measured samples
    (``costs.samples``) the span and bubbles are expectations over ``draws`` simulations, each
    drawing every cost from its samples (seeded: the same costs give the same prediction)."""
    events = simulate(schedule, microbatches, costs)
    runs = [events]
    if costs.samples and draws:
        rng = random.Random(seed)
        runs = [simulate(schedule, microbatches, costs, rng) for _ in range(draws)]
    bubbles = [bubble_per_stage(evs) for evs in runs]
    per_stage = {s: statistics.fmean(b[s] for b in bubbles) for s in bubbles[0]}
    return {
        "span_s": statistics.fmean(_span(evs) for evs in runs),
        "bubble_per_stage": per_stage,
        "bubble": statistics.mean(per_stage.values()),
        "events": events,
    }


def theory_bubble(stages: int, microbatches: int) -> float:
    """Idle share of each stage for P equal stages and M micro-batches: (P-1)/(M+P-1)."""
    return (stages - 1) / (microbatches + stages - 1)


def bubble_over_compute(stages: int, microbatches: int) -> float:
    """The same idle time over the compute instead of over the span: (P-1)/M, as Megatron-LM
    (Narayanan et al., SC'21) and the Ultra-Scale Playbook write it. Both say how much of the
    pipeline's time is lost; (P-1)/(M+P-1) is a share of the step, (P-1)/M the overhead on
    top of the useful work, and (P-1)/M = x / (1 - x) for x = (P-1)/(M+P-1)."""
    return (stages - 1) / microbatches


def costs_at(
    calibration: Mapping[int, ScheduleCosts], global_batch: int, microbatches: int
) -> ScheduleCosts:
    """Costs at ``microbatches`` micro-batches from costs measured at two other counts (runs
    apart from the one predicted): each stage's forward and backward time, and each hand-off,
    as a line in the micro-batch's size (a fixed cost plus a cost per sample) through the two
    measurements; each stage's dispatch gap as their mean (it does not grow with the size).
    The samples of the calibration run whose micro-batch size is nearest are kept, scaled to
    the line, so that ``predict_step`` draws the spread that was measured."""
    if len(calibration) < 2:
        raise ValueError("costs_at needs costs measured at two micro-batch counts")
    (m_a, a), (m_b, b) = sorted(calibration.items())[:2]
    size_a, size_b, size = global_batch / m_a, global_batch / m_b, global_batch / microbatches

    def line(at_a: float, at_b: float) -> float:
        slope = (at_a - at_b) / (size_a - size_b)
        return max(0.0, at_b + slope * (size - size_b))

    fwd = tuple(line(x, y) for x, y in zip(a.forward_s, b.forward_s))
    bwd = tuple(line(x, y) for x, y in zip(a.backward_s, b.backward_s))
    hop = tuple(line(x, y) for x, y in zip(a.handoff_s, b.handoff_s))
    gap = tuple((x + y) / 2 for x, y in zip(a.gap_s, b.gap_s))
    near = a if abs(size_a - size) <= abs(size_b - size) else b
    target = {
        **{("F", s): v for s, v in enumerate(fwd)},
        **{("B", s): v for s, v in enumerate(bwd)},
        **{("hop", i): v for i, v in enumerate(hop)},
        **{("gap", s): v for s, v in enumerate(gap)},
    }
    samples = {}
    for key, values in (near.samples or {}).items():
        mean = statistics.fmean(values) if values else 0.0
        scale = target.get(key, mean) / mean if mean > 0 else 1.0
        samples[key] = tuple(v * scale for v in values)
    return ScheduleCosts(fwd, bwd, hop, gap, samples or None)
