"""Predict a pipeline step by simulating its schedule on measured costs.

The closed form (P-1)/(M+P-1) assumes P equal stages, free hand-offs and no time between one
action and the next. Real stages differ; every hand-off between ranks is a point-to-point message
(~0.2-0.5 ms on gloo here); and every action costs its stage some dispatch (posting a send,
allocating a receive buffer, ~0.1-0.2 ms). Next to a small micro-batch's compute these are not
small. The simulation below keeps the schedule's order and dependencies and charges each action
its stage's duration, each hand-off its boundary's time and each action its stage's dispatch gap,
all measured (``costs_from_steps``), so it predicts the idle share that the closed form cannot.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence



def stage_actions(schedule: str, stages: int, microbatches: int, stage: int) -> list[tuple[str, int]]:
    """The order in which one stage runs its forwards ("F", m) and backwards ("B", m)."""
    M = microbatches
    if schedule in ("gpipe", "model_parallel"):      # all forwards, then all backwards
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if schedule != "1f1b":
        raise ValueError(f"unknown schedule {schedule!r}: choose gpipe, 1f1b or model_parallel")
    # 1F1B: enough forwards to fill the pipe below this stage, then alternate, then drain.
    warmup = min(stages - stage - 1, M)
    actions = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", m) for m in range(M - warmup, M)]


@dataclass(frozen=True)
class ScheduleCosts:
    """Seconds per micro-batch on each stage, and per hand-off across each stage boundary."""

    forward_s: tuple[float, ...]        # one per stage
    backward_s: tuple[float, ...]       # one per stage
    handoff_s: tuple[float, ...]        # one per boundary (stage s <-> s+1), P-1 of them
    gap_s: tuple[float, ...] = ()       # per stage: dispatch between two actions (default 0)

    @property
    def stages(self) -> int:
        return len(self.forward_s)

    @classmethod
    def uniform(cls, stages: int, forward_s: float = 1.0, backward_s: float = 2.0,
                handoff_s: float = 0.0, gap_s: float = 0.0) -> "ScheduleCosts":
        return cls((forward_s,) * stages, (backward_s,) * stages, (handoff_s,) * (stages - 1),
                   (gap_s,) * stages)

    def gap(self, stage: int) -> float:
        return self.gap_s[stage] if self.gap_s else 0.0


def simulate(schedule: str, microbatches: int, costs: ScheduleCosts) -> list[dict]:
    """The events of one step: an action starts once its stage is free (plus its dispatch gap,
    after the stage's first action) and its input (the previous stage's F, or the next stage's
    B) has arrived; arriving costs the boundary's hand-off. ``schedule``: "gpipe", "1f1b" or
    "model_parallel" (GPipe's order with M=1)."""
    P = costs.stages
    queues = [stage_actions(schedule, P, microbatches, s) for s in range(P)]
    done: dict[tuple[str, int, int], float] = {}        # (kind, stage, microbatch) -> end
    free, pos, events = [0.0] * P, [0] * P, []
    while any(pos[s] < len(queues[s]) for s in range(P)):
        progressed = False
        for s in range(P):
            while pos[s] < len(queues[s]):
                kind, m = queues[s][pos[s]]
                if kind == "F":
                    dep, hop = (("F", s - 1, m), costs.handoff_s[s - 1]) if s > 0 else (None, 0.0)
                elif s < P - 1:
                    dep, hop = ("B", s + 1, m), costs.handoff_s[s]
                else:
                    dep, hop = ("F", s, m), 0.0
                if dep is not None and dep not in done:
                    break
                free_at = free[s] + (costs.gap(s) if pos[s] else 0.0)
                start = max(free_at, 0.0 if dep is None else done[dep] + hop)
                end = start + (costs.forward_s[s] if kind == "F" else costs.backward_s[s])
                done[(kind, s, m)] = free[s] = end
                events.append({"stage": s, "microbatch": m, "kind": kind, "start": start,
                               "end": end})
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule!r} deadlocks at positions {pos}")
    return events


def bubble_per_stage(events: Sequence[dict],
                     window: tuple[float, float] | None = None) -> dict[int, float]:
    """Each stage's idle share of the window (default: first event anywhere to last anywhere)."""
    if not events:
        return {}
    lo, hi = window or (min(e["start"] for e in events), max(e["end"] for e in events))
    busy: dict[int, float] = {}
    for e in events:
        busy[e["stage"]] = busy.get(e["stage"], 0.0) + (e["end"] - e["start"])
    return {s: max(0.0, 1.0 - b / (hi - lo)) if hi > lo else 0.0 for s, b in sorted(busy.items())}


def costs_from_steps(steps: Sequence[Sequence[dict]], stages: int) -> ScheduleCosts:
    """Mean costs from measured steps (each a list of every stage's events on one clock).

    Means, not medians: a step's span is a sum of these costs, and a sum's expectation is the
    sum of the means. On a shared CPU one action in several pays a scheduler tick (~1-3 ms);
    a median drops those ticks, while the real span pays them (measured here at width 256 and
    M=8: medians predicted a bubble 0.09 below the measured one; ``experiment.finalize``,
    which predicts each step from that step's mean costs, came within 0.03 at every M).

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
    waits = []                       # (stage, boundary, dep_end, prev_end, start) per action
    for events in steps:
        end = {(e["kind"], e["stage"], e["microbatch"]): e["end"] for e in events}
        for s in range(stages):
            prev_end = None
            for e in sorted((e for e in events if e["stage"] == s), key=lambda e: e["start"]):
                dur.setdefault((s, e["kind"]), []).append(e["end"] - e["start"])
                m, kind = e["microbatch"], e["kind"]
                dep = ("F", s - 1, m) if kind == "F" and s > 0 else \
                      ("B", s + 1, m) if kind == "B" and s < stages - 1 else None
                dep_end = end.get(dep)
                waits.append((s, None if dep is None else min(s, dep[1]), dep_end, prev_end,
                              e["start"]))
                if dep_end is not None and (prev_end is None or dep_end >= prev_end):
                    hop.setdefault(min(s, dep[1]), []).append(e["start"] - dep_end)
                prev_end = e["end"]

    def mean(xs) -> float:
        return max(0.0, statistics.fmean(xs)) if xs else 0.0

    handoff = tuple(mean(hop.get(b)) for b in range(stages - 1))
    for s, boundary, dep_end, prev_end, start in waits:
        if prev_end is not None and (dep_end is None or dep_end + handoff[boundary] <= prev_end):
            gap.setdefault(s, []).append(start - prev_end)
    return ScheduleCosts(tuple(mean(dur.get((s, "F"))) for s in range(stages)),
                         tuple(mean(dur.get((s, "B"))) for s in range(stages)), handoff,
                         tuple(mean(gap.get(s)) for s in range(stages)))


def predict_step(schedule: str, microbatches: int, costs: ScheduleCosts) -> dict:
    """Predicted span of the step's compute, bubble per stage and mean bubble."""
    events = simulate(schedule, microbatches, costs)
    per_stage = bubble_per_stage(events)
    return {"span_s": max(e["end"] for e in events) - min(e["start"] for e in events),
            "bubble_per_stage": per_stage,
            "bubble": statistics.mean(per_stage.values()), "events": events}
