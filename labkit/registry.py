"""Every strategy labkit runs, in one table: what it is, how many processes, which knobs it takes.

Validation (``RunConfig``), the launcher's process count, the experiment grid, the step-time
predictor, the command line's choices and the charts' colours all read this table; adding a
strategy is one ``Strategy(...)`` row here and one module in ``labkit/strategies/``.

Kinds:

* ``reference``: single-device training, the run every other one is checked against;
* ``data_parallel``: the model replicated (or sharded, ZeRO/FSDP), each rank on its slice of
  the global batch, gradients synchronised every step;
* ``pipeline``: the model cut into stages, one per rank, micro-batches flowing through them;
* ``tensor_parallel``: every layer split across ranks, which all see the same batch;
* ``context_parallel``: the sequence split across ranks, which all see the same batch and hold
  the whole model; attention passes keys and values between them (a ring, or all-to-all);
* ``composed``: two of the above on a 2-D device mesh (data x pipeline, data x tensor), or
  four on one 4-D mesh (``mesh4d``: data x pipeline x context x tensor);
* ``periodic``: ranks train alone for H steps, then average (local SGD, DiLoCo);
* ``asynchronous``: no step-wide synchronisation at all (a parameter server, Hogwild);
* ``expert_parallel``: a mixture of experts' experts spread over the ranks, tokens sent to them
  by all-to-all; the rest of the model data parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = (
    "reference",
    "data_parallel",
    "pipeline",
    "tensor_parallel",
    "context_parallel",
    "composed",
    "periodic",
    "asynchronous",
    "expert_parallel",
)

# knobs of the shared training loop (labkit.rank.loop): every strategy that runs it takes them
LOOP = frozenset(
    {"precision", "activation_checkpointing", "checkpoint_dir", "checkpoint_every", "profile_dir"}
)
# several micro-batches per optimizer step: the loops whose step is one global batch
ACCUMULATE = frozenset({"accumulate", "sync_every_microstep"})
# a straggler alone (slowdown): the sync vs async lab's modes, timed against each other
STRAGGLER = frozenset({"slowdown"})
# stragglers, data skew and shares that follow them (labkit.rank.balancer)
BALANCING = frozenset({"slowdown", "skew", "rebalance", "rebalance_every"})
PIPELINE = frozenset({"stages", "microbatches", "pipeline_impl", "balance_stages"})
VIRTUAL = PIPELINE | {"virtual_stages"}  # pipelines that put several model chunks on a rank
TENSOR = frozenset({"tp", "sequence_parallel"})
CONTEXT = frozenset({"cp", "cp_layout"})  # the sequence split (labkit.strategies.cp)
# a mixture of experts in the transformer (labkit.moe): what trains it the same everywhere
MOE = frozenset({"experts", "top_k", "capacity_factor", "aux_loss", "router_skew", "expert_groups"})


@dataclass(frozen=True)
class Strategy:
    name: str
    module: str  # labkit.strategies.<module> holds its run(cfg, ctx, fns)
    kind: str
    one_process: bool = False  # True: one process drives every device (DataParallel)
    knobs: frozenset = frozenset()  # RunConfig fields beyond the common ones that it reads
    schedule: str | None = None  # pipelines: the schedule labkit.predict.schedule simulates
    # data parallel: what each rank shards, as ZeRO's stages (0: nothing, every rank holds the
    # whole model and optimizer; 1: the optimizer state; 3: parameters, gradients and state)
    zero_stage: int | None = None
    # how the step predictor (labkit.predict.step) times its gradient average: "buckets" (DDP's
    # reducer, all-reduces overlapped with backward) or "per_tensor" (one per gradient, after it)
    grad_sync: str | None = None
    joinable: bool = False  # trains uneven inputs under torch's Join (rebalance="join")
    server: bool = False  # rank 0 serves the parameters, the other ranks train
    shared_memory: bool = False  # every rank updates one model in host memory (CPU only)
    dtensor: bool = False  # its layers are DTensors placed by torch's parallelize_module
    heads_split: bool = False  # context parallel by all-to-all: each rank attends with whole heads
    float32_only: str = ""  # why its algorithm needs float32 tensors (check cannot use float64)
    # the DeviceMesh's dimensions it lays the ranks on, outermost first: each degree it takes
    # (tp, cp, stages) is one dimension, an unset one 1, and "dp" takes the ranks left over
    mesh: tuple = ()
    colour: str = "#9e9e9e"  # in every chart that compares strategies
    summary: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")

    @property
    def data_parallel(self) -> bool:
        """Ranks on slices of one global batch, synchronising gradients every step (the
        strategies that may synchronise batch statistics too)."""
        return self.kind == "data_parallel" and not self.one_process

    @property
    def reference(self) -> bool:
        """Single-device training: the run every other one is checked and timed against."""
        return self.kind == "reference"

    @property
    def replicated(self) -> bool:
        """Data parallel over processes with every rank holding the whole model and optimizer:
        rank 0's checkpoint is the whole state, so a job can resume at another world size."""
        return self.data_parallel and self.zero_stage == 0


