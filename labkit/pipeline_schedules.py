"""The pipeline schedules: the order in which each rank runs its forwards and backwards.

One definition, read by the executor that runs it (``labkit.strategies.pipeline``) and by the
simulator that predicts its bubble (``labkit.predict.schedule``), so a prediction is of the
schedule that ran. It sits below both in the layers: the order is a fact about the schedule,
neither a strategy nor a prediction.

An action is ``(kind, micro-batch, chunk)``. The model is cut into P·v **chunks** (virtual
stages), v per rank; with v = 1 a chunk is a stage and its index the rank's. Kinds: ``F`` a
forward; ``B`` a full backward; ``I`` the backward for the chunk's *input* alone and ``W`` the
backward for its *weights* (the zero-bubble split: only I is on the critical path between ranks).

* GPipe (Huang et al. 2019, arXiv:1811.06965): every stage runs all M forwards, then all M
  backwards, and holds the activations of all M micro-batches until their backward.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv:2006.09503): stage s runs P - s - 1
  forwards to fill the pipe below it, then alternates one forward and one backward, then
  drains; it holds at most P - s micro-batches. The same bubble as GPipe, less memory.
* model parallelism: GPipe's order with one micro-batch.
* interleaved 1F1B (Narayanan et al. 2021, arXiv:2104.04473, §2.2): v chunks per rank, chunk c
  on rank c mod P; micro-batches go round the ranks in groups of P, each group through a
  rank's chunks in turn. The bubble, counted in a chunk's (1/v of a stage's) time, shrinks v
  times: (P-1)/(v·M) of the ideal time. labkit writes this order itself (``_interleaved``);
  ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` runs the same one (a unit test
  compares them).
* zero bubble, ``zb`` (Qi et al. 2023, arXiv:2401.10241): the backward split into I and W; W
  waits, filling the bubble (ZB-H1 at v = 1; torch's ``ScheduleInterleavedZeroBubble``, ZB1P).
* ``zbv``: the paper's ZB-V, two chunks per rank in a V (rank r holds chunks r and 2P-1-r, so
  rank 0 holds the first and the last; ``ScheduleZBVZeroBubble``).
* ``dualpipev``: DeepSeek-V3's DualPipe (DeepSeek-AI 2024, arXiv:2412.19437) in its V-shaped
  form: the same V placement, a forward of one chunk paired with a backward of the other
  (``ScheduleDualPipeV``; torch runs each pair one after the other on CPU).

For the last three labkit does not re-type torch's order: ``torch_actions`` builds torch's own
schedule object on stand-in stages (no process group is needed to plan) and reads the compute
actions it would run, after torch's lowering (``pipeline_order_with_comms``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

Action = tuple[str, int, int]  # (kind "F"/"B"/"I"/"W", micro-batch, chunk)


@dataclass(frozen=True)
class Spec:
    """What a schedule needs: where its chunks sit, who runs it, what it asks of P, M, v."""

    placement: str  # "stage": one chunk per rank; "loop": chunk c on rank c % P; "v": a V
    torch_class: str  # torch.distributed.pipelining's class
    scratch: bool  # labkit's own executor runs it too (pipeline_impl="scratch")
    virtual: int | None = 1  # chunks per rank it requires (None: any, RunConfig.virtual_stages)
    default_virtual: int = 1  # when virtual_stages is left unset
    splits_backward: bool = False  # its backward may be split into I and W
    groups_of_stages: bool = False  # M must be a multiple of P (micro-batches go in groups of P)
    min_microbatches: str = ""  # "2P": at least as many micro-batches as chunks


SPECS: dict[str, Spec] = {
    "gpipe": Spec("stage", "ScheduleGPipe", True),
    "1f1b": Spec("stage", "Schedule1F1B", True),
    "model_parallel": Spec("stage", "ScheduleGPipe", True),
    "interleaved": Spec("loop", "ScheduleInterleaved1F1B", True, None, 2, groups_of_stages=True),
    "zb": Spec(
        "loop",
        "ScheduleInterleavedZeroBubble",
        False,
        None,
        1,
        splits_backward=True,
        groups_of_stages=True,
    ),
    "zbv": Spec("v", "ScheduleZBVZeroBubble", False, 2, 2, splits_backward=True),
    "dualpipev": Spec(
        "v", "ScheduleDualPipeV", False, 2, 2, splits_backward=True, min_microbatches="2P"
    ),
}
SCHEDULES = tuple(SPECS)


def spec(schedule: str) -> Spec:
    if schedule not in SPECS:
        raise ValueError(f"unknown schedule {schedule!r}: choose {', '.join(SCHEDULES)}")
    return SPECS[schedule]


def chunks_per_rank(schedule: str, virtual_stages: int | None = None) -> int:
    """v: the schedule's fixed count, else ``virtual_stages``, else its default."""
    s = spec(schedule)
    return s.virtual or virtual_stages or s.default_virtual


