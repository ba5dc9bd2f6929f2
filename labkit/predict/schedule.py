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

from ..pipeline_schedules import chunk_rank, rank_actions, spec  # the executor's order


@dataclass(frozen=True)
class ScheduleCosts:
    """Seconds per micro-batch on each model chunk, and per hand-off across each rank boundary.

    With one chunk per rank (v = 1) a chunk is a stage. A schedule that splits the backward
    (zero bubble) times its input half (I) and weight half (W) apart; where only one of the
    two backward forms was measured, the other is derived (B = I + W; I = W = B / 2)."""

    forward_s: tuple[float, ...]  # one per chunk (P·v)
    backward_s: tuple[float, ...]  # one per chunk: a full backward
    handoff_s: tuple[float, ...]  # one per boundary (rank s <-> s+1), P-1 of them, and a last
    # one for the link between the last rank and the first (interleaving wraps round) if measured
    gap_s: tuple[float, ...] = ()  # per rank: dispatch between two actions (default 0)
    # the measured values behind each mean, keyed ("F", chunk), ("B", chunk), ("I", chunk),
    # ("W", chunk), ("hop", boundary), ("gap", rank); when present, predict_step draws from them
    samples: Mapping[tuple[str, int], tuple[float, ...]] | None = field(
        default=None, compare=False, hash=False
    )
    input_s: tuple[float, ...] = ()  # one per chunk: the backward for the input alone (I)
    weight_s: tuple[float, ...] = ()  # one per chunk: the backward for the weights alone (W)
    virtual: int = 1  # v, model chunks per rank

    @property
    def stages(self) -> int:
        """P, the ranks of the pipeline."""
        return len(self.forward_s) // self.virtual

    @classmethod
    def uniform(
        cls,
        stages: int,
        forward_s: float = 1.0,
        backward_s: float = 2.0,
        handoff_s: float = 0.0,
        gap_s: float = 0.0,
        virtual: int = 1,
        weight_s: float | None = None,
    ) -> ScheduleCosts:
        """Equal chunks; ``weight_s``: the W share of ``backward_s`` (default: half)."""
        n = stages * virtual
        w = backward_s / 2 if weight_s is None else weight_s
        return cls(
            (forward_s,) * n,
            (backward_s,) * n,
            (handoff_s,) * (stages - 1),
            (gap_s,) * stages,
            input_s=(backward_s - w,) * n,
            weight_s=(w,) * n,
            virtual=virtual,
        )

    def mean(self, kind: str, index: int) -> float:
        """The mean cost of one action ("F", "B", "I", "W" of chunk ``index``), hand-off ("hop"
        across boundary ``index``) or dispatch gap ("gap" of rank ``index``; 0 when the costs
        carry none)."""
        if kind == "gap":
            return self.gap_s[index] if self.gap_s else 0.0
        if kind == "hop":
            return _link_handoff(self.handoff_s, index)
        if kind == "I":
            return self.input_s[index] if self.input_s else self.backward_s[index] / 2
        if kind == "W":
            return self.weight_s[index] if self.weight_s else self.backward_s[index] / 2
        return {"F": self.forward_s, "B": self.backward_s}[kind][index]


def _link_handoff(handoff_s: Sequence[float], link: int) -> float:
    """The hand-off across ``link``; a link with no sample of its own (the wrap link when every
    hand-off across it came while its rank was busy) reads as the measured links' mean."""
    if link < len(handoff_s):
        return handoff_s[link]
    return statistics.fmean(handoff_s) if handoff_s else 0.0


def boundary(a: int, b: int, stages: int) -> int:
    """The link a hand-off between ranks ``a`` and ``b`` crosses: neighbours s and s+1 share
    boundary s; the last rank and the first (interleaving wraps round) the extra one, P-1."""
    return min(a, b) if abs(a - b) == 1 else stages - 1


def dependency(kind: str, m: int, chunk: int, last: int) -> tuple[str, int, int] | None:
    """What an action waits for: a forward for the previous chunk's forward; a backward (full
    or input, I) for the next chunk's input gradient ("G", after its B or I), the last chunk's
    for its own forward; W for its own chunk's input gradient."""
    if kind == "F":
        return ("F", chunk - 1, m) if chunk > 0 else None
    if kind == "W":
        return ("G", chunk, m)
    return ("G", chunk + 1, m) if chunk < last else ("F", chunk, m)


