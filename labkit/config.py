"""RunConfig: the one frozen, validated description of a run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Strategy name -> how many rank processes it runs on. "one" strategies run in a single process
# (DataParallel drives several devices from one process); "world" ones run one rank per worker.
STRATEGY_RANKS = {
    "single": "one",
    "dp": "one",
    "ddp": "world",
    "ddp_naive": "world",
    "model_parallel": "world",
    "pipeline_gpipe": "world",
    "pipeline_1f1b": "world",
    "zero1": "world",
    "fsdp": "world",
    "local_sgd": "world",
    "diloco": "world",
    "async_ps": "world",
    "hogwild": "world",
}
PIPELINE_STRATEGIES = ("model_parallel", "pipeline_gpipe", "pipeline_1f1b")
DATA_PARALLEL = ("ddp", "ddp_naive", "zero1", "fsdp")  # may synchronise batch statistics
MODELS = ("mlp", "cnn", "unbalanced_mlp")
DEVICES = ("auto", "cpu", "cuda")
PIPELINE_IMPLS = ("scratch", "torch")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
REBALANCE = ("static", "dynamic", "join")
# the synchronous vs asynchronous lab's modes (ddp is its synchronous reference)
SYNC_ASYNC = ("ddp", "local_sgd", "diloco", "async_ps", "hogwild")


@dataclass(frozen=True)
class RunConfig:
    """Everything that describes one run; sweep with ``dataclasses.replace``."""

    strategy: str = "ddp"
    world_size: int = 2  # ranks (DDP, pipeline) or devices (DataParallel); 1 for single
    steps: int = 20  # measured optimizer steps per rank
    warmup: int = 2  # unmeasured steps first (allocator, thread pools, gloo pairs)
    global_batch: int = 64  # samples per optimizer step, summed over all ranks
    lr: float = 0.05
    seed: int = 0  # model init and data order; same seed -> same run on any strategy

    model: str = "mlp"
    in_features: int = 32
    width: int = 256
    depth: int = 4  # hidden layers
    classes: int = 10
    dataset_size: int = 4096

    device: str = "auto"  # auto: one GPU per rank if there are enough, else CPU processes
    backend: str | None = None  # None: nccl on GPUs, gloo on CPU
    threads: int | None = None  # torch threads per rank; None: cores // ranks (never oversubscribe)

    stages: int = 2  # pipeline depth P (pipeline strategies put one stage per rank)
    microbatches: int = 4  # M micro-batches per step (pipeline strategies)
    pipeline_impl: str = (
        "scratch"  # "scratch": labkit's own schedule; "torch": torch.distributed.pipelining
    )
    balance: bool = False  # partition stages by measured layer cost instead of layer count

    # ---- communication (labkit.comm, notebook 03); accumulation is a knob of the shared loop
    bucket_cap_mb: float | None = None  # ddp: None = DDP's default (25 MB buckets, the first 1 MiB)
    accumulate: int = 1  # micro-batches per optimizer step (single, dp, ddp, ddp_naive)
    sync_every_microstep: bool = False  # accumulate > 1: all-reduce after every micro-batch
    comm_hook: str = "none"  # ddp: "fp16" / "bf16" compression, or "powersgd"
    powersgd_rank: int = 1  # comm_hook="powersgd": matrix approximation rank

    # ---- load balancing (labkit.balance, notebook 04). Knobs of ddp_naive: its gradient sync
    # runs after backward, so each rank can time how long it waits there for the slowest one.
    slowdown: tuple = ()  # "1:2" or ((rank, factor, from_step), ...): rank 1 computes 2x slower
    skew: float = 0.0  # data skew: the last rank holds (1 + skew)x the first rank's samples
    rebalance: str = "static"  # "dynamic": shares follow measured throughput; "join": uneven inputs
    rebalance_every: int = 4  # dynamic: measured steps between share updates

    # ---- equivalence and your own model (labkit.equivalence, labkit.factories)
    sync_batchnorm: bool = False  # ddp/ddp_naive: batch statistics over the global batch (SyncBN)
    deterministic: bool = False  # check mode: no TF32, deterministic kernels, return final state
    timeout_s: float = 300.0  # a launch (and every collective) gives up after this long

    # ---- elastic (labkit.checkpoint, labkit.elastic, notebook 07)
    checkpoint_dir: str | None = None  # resume from the checkpoint here, and write one to it
    checkpoint_every: int = 0  # optimizer steps between checkpoints (0: after the last step only)
    pace_s: float = 0.0  # each step lasts at least this long (sleeps the rest, outside
    # step_s): a bigger model's pace, so a demo has time to act
    # ---- memory and mixed precision (labkit.memory, labkit.precision, notebook 05): knobs of
    # the shared loop (single, dp, ddp, ddp_naive, zero1, fsdp)
    precision: str = "fp32"  # "bf16" / "fp16": torch.autocast (fp16 with a GradScaler)
    checkpoint: bool = False  # ACTIVATION checkpointing (not saving runs): each block keeps
    # only its input and recomputes the rest during backward
    # ---- synchronous vs asynchronous training (labkit.sync_async, notebook 06)
    period: int = 4  # local_sgd / diloco: local steps H between averaging rounds
    inner_lr: float = 1e-3  # diloco: the inner AdamW's learning rate
    outer_lr: float = 0.7  # diloco: outer Nesterov SGD on the averaged parameter delta
    outer_momentum: float = 0.9  # diloco: the outer step's Nesterov momentum
    staleness_lr: bool = False  # async_ps: an update s versions stale uses lr / max(1, s)

    def __post_init__(self) -> None:
        from .balance import parse_slowdown  # "1:2,0:1.5@10" or pairs -> triples

        object.__setattr__(self, "slowdown", parse_slowdown(self.slowdown))
        if self.strategy not in STRATEGY_RANKS:
            raise ValueError(
                f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGY_RANKS)}"
            )
        for name in (
            "world_size",
            "steps",
            "global_batch",
            "in_features",
            "width",
            "depth",
            "classes",
            "dataset_size",
            "stages",
            "microbatches",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}: pick a learning rate like 0.05")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.model not in MODELS:
            raise ValueError(f"unknown model {self.model!r}: choose one of {', '.join(MODELS)}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.backend not in (None, "gloo", "nccl", "mpi"):
            raise ValueError(f"backend must be gloo, nccl, mpi or None, got {self.backend!r}")
        if self.pipeline_impl not in PIPELINE_IMPLS:
            raise ValueError(
                f"pipeline_impl must be one of {PIPELINE_IMPLS}, got {self.pipeline_impl!r}"
            )
        if self.strategy == "single" and self.world_size != 1:
            raise ValueError(f"single runs on one device: set world_size=1 (got {self.world_size})")
        if self.accumulate < 1:
            raise ValueError(f"accumulate must be at least 1, got {self.accumulate}")
        if self.comm_hook not in COMM_HOOKS:
            raise ValueError(
                f"comm_hook must be one of {', '.join(COMM_HOOKS)}, got {self.comm_hook!r}"
            )
        if self.comm_hook != "none" and self.strategy != "ddp":
            raise ValueError(
                f"comm_hook={self.comm_hook!r} is a DDP communication hook: set "
                f"strategy='ddp' (got {self.strategy!r}) or comm_hook='none'"
            )
        if self.powersgd_rank < 1:
            raise ValueError(f"powersgd_rank must be at least 1, got {self.powersgd_rank}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be positive or None (DDP's default), got {self.bucket_cap_mb}"
            )
        if self.strategy in PIPELINE_STRATEGIES:
            if self.accumulate != 1:
                raise ValueError(
                    f"{self.strategy} already splits each step into micro-batches: "
                    f"set microbatches instead of accumulate (got accumulate="
                    f"{self.accumulate})"
                )
            if self.world_size != self.stages:
                raise ValueError(
                    f"{self.strategy} puts one stage on each rank: set world_size == stages "
                    f"(got world_size={self.world_size}, stages={self.stages})"
                )
            if self.global_batch % self.microbatches:
                raise ValueError(
                    f"global batch {self.global_batch} is not divisible by {self.microbatches} "
                    f"micro-batches: pick a batch that is a multiple of microbatches"
                )
            if self.stages > self.depth + 1:
                raise ValueError(
                    f"a {self.model} of depth {self.depth} has {self.depth + 1} layers, too few "
                    f"for {self.stages} stages: raise depth or lower stages"
                )
        elif self.global_batch % self.data_ranks:
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by "
                + (
                    f"{self.data_ranks} workers"
                    if self.strategy == "async_ps"
                    else f"world size {self.world_size}"
                )
                + f": pick a global batch that is a multiple of {self.data_ranks}"
            )
        elif self.global_batch % (self.data_ranks * self.accumulate):
            raise ValueError(
                f"global batch {self.global_batch} does not split into {self.accumulate} "
                f"micro-batches on each of {self.data_ranks} rank(s): pick a global batch that is "
                f"a multiple of {self.data_ranks * self.accumulate}"
            )
        self._check_balancing()
        self._check_elastic()
        self._check_memory()
        self._check_sync_async()
        if self.dataset_size < self.global_batch:
            raise ValueError(
                f"dataset_size {self.dataset_size} is smaller than one global batch "
                f"({self.global_batch}): raise dataset_size or lower global_batch"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1 or None, got {self.threads}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")

    def _check_balancing(self) -> None:
        if self.rebalance not in REBALANCE:
            raise ValueError(
                f"rebalance must be one of {', '.join(REBALANCE)}, got {self.rebalance!r}"
            )
        if self.rebalance_every < 1:
            raise ValueError(f"rebalance_every must be at least 1, got {self.rebalance_every}")
        if not self.skew >= 0:
            raise ValueError(
                f"skew must be >= 0 (the last rank holds 1 + skew times the first "
                f"rank's samples), got {self.skew}"
            )
        if not self.balancing:
            return
        # the sync/async lab's modes take a straggler (slowdown alone: no skew, no rebalancing)
        straggler_only = self.skew == 0 and self.rebalance == "static"
        if self.strategy != "ddp_naive" and not (straggler_only and self.strategy in SYNC_ASYNC):
            raise ValueError(
                f"slowdown, skew and rebalance are knobs of ddp_naive, whose gradient sync runs "
                f"after backward, where labkit times each rank's wait for the slowest one (DDP "
                f"hides that wait inside its overlapped backward): set strategy='ddp_naive' "
                f"(got {self.strategy!r}); a straggler alone (slowdown) also works on "
                f"{', '.join(SYNC_ASYNC)}"
            )
        if self.accumulate != 1:
            raise ValueError(
                f"load balancing changes each rank's share of every step: set "
                f"accumulate=1 (got {self.accumulate})"
            )
        for rank, _, _ in self.slowdown:
            if rank >= self.world_size:
                raise ValueError(
                    f"slowdown names rank {rank}, but world size {self.world_size} "
                    f"has ranks 0..{self.world_size - 1}"
                )
        if self.global_batch < 2 * self.world_size and self.rebalance == "dynamic":
            raise ValueError(
                f"dynamic shares need at least 2 samples per rank: raise global_batch "
                f"to {2 * self.world_size} or more"
            )

    def _check_elastic(self) -> None:
        if not self.pace_s >= 0:
            raise ValueError(f"pace_s must be >= 0 seconds, got {self.pace_s}")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every must be >= 0 (0: after the last step only), got "
                f"{self.checkpoint_every}"
            )
        if self.checkpoint_dir is None:
            if self.checkpoint_every:
                raise ValueError(
                    f"checkpoint_every={self.checkpoint_every} needs a folder: set checkpoint_dir"
                )
            return
        if not isinstance(self.checkpoint_dir, str) or not self.checkpoint_dir:
            raise ValueError(
                f"checkpoint_dir must be a folder path or None, got {self.checkpoint_dir!r}"
            )
        if self.strategy in PIPELINE_STRATEGIES:
            raise ValueError(
                f"checkpoint_dir covers the data-parallel strategies (single, dp, "
                f"ddp, ddp_naive), not {self.strategy}: pick one of those or set "
                f"checkpoint_dir=None"
            )
        if self.balancing:
            raise ValueError(
                "checkpoint_dir does not save load-balancing state (shares, "
                "slowdown): drop slowdown/skew/rebalance or set checkpoint_dir=None"
            )

    def _check_memory(self) -> None:
        from .precision import PRECISIONS, fp16_supported

        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if (self.precision != "fp32" or self.checkpoint) and self.strategy in PIPELINE_STRATEGIES:
            raise ValueError(
                f"precision and checkpoint are knobs of the data-parallel loop "
                f"(single, dp, ddp, ddp_naive, zero1, fsdp), not of {self.strategy}: "
                f"set precision='fp32' and checkpoint=False"
            )
        if self.precision == "fp16":
            from .env import resolve_device

            kind = resolve_device(self.device, self.ranks)
            if not fp16_supported(kind):
                raise ValueError(
                    f"fp16 autocast with a GradScaler is not supported on {kind} by "
                    f"this torch: use precision='bf16' (16 bits with fp32's range: "
                    f"no scaler)"
                )
            if self.strategy == "fsdp":
                raise ValueError(
                    "fp16 with fsdp needs a GradScaler that agrees across shards, "
                    "which labkit does not build: use precision='bf16' (no scaler)"
                )

    def _check_sync_async(self) -> None:
        if self.period < 1:
            raise ValueError(
                f"period must be at least 1 (local steps between averaging rounds), "
                f"got {self.period}"
            )
        for name in ("inner_lr", "outer_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if self.strategy not in SYNC_ASYNC[1:]:
            return
        if self.accumulate != 1:
            raise ValueError(
                f"{self.strategy} takes one batch per optimizer step: set "
                f"accumulate=1 (got {self.accumulate})"
            )
        if self.strategy == "hogwild" and self.device == "cuda":
            raise ValueError(
                "hogwild shares one model in host memory between processes: set device='cpu'"
            )
        if self.strategy == "async_ps" and self.world_size < 2:
            raise ValueError(
                "async_ps runs a parameter server on rank 0 and workers on the other "
                "ranks: set world_size to 2 or more (3 gives two workers)"
            )
        if self.strategy == "async_ps" and any(r == 0 for r, _, _ in self.slowdown):
            raise ValueError(
                "async_ps: rank 0 is the parameter server, which computes no "
                "gradients: slow down a worker instead, e.g. slowdown='1:3'"
            )

    @property
    def data_ranks(self) -> int:
        """Ranks that train on data: every rank, except async_ps's parameter server (rank 0)."""
        return max(1, self.ranks - 1) if self.strategy == "async_ps" else self.ranks

    @property
    def balancing(self) -> bool:
        """Does this run inject heterogeneity or balance load (``labkit.balance``)?"""
        return bool(self.slowdown) or self.skew > 0 or self.rebalance != "static"

    @property
    def ranks(self) -> int:
        """How many processes this run launches."""
        return self.world_size if STRATEGY_RANKS[self.strategy] == "world" else 1

    @property
    def batch_per_rank(self) -> int:
        """Samples in one forward: a rank's micro-batch (data parallel, ``accumulate`` of them
        per step) or one pipeline micro-batch."""
        if self.strategy in PIPELINE_STRATEGIES:
            return self.global_batch // self.microbatches
        return self.global_batch // (self.data_ranks * self.accumulate)

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