def chunk_rank(schedule: str, stages: int, chunk: int) -> int:
    """The rank (pipeline position) that holds model chunk ``chunk``."""
    placement = spec(schedule).placement
    if placement == "v":
        return chunk if chunk < stages else 2 * stages - 1 - chunk
    return chunk % stages


def rank_chunks(schedule: str, stages: int, virtual: int, rank: int) -> list[int]:
    """The model chunks rank ``rank`` holds, in order."""
    return [c for c in range(stages * virtual) if chunk_rank(schedule, stages, c) == rank]


def stage_actions(
    schedule: str, stages: int, microbatches: int, stage: int
) -> list[tuple[str, int]]:
    """The order in which one stage runs its forwards ("F", m) and backwards ("B", m): the
    one-chunk-per-rank schedules (GPipe, 1F1B, model parallelism)."""
    M = microbatches
    if schedule in ("gpipe", "model_parallel"):  # all forwards, then all backwards
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]
    if schedule != "1f1b":
        raise ValueError(
            f"stage_actions orders gpipe, 1f1b and model_parallel; {schedule!r} puts several "
            f"chunks on a rank: use rank_actions"
        )
    # 1F1B: enough forwards to fill the pipe below this stage, then alternate, then drain.
    warmup = min(stages - stage - 1, M)
    actions = [("F", m) for m in range(warmup)]
    for i in range(M - warmup):
        actions += [("F", warmup + i), ("B", i)]
    return actions + [("B", m) for m in range(M - warmup, M)]


def rank_actions(
    schedule: str, stages: int, microbatches: int, rank: int, virtual: int = 1
) -> list[Action]:
    """The order in which rank ``rank`` runs its actions ``(kind, micro-batch, chunk)``."""
    s = spec(schedule)
    if s.placement == "stage":
        return [(k, m, rank) for k, m in stage_actions(schedule, stages, microbatches, rank)]
    if schedule == "interleaved":
        return _interleaved(stages, microbatches, virtual, rank)
    return list(torch_actions(schedule, stages, microbatches, virtual)[rank])