def simulate(
    schedule: str, microbatches: int, costs: ScheduleCosts, rng: random.Random | None = None
) -> list[dict]:
    """The events of one step: an action starts once its rank is free (plus its dispatch gap,
    after the rank's first action) and its input (``dependency``) has arrived; arriving from
    another rank costs the boundary's hand-off. ``schedule``: one of
    ``labkit.pipeline_schedules.SCHEDULES`` ("model_parallel": GPipe's order with M=1), with
    ``costs.virtual`` chunks per rank. Every cost is its mean; with ``rng``, each action,
    hand-off and gap draws its own from ``costs.samples`` (one draw of the step)."""
    P, v = costs.stages, costs.virtual
    if spec(schedule).virtual not in (None, v):
        raise ValueError(
            f"{schedule} runs {spec(schedule).virtual} chunks per rank, the costs have {v}: give "
            f"costs with virtual={spec(schedule).virtual}"
        )
    last = P * v - 1
    samples = costs.samples or {}

    def cost(kind: str, index: int) -> float:
        xs = samples.get((kind, index)) if rng is not None else None
        return rng.choice(xs) if xs else costs.mean(kind, index)

    queues = [rank_actions(schedule, P, microbatches, r, v) for r in range(P)]
    done: dict[tuple[str, int, int], float] = {}  # (F / G / W, chunk, microbatch) -> end
    free, pos, events = [0.0] * P, [0] * P, []
    while any(pos[r] < len(queues[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while pos[r] < len(queues[r]):
                kind, m, c = queues[r][pos[r]]
                dep = dependency(kind, m, c, last)
                if dep is not None and dep not in done:
                    break
                src = r if dep is None else chunk_rank(schedule, P, dep[1])
                hop = cost("hop", boundary(src, r, P)) if src != r else 0.0
                free_at = free[r] + (cost("gap", r) if pos[r] else 0.0)
                start = max(free_at, 0.0 if dep is None else done[dep] + hop)
                end = start + cost(kind, c)
                done[("F" if kind == "F" else "W" if kind == "W" else "G", c, m)] = end
                free[r] = end
                events.append(
                    {"stage": r, "chunk": c, "microbatch": m, "kind": kind,
                     "start": start, "end": end}
                )  # fmt: skip
                pos[r] += 1
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
    """Costs from measured steps (each a list of every rank's events on one clock): the mean
    of each, and every sample behind it (``ScheduleCosts.samples``). Events carry their model
    chunk (``chunk``; records from before chunks existed: the stage) and kind (F, B, I, W).

    Means, not medians: on a shared CPU one action in several pays a scheduler tick; a median
    drops those ticks, while the real span pays them (by how much: benchmarks/README.md,
    "Behind the code").

    Two passes over each rank's actions in order. Hand-off samples: an action whose input
    came from another rank and whose rank was idle when that input's producer finished
    waited from that finish to its own start. Dispatch-gap samples: an action whose input had
    arrived (producer's end plus the boundary's mean hand-off) by the time its rank finished
    the previous action waited from that finish to its own start. Actions that waited for
    something else are left out of both.
    """
    dur: dict[tuple[str, int], list[float]] = {}
    hop: dict[int, list[float]] = {}
    gap: dict[int, list[float]] = {}
    waits = []  # (rank, boundary, dep_end, prev_end, start) per action
    chunks = 1 + max((e.get("chunk", e["stage"]) for evs in steps for e in evs), default=0)
    last = max(chunks, stages) - 1
    for events in steps:
        end, rank = {}, {}
        for e in events:
            c = e.get("chunk", e["stage"])
            kind = "F" if e["kind"] == "F" else "W" if e["kind"] == "W" else "G"
            end[kind, c, e["microbatch"]] = e["end"]
            rank[c] = e["stage"]
        for s in range(stages):
            prev_end = None
            for e in sorted((e for e in events if e["stage"] == s), key=lambda e: e["start"]):
                c, m, kind = e.get("chunk", e["stage"]), e["microbatch"], e["kind"]
                dur.setdefault((kind, c), []).append(e["end"] - e["start"])
                dep = dependency(kind, m, c, last)
                dep_end = end.get(dep) if dep is not None else None
                src = rank.get(dep[1], s) if dep is not None else s
                if src == s:  # produced on this rank: no hand-off to wait for
                    waits.append((s, None, dep_end, prev_end, e["start"]))
                else:
                    b = boundary(src, s, stages)
                    waits.append((s, b, dep_end, prev_end, e["start"]))
                    if dep_end is not None and (prev_end is None or dep_end >= prev_end):
                        hop.setdefault(b, []).append(e["start"] - dep_end)
                prev_end = e["end"]

    def mean(xs) -> float:
        return max(0.0, statistics.fmean(xs)) if xs else 0.0

    links = stages - 1 + (stages - 1 in hop and stages > 2)  # the wrap link, where sampled
    handoff = tuple(mean(hop.get(b)) for b in range(links))
    for s, b, dep_end, prev_end, start in waits:
        if prev_end is None:
            continue
        hop_s = _link_handoff(handoff, b) if b is not None else 0.0
        if dep_end is None or dep_end + hop_s <= prev_end:
            gap.setdefault(s, []).append(start - prev_end)
    samples = {
        **{(kind, c): tuple(max(0.0, x) for x in v) for (kind, c), v in dur.items()},
        **{("hop", b): tuple(max(0.0, x) for x in v) for b, v in hop.items()},
        **{("gap", s): tuple(max(0.0, x) for x in v) for s, v in gap.items()},
    }
    n = max(chunks, stages)
    split = any(kind in ("I", "W") for kind, _ in dur)

    def backward(c: int) -> float:  # a full backward; where none ran, its two halves
        if dur.get(("B", c)):
            return mean(dur[("B", c)])
        return mean(dur.get(("I", c))) + mean(dur.get(("W", c)))

    return ScheduleCosts(
        tuple(mean(dur.get(("F", c))) for c in range(n)),
        tuple(backward(c) for c in range(n)),
        handoff,
        tuple(mean(gap.get(s)) for s in range(stages)),
        samples,
        input_s=tuple(
            mean(dur[("I", c)]) if dur.get(("I", c)) else backward(c) / 2 for c in range(n)
        )
        if split
        else (),
        weight_s=tuple(
            mean(dur[("W", c)]) if dur.get(("W", c)) else backward(c) / 2 for c in range(n)
        )
        if split
        else (),
        virtual=max(1, n // stages),
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


def ideal_bubble(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """Each rank's idle share of the step when the schedule's own order runs on equal chunks
    (a forward 1 unit, an input backward I 1 and a weight backward W 1, so a full backward 2),
    free hand-offs and no dispatch: the closed forms' premise, laid out by the simulator.
    GPipe and 1F1B: (P-1)/(M+P-1); interleaved 1F1B: (P-1)/(v·M+P-1) (unit tests hold the
    simulation to both)."""
    if schedule == "model_parallel":
        microbatches = 1
    costs = ScheduleCosts.uniform(stages, 1.0, 2.0, virtual=virtual, weight_s=1.0)
    return predict_step(schedule, microbatches, costs)["bubble"]


def closed_form(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> dict:
    """The published bubble of ``schedule`` as its paper writes it, bubble time / ideal time
    (the time of the M micro-batches' own compute on one rank), at equal F, I, W; and the same
    idle time as a share of the step, idle / (idle + ideal) = x / (1 + x).

    * GPipe, 1F1B: (P-1)/M (Huang et al. 2019; Narayanan et al. 2021, arXiv:2104.04473).
    * interleaved 1F1B: (P-1)/(v·M) (Narayanan et al. 2021, §2.2).
    * zero bubble at v = 1 (ZB-H1): (P-1)(T_F + T_B - T_W) / (M(T_F + T_B + T_W)), with the
      zero-bubble paper's T_B the input half (I here): (P-1)/(3M) at equal times (Qi et al.
      2023, arXiv:2401.10241, §2.1, a third of 1F1B's).
    * ZB-V, DualPipeV, interleaved zero bubble: no closed form for the order torch runs; the
      ``formula`` says so and the values are the order's own in unit time (``ideal_bubble``).
      The ZB-V paper calls ZB-V's bubble zero at equal times: the order still starts its last
      rank after P-1 forwards, (P-1) chunk units of idle, (P-1)/(3·v·M) of the ideal.
    """
    P, M, v = stages, microbatches, virtual
    if schedule == "model_parallel":
        M = 1
    if schedule in ("gpipe", "1f1b", "model_parallel"):
        x, formula = (P - 1) / M, "(P-1)/M"
    elif schedule == "interleaved":
        x, formula = (P - 1) / (v * M), "(P-1)/(v·M)"
    elif schedule == "zb" and v == 1:
        x, formula = (P - 1) / (3 * M), "ZB-H1: (P-1)(F+I-W)/(M(F+I+W)) = (P-1)/(3M)"
    else:
        share = ideal_bubble(schedule, P, M, v)
        return {"over_ideal": share / (1 - share), "share": share,
                "formula": "none published for this order: its unit-time simulation"}  # fmt: skip
    return {"over_ideal": x, "share": x / (1 + x), "formula": formula}


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
    apart from the one predicted): each chunk's forward and backward times, and each hand-off,
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
    inp = tuple(line(x, y) for x, y in zip(a.input_s, b.input_s))
    wgt = tuple(line(x, y) for x, y in zip(a.weight_s, b.weight_s))
    hop = tuple(line(x, y) for x, y in zip(a.handoff_s, b.handoff_s))
    gap = tuple((x + y) / 2 for x, y in zip(a.gap_s, b.gap_s))
    near = a if abs(size_a - size) <= abs(size_b - size) else b
    target = {
        **{("F", c): v for c, v in enumerate(fwd)},
        **{("B", c): v for c, v in enumerate(bwd)},
        **{("I", c): v for c, v in enumerate(inp)},
        **{("W", c): v for c, v in enumerate(wgt)},
        **{("hop", i): v for i, v in enumerate(hop)},
        **{("gap", s): v for s, v in enumerate(gap)},
    }
    samples = {}
    for key, values in (near.samples or {}).items():
        mean = statistics.fmean(values) if values else 0.0
        scale = target.get(key, mean) / mean if mean > 0 else 1.0
        samples[key] = tuple(v * scale for v in values)
    return ScheduleCosts(
        fwd, bwd, hop, gap, samples or None, input_s=inp, weight_s=wgt, virtual=a.virtual
    )