# fmt: off
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("single", "single", "reference", one_process=True, knobs=LOOP | ACCUMULATE | MOE,
                 zero_stage=0, colour="#9e9e9e", summary="one device, the reference"),
        Strategy("dataparallel", "dataparallel", "data_parallel", one_process=True,
                 knobs=LOOP | ACCUMULATE, zero_stage=0, colour="#72b7b2",
                 summary="nn.DataParallel: one process, the batch split over its devices"),
        Strategy("ddp", "ddp", "data_parallel",
                 knobs=LOOP | ACCUMULATE | BALANCING | MOE
                 | {"bucket_cap_mb", "comm_hook", "powersgd_rank", "sync_batchnorm"},
                 zero_stage=0, grad_sync="buckets",
                 colour="#4c78a8", summary="DistributedDataParallel: overlapped bucket all-reduce"),
        Strategy("ddp_naive", "ddp_naive", "data_parallel",
                 knobs=LOOP | ACCUMULATE | BALANCING | MOE | {"sync_batchnorm"}, zero_stage=0,
                 grad_sync="per_tensor", joinable=True, colour="#f58518",
                 summary="data parallelism by hand: all-reduce every gradient after backward"),
        Strategy("zero1", "zero1", "data_parallel",
                 knobs=LOOP | ACCUMULATE | {"bucket_cap_mb", "sync_batchnorm"}, zero_stage=1,
                 colour="#54a24b",
                 summary="ZeRO stage 1: DDP with the optimizer state partitioned"),
        Strategy("fsdp", "fsdp", "data_parallel", knobs=LOOP | ACCUMULATE | {"sync_batchnorm"},
                 zero_stage=3, colour="#e45756",
                 summary="FSDP2: parameters, gradients and state sharded"),
        Strategy("hsdp", "hsdp", "data_parallel",
                 knobs=LOOP | ACCUMULATE | {"sync_batchnorm", "shard_size"}, zero_stage=3,
                 colour="#ff7f0e",
                 summary="HSDP: FSDP2 within shard groups, replicated across them (2-D mesh)"),
        Strategy("model_parallel", "model_parallel", "pipeline", knobs=PIPELINE,
                 schedule="model_parallel", colour="#b279a2",
                 summary="layers across ranks, one micro-batch: one stage busy at a time"),
        Strategy("pipeline_gpipe", "pipeline", "pipeline", knobs=PIPELINE, schedule="gpipe",
                 colour="#ff9da6", summary="GPipe: all forwards, then all backwards"),
        Strategy("pipeline_1f1b", "pipeline", "pipeline", knobs=PIPELINE, schedule="1f1b",
                 colour="#9d755d", summary="1F1B: one forward, one backward, at most P in flight"),
        # several model chunks per rank (virtual stages): labkit.pipeline_schedules
        Strategy("pipeline_interleaved", "pipeline", "pipeline", knobs=VIRTUAL,
                 schedule="interleaved", colour="#8c6d31",
                 summary="interleaved 1F1B: v chunks per rank, the bubble v times smaller"),
        Strategy("pipeline_zb", "pipeline", "pipeline", knobs=VIRTUAL, schedule="zb",
                 colour="#e7969c",
                 summary="zero bubble (ZB-H1 at v=1): backward split, W fills the bubble"),
        Strategy("pipeline_zbv", "pipeline", "pipeline", knobs=VIRTUAL, schedule="zbv",
                 colour="#ad494a", summary="ZB-V: two chunks per rank in a V, W fills the bubble"),
        Strategy("pipeline_dualpipev", "pipeline", "pipeline", knobs=VIRTUAL,
                 schedule="dualpipev", colour="#7b4173",
                 summary="DualPipeV: DeepSeek's DualPipe in a V, forwards paired with backwards"),
        Strategy("tp", "tp", "tensor_parallel", knobs=LOOP | ACCUMULATE | TENSOR,
                 colour="#aec7e8",
                 summary="tensor parallelism by hand (Megatron): every layer split"),
        Strategy("tp_dtensor", "tp_dtensor", "tensor_parallel",
                 knobs=LOOP | ACCUMULATE | TENSOR, dtensor=True, colour="#ffbb78",
                 summary="the same split through DTensor's parallelize_module"),
        Strategy("dp_tp", "dp_tp", "composed", knobs=LOOP | ACCUMULATE | TENSOR,
                 colour="#98df8a", summary="data x tensor: dp replicas of a tp group, 2-D mesh"),
        Strategy("fsdp_tp", "fsdp_tp", "composed", knobs=LOOP | ACCUMULATE | TENSOR,
                 zero_stage=3, dtensor=True, colour="#637939",
                 summary="FSDP x TP: each layer split over tp ranks, FSDP2 across the groups"),
        Strategy("dp_pp", "dp_pp", "composed", knobs=PIPELINE - {"pipeline_impl"},
                 schedule="1f1b", colour="#17becf",
                 summary="data x pipeline: dp copies of a 1F1B pipeline on a 2-D mesh"),
        Strategy("cp", "cp", "context_parallel", knobs=CONTEXT, colour="#c5b0d5",
                 summary="context parallelism: the sequence split, ring attention by hand"),
        Strategy("cp_ulysses", "cp_ulysses", "context_parallel", knobs=CONTEXT,
                 heads_split=True, colour="#c49c94",
                 summary="context parallelism by all-to-all over heads (DeepSpeed-Ulysses)"),
        Strategy("dp_cp", "dp_cp", "composed", knobs=CONTEXT, colour="#bcbd22",
                 summary="data x context: dp replicas of a cp ring, 2-D mesh"),
        Strategy("mesh4d", "mesh4d", "composed",
                 knobs=PIPELINE - {"pipeline_impl", "balance_stages"} | CONTEXT | MOE
                 | {"tp", "ep"},
                 schedule="1f1b", mesh=("pp", "dp", "cp", "tp"), colour="#5254a3",
                 summary="data x pipeline x context x tensor on one 4-D mesh, 1F1B between "
                 "stages"),
        Strategy("local_sgd", "local_sgd", "periodic", knobs=LOOP | STRAGGLER | {"period"},
                 colour="#eeca3b", summary="local SGD: H steps alone, then average parameters"),
        Strategy("diloco", "diloco", "periodic",
                 knobs=LOOP | STRAGGLER | {"period", "inner_lr", "outer_lr", "outer_momentum"},
                 colour="#bab0ac", summary="DiLoCo: inner AdamW, outer Nesterov on the average"),
        Strategy("async_ps", "async_ps", "asynchronous", knobs=LOOP | STRAGGLER | {"staleness_lr"},
                 server=True,
                 float32_only="async_ps's messages (parameters, gradients) are float32 tensors",
                 colour="#d62728", summary="a parameter server: workers push, never wait"),
        Strategy("hogwild", "hogwild", "asynchronous", knobs=LOOP | STRAGGLER, shared_memory=True,
                 float32_only="hogwild's ranks share one float32 buffer of parameters",
                 colour="#8c564b",
                 summary="Hogwild: one shared-memory model, updated without locks"),
        Strategy("ep", "ep", "expert_parallel", knobs=MOE | {"ep", "precision", "profile_dir"},
                 colour="#393b79",
                 summary="expert parallelism: experts over the ranks, tokens sent by all-to-all"),
    )
}
# fmt: on

# the reference every strategy is checked against (the one strategy of kind "reference")
REFERENCE = next(n for n, s in STRATEGIES.items() if s.reference)
# the sync vs async lab's modes: DDP, its synchronous reference, then the rest
SYNC_ASYNC = ("ddp",) + tuple(
    n for n, s in STRATEGIES.items() if s.kind in ("periodic", "asynchronous")
)


def get(name: str) -> Strategy:
    """The registry row of ``name``, or a ValueError listing every strategy."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def names(kind: str | None = None, *, knob: str | None = None) -> tuple[str, ...]:
    """Strategy names, optionally only one kind or only those that take ``knob``."""
    return tuple(
        n
        for n, s in STRATEGIES.items()
        if (kind is None or s.kind == kind) and (knob is None or knob in s.knobs)
    )


PIPELINES = names("pipeline")
# every strategy that cuts the model into stages (pipelines, and data x pipeline)
STAGED = tuple(n for n, s in STRATEGIES.items() if s.schedule is not None)
DATA_PARALLEL = tuple(n for n, s in STRATEGIES.items() if s.data_parallel)