def _interleaved(P: int, M: int, v: int, rank: int) -> list[Action]:
    """Interleaved 1F1B as Narayanan et al. (2021) lay it out (Megatron-LM's order).

    This rank's k-th forward runs chunk (k // P) mod v of its own on micro-batch
    (k // (P·v))·P + k mod P: P micro-batches through one chunk, then the same P through the
    next. Its k-th backward takes the chunks in the reverse order. Warm-up: the forwards that
    fill the pipe below this rank, (P - rank - 1)·2, plus one group of P for every chunk but
    the last, (v - 1)·P; then one forward, one backward; then the remaining backwards."""
    total = M * v  # this rank's forwards, and its backwards

    def chunk(k: int, backward: bool) -> int:
        local = (k // P) % v
        return (v - 1 - local if backward else local) * P + rank

    def micro(k: int) -> int:
        return (k // (P * v)) * P + k % P

    forwards = [("F", micro(k), chunk(k, False)) for k in range(total)]
    backwards = [("B", micro(k), chunk(k, True)) for k in range(total)]
    warmup = min((P - rank - 1) * 2 + (v - 1) * P, total)
    actions = forwards[:warmup]
    for i in range(total - warmup):
        actions += [forwards[warmup + i], backwards[i]]
    return actions + backwards[total - warmup :]


# ---- torch's own order ------------------------------------------------------------------------


class _StandIn:
    """What a torch schedule reads of a stage while it plans (no module, no process group)."""

    def __init__(self, chunk: int, chunks: int, stages: int, rank: int):
        self.stage_index, self.num_stages = chunk, chunks
        self.group_size, self.group_rank = stages, rank
        self.is_first, self.is_last = chunk == 0, chunk == chunks - 1
        self.submod = None


def torch_schedule_class(schedule: str):
    from torch.distributed.pipelining import schedules

    return getattr(schedules, spec(schedule).torch_class)


def compute_actions(lowered) -> list[Action]:
    """The compute actions of one rank's torch ``_Action`` list, in the order it runs them:
    torch's ``OVERLAP_F_B`` pairs (DualPipeV) are run one sub-action after the other on CPU."""
    out = []
    for a in lowered:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):
            kind = sub.computation_type.value
            if kind in ("F", "B", "I", "W"):
                out.append((kind, int(sub.microbatch_index), int(sub.stage_index)))
    return out


@lru_cache(maxsize=64)
def torch_actions(
    schedule: str, stages: int, microbatches: int, virtual: int
) -> dict[int, tuple[Action, ...]]:
    """Every rank's compute actions as torch's schedule object for ``schedule`` plans them:
    the object is built on stand-in stages of rank 0 (every rank plans all ranks' orders) and
    its lowered order (``pipeline_order_with_comms``, what ``step`` runs) read back."""
    cls = torch_schedule_class(schedule)
    P, v = stages, chunks_per_rank(schedule, virtual)
    mine = rank_chunks(schedule, P, v, 0)
    stand_ins = [_StandIn(c, P * v, P, 0) for c in mine]
    sched = cls(stand_ins if cls.__name__ not in _SINGLE else stand_ins[0], microbatches)
    lowered = getattr(sched, "pipeline_order_with_comms", None) or sched.pipeline_order
    return {r: tuple(compute_actions(lowered[r])) for r in range(P)}


_SINGLE = ("ScheduleGPipe", "Schedule1F1B")  # one stage per rank: built on the stage itself


def implementation(schedule: str, impl: str) -> str:
    """The executor that runs ``schedule`` under ``pipeline_impl=impl``: "auto" is labkit's own
    where it has the schedule, else torch's."""
    if impl != "auto":
        return impl
    return "scratch" if spec(schedule).scratch else "torch"


# ---- what a configuration must satisfy -------------------------------------------------------


def check(
    name: str,
    schedule: str,
    stages: int,
    microbatches: int,
    virtual_stages: int | None,
    layers: int,
    impl: str,
) -> None:
    """Raise a ValueError naming the fix when strategy ``name``'s ``schedule`` cannot run
    P = ``stages``, M = ``microbatches``, v = ``virtual_stages`` on a model of ``layers``
    blocks with ``impl``."""
    s, P, M = spec(schedule), stages, microbatches
    if s.virtual is not None and virtual_stages not in (None, s.virtual):
        raise ValueError(
            f"{name} puts exactly {s.virtual} model chunk(s) on each rank: set "
            f"virtual_stages={s.virtual} or leave it unset (got {virtual_stages})"
        )
    v = chunks_per_rank(schedule, virtual_stages)
    if v < 1:
        raise ValueError(f"virtual_stages must be at least 1, got {v}")
    if implementation(schedule, impl) == "scratch" and not s.scratch:
        runs = ", ".join(n for n, x in SPECS.items() if x.scratch)
        raise ValueError(
            f"{name} runs torch.distributed.pipelining's {s.torch_class}; labkit's own "
            f"executor runs {runs}: set pipeline_impl='torch'"
        )
    if s.placement != "stage" and P < 2:
        raise ValueError(f"{name} passes chunks between ranks: set stages to 2 or more")
    if P * v > layers:
        raise ValueError(
            f"{name} cuts the model into P·v = {P}·{v} = {P * v} chunks, but it has {layers} "
            f"blocks: raise depth (blocks = depth + 1) or lower stages or virtual_stages"
        )
    if s.groups_of_stages and M % P:
        raise ValueError(
            f"{name} sends micro-batches round the ranks in groups of P: microbatches "
            f"M={M} is not a multiple of stages P={P}: set microbatches to a multiple of {P}"
        )
    if s.min_microbatches == "2P" and M < 2 * P:
        raise ValueError(
            f"{name} needs at least as many micro-batches as chunks (2P = {2 * P}): set "
            f"microbatches to {2 * P} or more (got {M})"
        )
