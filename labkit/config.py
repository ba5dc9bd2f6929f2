"""RunConfig: the one frozen, validated description of a run.

Every field carries its help text; the command line (``labkit.flags``) is generated from them, so
each field is a flag of ``python -m labkit compare``/``check`` and of ``labkit.worker`` under
torchrun, with the same name, type and default. Which strategy takes which knob is
``labkit.registry``'s table; validation reads it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from . import pipeline_schedules, registry
from .shares import parse_slowdown

MODELS = ("mlp", "cnn", "unbalanced_mlp", "transformer")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("gloo", "nccl", "mpi")
PIPELINE_IMPLS = ("auto", "scratch", "torch")
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")
REBALANCE = ("static", "dynamic", "join")
PRECISIONS = ("fp32", "bf16", "fp16")
CP_LAYOUTS = ("contiguous", "zigzag")


def knob(default, help: str, choices: tuple | None = None):
    """A RunConfig field with its command-line help (and allowed values, where there is a list)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class RunConfig:
    """Everything that describes one run; sweep with ``dataclasses.replace``."""

    strategy: str = knob("ddp", "what to run (labkit.registry)", tuple(registry.STRATEGIES))
    world_size: int = knob(2, "ranks (DDP, pipeline) or devices (DataParallel); 1 for single")
    steps: int = knob(20, "measured optimizer steps per rank")
    warmup: int = knob(2, "unmeasured steps first (allocator, thread pools, gloo pairs)")
    global_batch: int = knob(64, "samples per optimizer step, summed over all ranks")
    lr: float = knob(0.05, "learning rate")
    seed: int = knob(0, "model init and data order: the same seed gives the same run anywhere")

    model: str = knob("mlp", "labkit's toy model (or bring your own in Python)", MODELS)
    in_features: int = knob(32, "input features per sample")
    width: int = knob(256, "hidden width (cnn: channels)")
    depth: int = knob(4, "hidden layers")
    classes: int = knob(10, "output classes")
    dataset_size: int = knob(4096, "samples in the synthetic dataset")
    heads: int = knob(4, "transformer: attention heads")
    seq_len: int = knob(16, "transformer: tokens per sample")

    device: str = knob("auto", "auto: one GPU per rank if there are enough, else CPU", DEVICES)
    backend: str | None = knob(None, "process-group backend (default: nccl on GPUs, gloo on CPU)",
                               BACKENDS)  # fmt: skip
    threads: int | None = knob(None, "torch threads per rank (default: cores // ranks)")

    # ---- pipelines (notebook 03)
    stages: int = knob(2, "pipeline depth P (one stage per rank)")
    microbatches: int = knob(4, "micro-batches M per step")
    pipeline_impl: str = knob("auto", "scratch: labkit's own schedules; torch: "
                              "torch.distributed.pipelining; auto: scratch where labkit has the "
                              "schedule, else torch", PIPELINE_IMPLS)  # fmt: skip
    balance_stages: bool = knob(False, "cut stages by measured layer cost, not layer count")
    virtual_stages: int | None = knob(None, "model chunks v per pipeline rank (default: "
                                      "interleaved 2, zb 1, zbv 2, dualpipev 2)")  # fmt: skip

    # ---- tensor parallelism (notebook 12)
    tp: int | None = knob(None, "tensor-parallel degree, ranks that split every layer (default: "
                          "all of them; dp_tp: world_size / tp replicas of tp ranks)")  # fmt: skip
    sequence_parallel: bool = knob(False, "tp: activations outside Megatron's regions split "
                                   "on the sequence (reduce-scatter + all-gather)")  # fmt: skip
    shard_size: int | None = knob(None, "hsdp: ranks sharing one copy of the model (default: "
                                  "half of them); world_size / shard_size copies")  # fmt: skip

    # ---- context parallelism (notebook 14)
    cp: int | None = knob(None, "context-parallel degree, ranks that split the sequence (default: "
                          "all of them; dp_cp: world_size / cp replicas of cp ranks)")  # fmt: skip
    cp_layout: str = knob("zigzag", "cp: contiguous (N slices of the sequence) or zigzag (2N "
                          "chunks, rank r holds r and 2N-1-r: even causal work)",
                          CP_LAYOUTS)  # fmt: skip

    # ---- communication (notebook 06); accumulation is a knob of the shared loop
    bucket_cap_mb: float | None = knob(None, "DDP bucket size in MB (default: DDP's 25 MB, "
                                       "the first 1 MiB)")  # fmt: skip
    accumulate: int = knob(1, "micro-batches per optimizer step (gradient accumulation)")
    sync_every_microstep: bool = knob(False, "with accumulate > 1: all-reduce after every "
                                      "micro-batch, not once per step (no no_sync)")  # fmt: skip
    comm_hook: str = knob("none", "DDP communication hook: fp16/bf16 compression or PowerSGD",
                          COMM_HOOKS)  # fmt: skip
    powersgd_rank: int = knob(1, "comm_hook powersgd: matrix approximation rank")

    # ---- load balancing (notebook 07): ranks made unequal, and shares that follow them
    slowdown: tuple = knob((), "RANK:FACTOR[@STEP],...: e.g. 1:2, rank 1 computes 2x slower "
                           "(from measured step STEP)")  # fmt: skip
    skew: float = knob(0.0, "data skew: the last rank holds (1 + skew)x the first rank's data")
    rebalance: str = knob("static", "dynamic: shares of the global batch follow measured "
                          "throughput; join: uneven inputs under Join", REBALANCE)  # fmt: skip
    rebalance_every: int = knob(4, "rebalance dynamic: measured steps between share updates")

    # ---- equivalence and your own model (labkit.labs.equivalence, labkit.factories)
    sync_batchnorm: bool = knob(False, "batch statistics over the global batch (SyncBatchNorm)")
    deterministic: bool = knob(False, "check mode: deterministic kernels, no TF32, return the "
                               "final state")  # fmt: skip
    timeout_s: float = knob(300.0, "seconds a launch (and every collective) may take")

    # ---- saved runs and elasticity (labkit.rank.resume, labkit.labs.elastic, notebook 10)
    checkpoint_dir: str | None = knob(None, "resume from the checkpoint in this folder, and "
                                      "write one there")  # fmt: skip
    checkpoint_every: int = knob(0, "optimizer steps between checkpoints (0: after the last)")
    profile_dir: str | None = knob(None, "write one torch.profiler trace per rank here "
                                   "(measured steps; labkit's phases as ranges)")  # fmt: skip
    pace_s: float = knob(0.0, "seconds each step lasts at least (sleeps the rest, outside the "
                         "measured step): a bigger model's pace, for demos")  # fmt: skip

    # ---- memory and mixed precision (notebook 08): knobs of the shared training loop
    precision: str = knob("fp32", "torch.autocast to bf16, or fp16 with a GradScaler",
                          PRECISIONS)  # fmt: skip
    activation_checkpointing: bool = knob(False, "each block keeps only its input and "
                                          "recomputes the rest during backward")  # fmt: skip

    # ---- synchronous vs asynchronous training (notebook 09)
    period: int = knob(4, "local_sgd / diloco: local steps H between averaging rounds")
    inner_lr: float = knob(1e-3, "diloco: the inner AdamW's learning rate")
    outer_lr: float = knob(0.7, "diloco: outer Nesterov SGD lr on the averaged delta")
    outer_momentum: float = knob(0.9, "diloco: the outer step's Nesterov momentum")
    staleness_lr: bool = knob(False, "async_ps: an update s versions stale uses lr / max(1, s)")

    # ---- mixture of experts (notebook 15, labkit.moe): the transformer's feed-forward as E experts
    experts: int = knob(0, "transformer: experts E in each block's feed-forward, a router "
                        "picking top_k per token (0: the dense feed-forward)")  # fmt: skip
    top_k: int = knob(1, "experts: how many experts each token is routed to (k)")
    capacity_factor: float = knob(1.25, "experts: each expert takes at most ceil(factor x "
                                  "tokens x k / E) of a group's tokens")  # fmt: skip
    aux_loss: float = knob(0.01, "experts: coefficient of Switch's load-balancing loss "
                           "E x sum_i f_i P_i (0: off)")  # fmt: skip
    router_skew: float = knob(0.0, "experts: added to expert 0's router logit (a skewed router)")
    expert_groups: int | None = knob(None, "experts: token groups per global batch, the capacity "
                                     "counted in each; sample j in group j mod groups (default: "
                                     "one per data-parallel rank)")  # fmt: skip
    ep: int | None = knob(None, "ep: expert-parallel degree, ranks sharing out each block's "
                          "experts (default: all; world_size / ep copies of them)")  # fmt: skip

    def __post_init__(self) -> None:
        object.__setattr__(self, "slowdown", parse_slowdown(self.slowdown))
        for f in dataclasses.fields(self):  # every field with a list of values
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if choices and value not in choices and not (value is None and f.default is None):
                raise ValueError(
                    f"unknown {f.name} {value!r}: choose one of {', '.join(choices)}"
                    + (" or None" if f.default is None else "")
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
            "accumulate",
            "powersgd_rank",
            "rebalance_every",
            "period",
            "heads",
            "seq_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("lr", "inner_lr", "outer_lr", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup", "checkpoint_every", "skew", "pace_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be at least 1 or None, got {self.threads}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(
                f"bucket_cap_mb must be positive or None (DDP's default), got {self.bucket_cap_mb}"
            )
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")
        if registry.get(self.strategy).reference and self.world_size != 1:
            raise ValueError(
                f"{self.strategy} runs on one device: set world_size=1 (got {self.world_size})"
            )
        self._check_knobs()
        self._check_mesh()
        self._check_tensor_parallel()  # the degrees first: the batch is divided by them
        self._check_hybrid_shard()
        self._check_context_parallel()
        self._check_batch()
        self._check_balancing()
        self._check_checkpoint_dir()
        self._check_strategy()
        self._check_experts()
        if self.dataset_size < self.global_batch:
            raise ValueError(
                f"dataset_size {self.dataset_size} is smaller than one global batch "
                f"({self.global_batch}): raise dataset_size or lower global_batch"
            )

    def _refuse(self, knob: str, why: str, unset: str) -> None:
        """A knob this strategy does not take: say which ones do, and what to set instead."""
        takers = ", ".join(registry.names(knob=knob))
        raise ValueError(f"{why}: it is a knob of {takers}, not of {self.strategy}: {unset}")

    def _check_virtual_stages(self) -> None:
        """v set on a strategy that puts one chunk on each rank."""
        s = registry.get(self.strategy)
        if self.virtual_stages is not None and "virtual_stages" not in s.knobs:
            self._refuse(
                "virtual_stages",
                "virtual_stages puts several model chunks on each pipeline rank",
                "set virtual_stages=None",
            )

    def _check_knobs(self) -> None:
        """Knobs set on a strategy that would ignore them (``labkit.registry``)."""
        knobs = registry.get(self.strategy).knobs
        if self.comm_hook != "none" and "comm_hook" not in knobs:
            self._refuse(
                "comm_hook",
                f"comm_hook={self.comm_hook!r} is a DDP communication hook",
                "set comm_hook='none'",
            )
        if self.accumulate != 1 and "accumulate" not in knobs:
            if self.strategy in registry.STAGED:
                raise ValueError(
                    f"{self.strategy} already splits each step into micro-batches: set "
                    f"microbatches instead of accumulate (got accumulate={self.accumulate})"
                )
            self._refuse(
                "accumulate",
                f"{self.strategy} takes one batch per optimizer step",
                f"set accumulate=1 (got {self.accumulate})",
            )
        for name in ("precision", "activation_checkpointing"):
            if getattr(self, name) != RunConfig.__dataclass_fields__[name].default and (
                name not in knobs
            ):
                self._refuse(
                    name,
                    f"{name} changes the shared training loop",
                    "set precision='fp32' and activation_checkpointing=False",
                )
        if (self.skew > 0 or self.rebalance != "static") and "skew" not in knobs:
            self._refuse(
                "skew",
                "skew and rebalance share each step's global batch among data-parallel "
                "ranks by their speed",
                "set strategy='ddp' or 'ddp_naive', or skew=0 and rebalance='static' (a "
                f"straggler alone (slowdown) also works on "
                f"{', '.join(registry.names(knob='slowdown'))})",
            )
        if self.slowdown and "slowdown" not in knobs:
            self._refuse(
                "slowdown",
                "slowdown makes one rank a straggler among ranks that compute the same work",
                "drop slowdown",
            )
        if self.profile_dir is not None and "profile_dir" not in knobs:
            self._refuse(
                "profile_dir",
                "profile_dir runs the shared training loop under torch.profiler",
                "set profile_dir=None",
            )
        if self.checkpoint_dir is not None and "checkpoint_dir" not in knobs:
            self._refuse(
                "checkpoint_dir",
                "checkpoint_dir saves the shared training loop's state",
                "set checkpoint_dir=None",
            )

    def _check_mesh(self) -> None:
        """A strategy on one device mesh (``registry.Strategy.mesh``): its degrees multiply to a
        divisor of the world size, the rest of the ranks being data-parallel replicas."""
        s = registry.get(self.strategy)
        if not s.mesh:
            return
        for name in ("tp", "cp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 or None, got {getattr(self, name)}")
        t, c, p = self.tensor_parallel, self.context_parallel, self.stages
        if self.world_size % (t * c * p):
            raise ValueError(
                f"{self.strategy} lays world_size = dp x pp x cp x tp ranks on one mesh: "
                f"stages={p} x cp={c} x tp={t} = {t * c * p} does not divide world size "
                f"{self.world_size}: set world_size to a multiple of {t * c * p} (dp = "
                f"world_size / {t * c * p}) or lower a degree (an unset one is 1)"
            )
        if self.sequence_parallel:
            raise ValueError(
                f"{self.strategy} splits the sequence over cp, not inside the tensor-parallel "
                f"regions: set sequence_parallel=False (tp and dp_tp take it)"
            )
        if not self.experts:
            return
        if t > 1:
            raise ValueError(
                f"{self.strategy} splits dense feed-forwards over tp, and spreads a mixture of "
                f"experts over ep instead: set tp=1 (or experts=0)"
            )
        dp, e = self.world_size // (t * c * p), self.ep or 1
        if e < 1 or dp % e or self.experts % e:
            raise ValueError(
                f"ep={self.ep}: {self.strategy} splits its dp = {dp} data-parallel ranks into "
                f"groups of ep that share out the {self.experts} experts: set ep to a divisor "
                f"of both {dp} and {self.experts} (or None: 1)"
            )

    def _check_batch(self) -> None:
        self._check_virtual_stages()
        if self.strategy in registry.STAGED:
            if registry.get(self.strategy).kind == "pipeline" and self.world_size != self.stages:
                raise ValueError(
                    f"{self.strategy} puts one stage on each rank: set world_size == stages "
                    f"(got world_size={self.world_size}, stages={self.stages})"
                )
            if self.world_size % self.stages:
                raise ValueError(
                    f"{self.strategy} runs world_size / stages copies of a {self.stages}-stage "
                    f"pipeline: world size {self.world_size} is not a multiple of "
                    f"{self.stages}: set world_size to a multiple of stages"
                )
            per = self.microbatches * self.pipelines
            if self.global_batch % per:
                raise ValueError(
                    f"global batch {self.global_batch} is not divisible by {self.microbatches} "
                    f"micro-batches x {self.pipelines} pipeline(s): pick a batch that is a "
                    f"multiple of {per}"
                )
            if self.stages > self.depth + 1:
                raise ValueError(
                    f"a {self.model} of depth {self.depth} has {self.depth + 1} layers, too few "
                    f"for {self.stages} stages: raise depth or lower stages"
                )
            s = registry.get(self.strategy)
            if s.kind == "pipeline":  # the schedule against P, M and v
                pipeline_schedules.check(
                    self.strategy,
                    s.schedule,
                    self.stages,
                    1 if s.schedule == "model_parallel" else self.microbatches,
                    self.virtual_stages,
                    self.depth + 1,
                    self.pipeline_impl,
                )
        elif self.global_batch % self.data_ranks:
            workers = (
                f"{self.data_ranks} workers"
                if registry.get(self.strategy).server
                else f"world size {self.world_size}"
            )
            raise ValueError(
                f"global batch {self.global_batch} is not divisible by {workers}: pick a global "
                f"batch that is a multiple of {self.data_ranks}"
            )
        elif self.global_batch % (self.data_ranks * self.accumulate):
            raise ValueError(
                f"global batch {self.global_batch} does not split into {self.accumulate} "
                f"micro-batches on each of {self.data_ranks} rank(s): pick a global batch that is "
                f"a multiple of {self.data_ranks * self.accumulate}"
            )

    def _check_balancing(self) -> None:
        if not self.balancing:
            return
        if self.rebalance == "join" and not registry.get(self.strategy).joinable:
            joinable = " or ".join(n for n, s in registry.STRATEGIES.items() if s.joinable)
            raise ValueError(
                f"rebalance='join' trains uneven inputs under a hand-written Joinable, which "
                f"{joinable} has (DDP's own join() is shown by labkit.labs.uneven.uneven_inputs): "
                f"set strategy='{joinable}' (got {self.strategy!r}) or "
                f"rebalance='static'/'dynamic'"
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

    def _check_checkpoint_dir(self) -> None:
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
        if self.balancing:
            raise ValueError(
                "checkpoint_dir does not save load-balancing state (shares, "
                "slowdown): drop slowdown/skew/rebalance or set checkpoint_dir=None"
            )

    def _check_tensor_parallel(self) -> None:
        if self.tp is not None and self.tp < 1:
            raise ValueError(f"tp must be at least 1 or None, got {self.tp}")
        if (self.tp is not None or self.sequence_parallel) and "tp" not in registry.get(
            self.strategy
        ).knobs:
            self._refuse("tp", "tp and sequence_parallel split every layer", "drop them")
        if self.model == "transformer" and self.width % self.heads:
            raise ValueError(
                f"width {self.width} does not split into {self.heads} heads: pick a width that "
                f"is a multiple of heads"
            )
        if "tp" not in registry.get(self.strategy).knobs:
            return
        kind = registry.get(self.strategy).kind
        if kind == "tensor_parallel" and self.tp not in (None, self.world_size):
            raise ValueError(
                f"tp={self.tp} with world_size {self.world_size}: {self.strategy} splits every "
                f"layer over all its ranks, set tp=None or tp == world_size (dp_tp runs several "
                f"tensor-parallel groups)"
            )
        if kind == "composed" and self.world_size % self.tensor_parallel:
            raise ValueError(
                f"tp={self.tp} does not divide world size {self.world_size}: {self.strategy} "
                f"runs world_size / tp replicas of a tp-rank group, set tp to a divisor of "
                f"world size {self.world_size}"
            )
        t = self.tensor_parallel
        if self.model == "transformer" and self.heads % t:
            raise ValueError(
                f"{self.heads} heads do not split over {t} tensor-parallel ranks (each holds "
                f"whole heads): pick heads that are a multiple of {t}"
            )
        if self.width % t:
            raise ValueError(
                f"width {self.width} does not split over {t} tensor-parallel ranks: pick a "
                f"width that is a multiple of {t}"
            )
        if self.sequence_parallel and (self.model != "transformer" or self.seq_len % t):
            raise ValueError(
                f"sequence parallelism splits a transformer's sequence over the {t} ranks: use "
                f"model='transformer' with seq_len a multiple of {t} (got model={self.model!r}, "
                f"seq_len={self.seq_len})"
            )

    def _check_hybrid_shard(self) -> None:
        if self.shard_size is None:
            return
        if "shard_size" not in registry.get(self.strategy).knobs:
            self._refuse("shard_size", "shard_size sets HSDP's shard groups", "drop it")
        if self.shard_size < 1 or self.world_size % self.shard_size:
            raise ValueError(
                f"shard_size={self.shard_size} does not divide world size {self.world_size}: "
                f"hsdp runs world_size / shard_size copies of a model sharded over shard_size "
                f"ranks, set shard_size to a divisor of {self.world_size}"
            )

    def _check_experts(self) -> None:
        """A mixture of experts (``labkit.moe``): its knobs, and the groups its capacity is
        counted in, which every rank's batch must split into."""
        shaping = ("top_k", "capacity_factor", "aux_loss", "router_skew", "expert_groups", "ep")
        fields = RunConfig.__dataclass_fields__
        changed = [n for n in shaping if getattr(self, n) != fields[n].default]
        if self.experts < 0:
            raise ValueError(
                f"experts must be >= 0 (0: the dense feed-forward), got {self.experts}"
            )
        if not self.experts:
            if registry.get(self.strategy).kind == "expert_parallel":
                raise ValueError(
                    f"{self.strategy} spreads a mixture of experts' experts over the ranks, and "
                    f"experts=0 keeps the dense feed-forward (nothing to spread): set experts, "
                    f"a multiple of the ranks sharing them (e.g. experts="
                    f"{2 * (self.ep or self.world_size)}), and model='transformer'"
                )
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} shape a mixture of experts: set experts (E >= 1, "
                    f"with model='transformer') or leave them at their defaults"
                )
            return
        if "experts" not in registry.get(self.strategy).knobs:
            self._refuse(
                "experts", "experts makes every feed-forward a mixture of experts", "set experts=0"
            )
        if self.model != "transformer":
            raise ValueError(
                f"experts={self.experts} replaces the transformer's feed-forward with a mixture "
                f"of experts: set model='transformer' (got {self.model!r})"
            )
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"top_k={self.top_k}: each token goes to between 1 and experts={self.experts} "
                f"experts, set top_k in that range"
            )
        if not self.capacity_factor > 0 or not self.aux_loss >= 0:
            raise ValueError(
                f"capacity_factor must be positive and aux_loss >= 0, got "
                f"{self.capacity_factor} and {self.aux_loss}"
            )
        if not abs(self.router_skew) < float("inf"):
            raise ValueError(f"router_skew must be a finite number, got {self.router_skew}")
        if self.accumulate != 1:
            raise ValueError(
                f"a mixture of experts counts its capacity in groups of one forward's tokens, "
                f"which accumulation would shrink: set accumulate=1 (got {self.accumulate})"
            )
        if self.skew > 0 or self.rebalance != "static":
            raise ValueError(
                "skew and rebalance change each rank's share of the batch, and with it the token "
                "groups a mixture of experts counts its capacity in: set skew=0 and "
                "rebalance='static' (a straggler alone, slowdown, works)"
            )
        if self.precision == "fp16" and self.aux_loss:
            raise ValueError(
                "the auxiliary loss's gradient is added beside the loss a GradScaler scales: "
                "use precision='bf16' (no scaler) or aux_loss=0"
            )
        g, n = self.token_groups, self.data_ranks
        if g < 1 or g % n:
            raise ValueError(
                f"expert_groups={g}: each of the {n} data-parallel ranks holds whole token "
                f"groups, set expert_groups to a multiple of {n} (or None: one per rank)"
            )
        if self.batch_per_rank % (g // n):
            raise ValueError(
                f"each rank's {self.batch_per_rank} samples do not split into {g // n} token "
                f"groups: pick a global batch that is a multiple of expert_groups={g}"
            )
        if self.ep is not None and "ep" not in registry.get(self.strategy).knobs:
            self._refuse("ep", "ep spreads the experts over ranks", "set ep=None")
        if self.ep is not None and (self.ep < 1 or self.world_size % self.ep):
            raise ValueError(
                f"ep={self.ep} does not divide world size {self.world_size}: world_size / ep "
                f"groups of ep ranks each share out the experts, set ep to a divisor of "
                f"{self.world_size} (or None: all of them)"
            )
        d_e = self.ep or self.world_size
        if registry.get(self.strategy).kind == "expert_parallel" and self.experts % d_e:
            raise ValueError(
                f"{self.strategy} puts experts / ep experts on each rank of a group of ep = "
                f"{d_e}: {self.experts} experts do not split over {d_e} ranks, set experts to "
                f"a multiple of {d_e}"
            )

    @property
    def token_groups(self) -> int:
        """A mixture of experts' token groups per global batch (``expert_groups``, by default
        one per data-parallel rank: GShard's groups, a device's tokens each)."""
        return self.expert_groups if self.expert_groups is not None else self.data_ranks

    @property
    def groups_per_rank(self) -> int:
        """Token groups in one rank's batch (``labkit.moe.MoESpec.groups``)."""
        return max(1, self.token_groups // self.data_ranks)

    def _check_context_parallel(self) -> None:
        """Context parallelism (``labkit.strategies.cp``): the transformer's sequence cut into
        equal chunks over the cp ranks (whole heads per rank for the all-to-all)."""
        s = registry.get(self.strategy)
        if self.cp is not None or self.cp_layout != "zigzag":
            if "cp" not in s.knobs:
                self._refuse("cp", "cp and cp_layout split the sequence over ranks", "drop them")
        if "cp" not in s.knobs:
            return
        if self.cp is not None and self.cp < 1:
            raise ValueError(f"cp must be at least 1 or None, got {self.cp}")
        if self.model != "transformer":
            raise ValueError(
                f"{self.strategy} splits a transformer's sequence over ranks: set "
                f"model='transformer' (got model={self.model!r})"
            )
        if s.kind == "context_parallel" and self.cp not in (None, self.world_size):
            raise ValueError(
                f"cp={self.cp} with world_size {self.world_size}: {self.strategy} splits the "
                f"sequence over all its ranks, set cp=None or cp == world_size (dp_cp runs "
                f"several context-parallel groups)"
            )
        n = self.context_parallel
        if self.world_size % n:
            raise ValueError(
                f"cp={n} does not divide world size {self.world_size}: {self.strategy} runs "
                f"world_size / cp replicas of a cp-rank ring, set cp to a divisor of "
                f"{self.world_size}"
            )
        pieces = n * (2 if self.cp_layout == "zigzag" else 1)
        if self.seq_len % pieces:
            raise ValueError(
                f"seq_len {self.seq_len} does not cut into {pieces} equal chunks ({self.cp_layout} "
                f"placement over {n} ranks): pick a seq_len that is a multiple of {pieces}"
                + (" (or cp_layout='contiguous')" if self.seq_len % n == 0 else "")
            )
        if s.heads_split and self.heads % n:
            raise ValueError(
                f"{self.heads} heads do not split over {n} ranks: {self.strategy}'s all-to-all "
                f"gives each rank whole heads, pick heads that are a multiple of {n}"
            )

    @property
    def context_parallel(self) -> int:
        """The context-parallel degree this run uses (1 for strategies that do not split the
        sequence)."""
        s = registry.get(self.strategy)
        if "cp" not in s.knobs:
            return 1
        return self.cp or (1 if s.mesh else self.world_size)

    @property
    def shard_group(self) -> int:
        """hsdp: the ranks one copy of the model is sharded over (``shard_size``, by default
        half the ranks when they pair up: two copies; else all of them, which is FSDP)."""
        if self.shard_size is not None:
            return self.shard_size
        n = self.world_size
        return n // 2 if n >= 4 and n % 2 == 0 else n

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree this run uses (1 for strategies that do not split layers)."""
        s = registry.get(self.strategy)
        if "tp" not in s.knobs:
            return 1
        return self.tp or (1 if s.mesh else self.world_size)

    def _check_strategy(self) -> None:
        """What one strategy needs beyond its knobs."""
        s = registry.get(self.strategy)
        if self.precision == "fp16":
            from .env import fp16_supported, resolve_device

            kind = resolve_device(self.device, self.ranks)
            if not fp16_supported(kind):
                raise ValueError(
                    f"fp16 autocast with a GradScaler is not supported on {kind} by "
                    f"this torch: use precision='bf16' (16 bits with fp32's range: "
                    f"no scaler)"
                )
            if s.zero_stage == 3:
                raise ValueError(
                    f"fp16 with {self.strategy} needs a GradScaler that agrees across shards, "
                    "which labkit does not build: use precision='bf16' (no scaler)"
                )
        if s.shared_memory and self.device == "cuda":
            raise ValueError(
                f"{self.strategy} shares one model in host memory between processes: "
                f"set device='cpu'"
            )
        if s.server and self.world_size < 2:
            raise ValueError(
                f"{self.strategy} runs a parameter server on rank 0 and workers on the other "
                "ranks: set world_size to 2 or more (3 gives two workers)"
            )
        if s.server and any(r == 0 for r, _, _ in self.slowdown):
            raise ValueError(
                f"{self.strategy}: rank 0 is the parameter server, which computes no "
                "gradients: slow down a worker instead, e.g. slowdown='1:3'"
            )

    @property
    def data_ranks(self) -> int:
        """Ranks (or groups of ranks) that each train on their own slice of the data: every
        rank, except async_ps's parameter server (rank 0); one per tensor- or context-parallel
        group."""
        if registry.get(self.strategy).server:
            return max(1, self.ranks - 1)
        return self.ranks // (self.tensor_parallel * self.context_parallel)

    @property
    def balancing(self) -> bool:
        """Does this run inject heterogeneity or balance load (``labkit.shares``)?"""
        return bool(self.slowdown) or self.skew > 0 or self.rebalance != "static"

    @property
    def ranks(self) -> int:
        """How many processes this run launches."""
        return 1 if registry.get(self.strategy).one_process else self.world_size

    @property
    def batch_per_rank(self) -> int:
        """Samples in one forward: a rank's micro-batch (data parallel, ``accumulate`` of them
        per step) or one pipeline micro-batch."""
        if self.strategy in registry.STAGED:
            return self.global_batch // (self.microbatches * self.pipelines)
        return self.global_batch // (self.data_ranks * self.accumulate)

    @property
    def pipelines(self) -> int:
        """Copies of the pipeline each training its slice of the batch (``dp_pp``: world_size
        / stages; ``mesh4d``: dp = world_size / (stages x cp x tp)), 1 for the others."""
        if registry.get(self.strategy).kind != "composed":
            return 1
        return self.world_size // (self.stages * self.tensor_parallel * self.context_parallel)

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
