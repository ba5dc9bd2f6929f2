"""Predict one training step from a measured compute profile and an alpha-beta network.

    predict(profile, network, strategy, world_size, global_batch, **knobs) -> StepPrediction

The profile (``labkit.labs.compute_profile.measure``) holds, per layer in forward order, the
forward and backward seconds at one per-rank batch and the bytes of each gradient tensor, plus the
optimizer's and the data loader's time per step. The network is a
``labkit.predict.collectives.CollectiveModel``: fitted on this machine (``labkit.labs.comm``) or a
published interconnect (``labkit.predict.whatif``). How each strategy spends a step:

* ``single``: data + forward + backward + optimizer on the whole global batch.
* ``ddp``: gradients are packed into buckets in the order backward produces them (the reverse of
  the forward order) of ``bucket_cap_mb`` each (DDP's default: 25 MB, the first bucket 1 MiB);
  a bucket's all-reduce starts once its last gradient is ready and the previous bucket's
  all-reduce is done, so it runs while backward computes earlier layers. What finishes after
  backward is exposed; the rest was hidden.
* ``ddp_naive``: one all-reduce per gradient tensor, back to back, after backward: all exposed.
* pipelines: the schedule simulator of ``labkit.predict.schedule`` (not a second one) on the
  profile's layers split into stages, each hand-off a point-to-point message of one
  micro-batch's activations.

Gradient accumulation (``accumulate=k``): k micro-batches per optimizer step; under
``no_sync`` only the last one communicates, otherwise every one does. A compression hook
multiplies the bytes on the wire (``compression``: 0.5 for fp16/bf16).

Compute scales with the batch as measured (``Profile.at_batch``: a line through the profile's
two batch sizes, per layer). Each rank is assumed to compute as fast as when it was profiled:
profile under the conditions you predict (same threads per rank, the same number of ranks
computing at once), which ``labkit.labs.compute_profile.measure`` does. Two effects of sharing a
machine are measured there and modelled here, because on a CPU they are as large as the
communication:

* ``Profile.comm_shares_core``: gloo's all-reduce thread has no core of its own, so a bucket
  reduced during backward slows backward down as much as it hides (``ddp_timeline``);
* ``Profile.after_wait``: a step computes more slowly after its rank slept through the exposed
  communication (cold caches, an idle core), added as ``StepPrediction.after_wait_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .. import registry
from ..models import even_bounds  # the split labkit's pipelines use
from ..shares import split
from .collectives import CollectiveModel, coefficients
from .schedule import ScheduleCosts
from .schedule import predict_step as simulate_pipeline

MIB = 2**20
FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_MB = 25.0


@dataclass(frozen=True)
class Layer:
    """One block of the model (a child of an ``nn.Sequential``; the whole model otherwise)."""

    name: str
    forward_s: float  # at Profile.batch samples
    backward_s: float
    grad_bytes: tuple[int, ...]  # each trainable parameter's gradient, in forward order
    activation_bytes: float = 0.0  # this block's output, per sample
    flops: float = 0.0  # forward FLOPs per sample (matmuls; 0 if unknown)
    forward_fixed_s: float = 0.0  # the part that does not grow with the batch
    backward_fixed_s: float = 0.0


@dataclass(frozen=True)
class Profile:
    """Compute of one rank at ``batch`` samples, measured (see ``labkit.labs.compute_profile``)."""

    batch: int
    layers: tuple[Layer, ...]
    optimizer_s: float = 0.0
    data_s: float = 0.0
    ddp_overhead_s: float = 0.0  # DDP's hooks and bucket copies per step, no communication
    threads: int = 1
    device: str = "cpu"
    source: str = "measured"
    comm_shares_core: bool = False  # gloo's thread has no core of its own (see ddp_timeline)
    after_wait_s: tuple[tuple[float, float], ...] = ()  # (idle s before a step, extra s it took)
    # forward + backward's 10th and 90th percentile over its median, across the profiled steps
    compute_spread: tuple[float, float] = (1.0, 1.0)
    # the gradient all-reduce's 10th and 90th percentile block median over its median
    comm_spread: tuple[float, float] = (1.0, 1.0)

    def after_wait(self, gap_s: float) -> float:
        """Extra seconds a step computes for after its rank waited ``gap_s`` idle (cold caches,
        an idle core): interpolated between the measured gaps, held at the longest one's, and
        never decreasing with the gap. 0 where not measured (a preset or rescaled profile)."""
        if gap_s <= 0 or not self.after_wait_s:
            return 0.0
        points, top = [(0.0, 0.0)], 0.0
        for gap, extra in sorted(self.after_wait_s):
            top = max(top, extra)
            points.append((gap, top))
        for (g0, e0), (g1, e1) in zip(points, points[1:]):
            if gap_s <= g1:
                return e0 + (e1 - e0) * (gap_s - g0) / (g1 - g0)
        return points[-1][1]

    @property
    def grad_bytes(self) -> int:
        return sum(sum(layer.grad_bytes) for layer in self.layers)

    @property
    def flops_per_sample(self) -> float:
        return sum(3 * layer.flops for layer in self.layers)  # forward + 2x backward

    def scaled(self, factor: float) -> Profile:
        """The same profile with every layer's compute ``factor`` times as long."""
        layers = tuple(
            replace(
                layer,
                forward_s=layer.forward_s * factor,
                backward_s=layer.backward_s * factor,
                forward_fixed_s=layer.forward_fixed_s * factor,
                backward_fixed_s=layer.backward_fixed_s * factor,
            )
            for layer in self.layers
        )
        return replace(self, layers=layers)

    def at_batch(self, batch: float) -> Profile:
        """The same model at another per-rank batch: each layer's time on its line."""
        f = batch / self.batch

        def scale(t: float, fixed: float) -> float:
            return fixed + (t - fixed) * f

        layers = tuple(
            replace(
                layer,
                forward_s=scale(layer.forward_s, layer.forward_fixed_s),
                backward_s=scale(layer.backward_s, layer.backward_fixed_s),
            )
            for layer in self.layers
        )
        return replace(self, batch=batch, layers=layers)

    def on_device(self, flops_per_s: float, name: str) -> Profile:
        """The same model on a device with a given compute rate (FLOP/s): each layer's time is
        its FLOPs at that rate (memory-bound layers and kernel launches are not modelled)."""
        if self.flops_per_sample <= 0:
            raise ValueError(
                "this profile has no FLOP counts (a model that is not a stack of "
                "Linear/Conv layers?): a device preset cannot rescale it"
            )
        layers = tuple(
            replace(
                layer,
                forward_s=layer.flops * self.batch / flops_per_s,
                backward_s=2 * layer.flops * self.batch / flops_per_s,
                forward_fixed_s=0.0,
                backward_fixed_s=0.0,
            )
            for layer in self.layers
        )
        ratio = sum(x.forward_s + x.backward_s for x in layers) / max(
            1e-12, sum(x.forward_s + x.backward_s for x in self.layers)
        )
        return replace(
            self,
            layers=layers,
            optimizer_s=self.optimizer_s * ratio,
            data_s=0.0,
            ddp_overhead_s=self.ddp_overhead_s * ratio,
            device=name,
            source=f"{self.source}, rescaled to {name}",
            comm_shares_core=False,
            after_wait_s=(),
        )


@dataclass
class StepPrediction:
    """Predicted seconds of one optimizer step, split as the probes split a measured one."""

    strategy: str
    world_size: int
    global_batch: int
    data_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    comm_total_s: float  # all communication, hidden or not
    exposed_s: float  # communication on the critical path
    comm_bytes: float  # bytes each rank sends per optimizer step (ring all-reduce: 2(n-1)/n x)
    buckets: list[dict] = field(default_factory=list)
    bubble: float | None = None  # pipelines: mean idle share of the stages
    after_wait_s: float = 0.0  # compute slowed by waiting (Profile.after_wait)
    # the band: the step predicted with the collectives' 10th and 90th percentile times
    step_s_p10: float | None = None
    step_s_p90: float | None = None

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.comm_total_s - self.exposed_s)

    @property
    def step_s(self) -> float:
        return (
            self.data_s
            + self.forward_s
            + self.backward_s
            + self.exposed_s
            + self.optimizer_s
            + self.after_wait_s
        )

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "buckets"}
        return {
            **out,
            "hidden_s": self.hidden_s,
            "step_s": self.step_s,
            "samples_per_s": self.samples_per_s,
            "buckets": len(self.buckets),
        }


def bucket_layout(
    grad_bytes_ready_order: Sequence[int], bucket_cap_mb: float | None
) -> list[list[int]]:
    """Indices (into the ready order) of each DDP bucket, as the reducer rebuilds them after
    the first step: fill a bucket until it holds at least its limit, then start the next. With
    the default cap (None) the first bucket's limit is 1 MiB, the others 25 MB; with a cap
    you chose, every bucket's limit is that cap (torch 2.14 BucketCapacityConfig)."""
    cap = int((bucket_cap_mb if bucket_cap_mb is not None else DEFAULT_BUCKET_MB) * MIB)
    first = FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    buckets, current, size = [], [], 0
    for i, nbytes in enumerate(grad_bytes_ready_order):
        current.append(i)
        size += nbytes
        if size >= (first if not buckets else cap):
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def ddp_timeline(
    layers: Sequence[Layer],
    network: CollectiveModel,
    world_size: int,
    bucket_cap_mb: float | None = None,
    compression: float = 1.0,
    shares_core: bool = False,
) -> tuple[float, float, list[dict]]:
    """Overlap of bucketed all-reduces with backward: (total comm, exposed comm, buckets).

    Times are from the start of backward; each bucket row has bytes, ready, start, end.
    Exposed is how much later the last all-reduce (or backward) ends than backward alone would.

    ``shares_core``: the all-reduce has no core of its own (gloo on CPU with every core already
    computing: its thread and backward's take turns on the rank's core), so while both run each
    goes at half speed, and overlap hides nothing: it only reorders the same CPU work. On a GPU
    (NCCL's kernels beside backward's) or a CPU with spare cores, both run at full speed."""
    ready_work, grads, t = [], [], 0.0
    for layer in reversed(layers):  # backward runs the last layer first
        t += layer.backward_s
        for nbytes in reversed(layer.grad_bytes):
            grads.append(nbytes)
            ready_work.append(t)
    backward_work = t
    buckets = [
        (sum(grads[i] for i in idx), len(idx), max(ready_work[i] for i in idx))
        for idx in bucket_layout(grads, bucket_cap_mb)
    ]
    rows: list[dict] = []
    now = done = 0.0  # wall clock; seconds of backward computed so far
    backward_end = backward_work if not buckets else None
    left = 0.0  # seconds of the running all-reduce still to go
    ready_wall = [None] * len(buckets)
    while len(rows) < len(buckets) or left > 0:
        for b, (_, _, ready) in enumerate(buckets):
            if ready_wall[b] is None and done >= ready - 1e-12:
                ready_wall[b] = now
        if done >= backward_work - 1e-12 and backward_end is None:
            backward_end = now
        if left <= 0 and len(rows) < len(buckets) and ready_wall[len(rows)] is not None:
            nbytes, tensors, _ = buckets[len(rows)]
            left = network.time("all_reduce", nbytes * compression, world_size)
            rows.append(
                {
                    "bytes": nbytes,
                    "tensors": tensors,
                    "ready_s": ready_wall[len(rows)],
                    "start_s": now,
                    "end_s": None,
                }
            )
            continue
        computing = done < backward_work - 1e-12
        rate = 0.5 if (shares_core and computing and left > 0) else 1.0
        steps = []
        if computing:  # to the next bucket's readiness, or backward's end
            nxt = min((r for _, _, r in buckets if r > done + 1e-12), default=backward_work)
            steps.append((min(nxt, backward_work) - done) / rate)
        if left > 0:
            steps.append(left / rate)
        dt = min(steps)
        now += dt
        if computing:
            done = min(backward_work, done + rate * dt)
        if left > 0:
            left -= rate * dt
            if left <= 1e-12:
                left, rows[-1]["end_s"] = 0.0, now
    if backward_end is None:
        backward_end = now
    total = sum(r["end_s"] - r["start_s"] for r in rows)
    end = max([backward_end] + [r["end_s"] for r in rows])
    return total, max(0.0, end - backward_work), rows


def predict(
    profile: Profile,
    network: CollectiveModel,
    strategy: str,
    world_size: int,
    global_batch: int,
    *,
    bucket_cap_mb: float | None = None,
    accumulate: int = 1,
    no_sync: bool = True,
    compression: float = 1.0,
    microbatches: int = 4,
    bounds: Sequence[int] | None = None,
    tp: int = 1,
    sequence_parallel: bool = False,
    band: bool = False,
    spread: tuple[CollectiveModel, CollectiveModel] | None = None,
) -> StepPrediction:
    """Predicted step of ``strategy`` on ``world_size`` ranks at ``global_batch`` samples per
    optimizer step (summed over ranks and accumulation micro-steps).

    ``band``: predict the step twice more, at the fast and at the slow end of what was
    measured, to give the band ``step_s_p10``..``step_s_p90`` the measured median step should
    fall in (a point prediction cannot hold on a machine whose all-reduce time moves by several
    x from one moment to the next): compute scaled to the profile's 10th and 90th percentile
    (``Profile.compute_spread``), collectives to the profile's measured all-reduce spread
    (``Profile.comm_spread``), or to ``spread``, the network fitted on the comm benchmark's
    10th and 90th percentile times (``labkit.predict.collectives.fit_band``)."""
    knobs = dict(bucket_cap_mb=bucket_cap_mb, accumulate=accumulate, no_sync=no_sync,
                 compression=compression, microbatches=microbatches, bounds=bounds, tp=tp,
                 sequence_parallel=sequence_parallel)  # fmt: skip
    pred = _predict(profile, network, strategy, world_size, global_batch, **knobs)
    if band or spread is not None:  # the fast end with fast compute, the slow with the slow
        spread = spread or tuple(network.scaled(f) for f in profile.comm_spread)
        ends = [
            _predict(profile.scaled(f), n, strategy, world_size, global_batch, **knobs).step_s
            for f, n in zip(profile.compute_spread, spread)
        ]
        pred.step_s_p10 = min(pred.step_s, *ends)
        pred.step_s_p90 = max(pred.step_s, *ends)
    return pred


def _predict(
    profile: Profile,
    network: CollectiveModel,
    strategy: str,
    world_size: int,
    global_batch: int,
    *,
    bucket_cap_mb: float | None,
    accumulate: int,
    no_sync: bool,
    compression: float,
    microbatches: int,
    bounds: Sequence[int] | None,
    tp: int,
    sequence_parallel: bool,
) -> StepPrediction:
    if world_size < 1 or global_batch < 1 or accumulate < 1:
        raise ValueError("world_size, global_batch and accumulate must be at least 1")
    if registry.get(strategy).kind == "tensor_parallel" or strategy == "dp_tp":
        degree = world_size if strategy != "dp_tp" else tp
        return _tensor_parallel(
            profile, network, strategy, world_size, global_batch, degree, sequence_parallel
        )
    if registry.get(strategy).kind == "pipeline":
        return _pipeline(
            profile,
            network,
            strategy,
            world_size,
            global_batch,
            1 if strategy == "model_parallel" else microbatches,
            bounds,
        )
    if strategy not in ("single", "ddp", "ddp_naive"):
        raise ValueError(
            f"no predictor for strategy {strategy!r}: single, ddp, ddp_naive, "
            f"{', '.join(registry.PIPELINES)}"
        )
    ranks = 1 if strategy == "single" else world_size
    micro = profile.at_batch(global_batch / ranks / accumulate)
    fwd = accumulate * sum(layer.forward_s for layer in micro.layers)
    bwd = accumulate * sum(layer.backward_s for layer in micro.layers)
    syncs = 1 if no_sync else accumulate
    data_s = accumulate * profile.data_s
    pred = StepPrediction(
        strategy, world_size, global_batch, data_s, fwd, bwd, profile.optimizer_s, 0.0, 0.0, 0.0
    )
    if ranks == 1:
        return pred
    per_byte = coefficients("all_reduce", ranks)[1]  # a ring all-reduce sends 2(n-1)/n of it
    pred.comm_bytes = syncs * profile.grad_bytes * compression * per_byte
    if strategy == "ddp":
        pred.backward_s += accumulate * profile.ddp_overhead_s
        total, exposed, pred.buckets = ddp_timeline(
            micro.layers, network, ranks, bucket_cap_mb, compression, profile.comm_shares_core
        )
        pred.comm_total_s, pred.exposed_s = syncs * total, syncs * exposed
    else:  # one all-reduce per tensor, after backward
        per_sync = sum(
            network.time("all_reduce", nbytes * compression, ranks)
            for layer in micro.layers
            for nbytes in layer.grad_bytes
        )
        pred.comm_total_s = pred.exposed_s = syncs * per_sync
    # a rank that waited for its peers computes its next work more slowly (Profile.after_wait):
    # its compute thread sleeps through the exposed communication
    pred.after_wait_s = syncs * profile.after_wait(pred.exposed_s / syncs)
    return pred


@dataclass(frozen=True)
class SplitBlock:
    """How ``labkit.strategies.tp.parallelize`` cuts one block of the profile: its compute
    divided over the tensor-parallel ranks or not, the activation collectives it ends with
    (each of the block's output, b x s x h), and which of its parameters stay whole."""

    split: bool
    forward: int = 0  # g: all-reduces of its output in forward
    backward: int = 0  # f: all-reduces of an input gradient in backward
    whole: tuple[int, ...] = ()  # parameters (forward order) every rank holds entire
    partial: tuple[int, ...] = ()  # of those, the ones sequence parallelism leaves partial


# labkit's transformer Block, parameters in forward order: ln1 (w, b), qkv (w, b), proj (w, b),
# ln2 (w, b), fc1 (w, b), fc2 (w, b); the LayerNorms and the row-parallel biases stay whole
_BLOCK_WHOLE, _BLOCK_LAYERNORMS = (0, 1, 5, 6, 7, 11), (0, 1, 6, 7)


def tensor_parallel_layout(profile: Profile) -> list[SplitBlock]:
    """Per block of the profile, how tensor parallelism cuts it. labkit's transformer: each
    ``Block`` is two Megatron pairs (attention, MLP): two all-reduces in forward, two in
    backward; the embedding and head replicated. labkit's MLP: hidden blocks paired, column
    then row, one all-reduce after each pair in forward and one before it in backward, except
    before the first layer, whose input needs no gradient; the row layer's bias whole; an odd
    last hidden block and the head replicated."""
    names = [layer.name.split(": ")[-1] for layer in profile.layers]
    if "Block" in names:
        return [
            SplitBlock(True, 2, 2, _BLOCK_WHOLE, _BLOCK_LAYERNORMS + (5, 11))
            if n == "Block"
            else SplitBlock(False)
            for n in names
        ]
    pairs = (len(names) - 1) // 2 * 2
    return [
        SplitBlock(True, 1, 1 if i > 1 else 0, (1,), (1,)) if i < pairs and i % 2
        else SplitBlock(i < pairs)
        for i in range(len(names))
    ]  # fmt: skip


def _tensor_parallel(
    profile: Profile,
    network: CollectiveModel,
    strategy: str,
    world_size: int,
    global_batch: int,
    tp: int,
    sequence_parallel: bool,
) -> StepPrediction:
    """Every rank of a tensor-parallel group computes 1/tp of each split block on the whole
    batch of its data-parallel replica (``dp = world_size / tp``) and waits for the activation
    collectives each Megatron pair ends with (``tensor_parallel_layout``), b x s x h elements
    each. Under sequence parallelism each all-reduce is a reduce-scatter plus an all-gather (the
    same bytes), the sequence is gathered once before the head and once in the embedding's
    backward, and the parameters that saw a slice of the sequence (LayerNorms; by hand also the
    row-parallel biases, which DTensor adds before its reduce-scatter) are all-reduced over
    the group after backward. With dp > 1 each rank then averages its share of the weights'
    gradients with its twins in the other replicas (dp_tp), after backward."""
    dp = world_size // tp
    micro = profile.at_batch(global_batch / dp)
    layout = tensor_parallel_layout(profile)

    def share(x: float, block: SplitBlock) -> float:
        return x / tp if block.split else x

    fwd = sum(share(x.forward_s, b) for x, b in zip(micro.layers, layout))
    bwd = sum(share(x.backward_s, b) for x, b in zip(micro.layers, layout))
    comm_s = sent = 0.0

    def add(op: str, nbytes: float, n: int, times: int = 1) -> None:
        nonlocal comm_s, sent
        comm_s += times * network.time(op, nbytes, n)
        sent += times * nbytes * coefficients(op, n)[1]

    for layer, block in zip(micro.layers, layout):
        nbytes, times = layer.activation_bytes * micro.batch, block.forward + block.backward
        if sequence_parallel:
            add("reduce_scatter", nbytes, tp, times)
            add("all_gather", nbytes, tp, times)
        else:
            add("all_reduce", nbytes, tp, times)
    if sequence_parallel:  # the seams: into the head (forward), out of the embedding (backward)
        seam = next(x.activation_bytes for x, b in zip(micro.layers, layout) if b.split)
        add("all_gather", seam * micro.batch, tp, 2)
        partial = 0.0
        for layer, block in zip(profile.layers, layout):
            # DTensor adds the row-parallel bias before its reduce-scatter: only the LayerNorms
            kept = block.partial
            if strategy == "tp_dtensor":
                kept = _BLOCK_LAYERNORMS if block.split else ()
            partial += sum(layer.grad_bytes[i] for i in kept)
        add("all_reduce", partial, tp)
    if dp > 1:  # the replicas' gradient average: this rank's share of every parameter
        grads = sum(
            g if i in block.whole else share(g, block)
            for layer, block in zip(profile.layers, layout)
            for i, g in enumerate(layer.grad_bytes)
        )
        add("all_reduce", grads, dp)
    return StepPrediction(
        strategy,
        world_size,
        global_batch,
        profile.data_s,
        fwd,
        bwd,
        profile.optimizer_s / tp,
        comm_total_s=comm_s,
        exposed_s=comm_s,  # every message here is on the critical path
        comm_bytes=sent,
    )


def _pipeline(
    profile: Profile,
    network: CollectiveModel,
    strategy: str,
    stages: int,
    global_batch: int,
    microbatches: int,
    bounds: Sequence[int] | None,
) -> StepPrediction:
    layers = profile.at_batch(global_batch / microbatches).layers
    if bounds is None:
        bounds = even_bounds(len(layers), stages)
    bounds = list(bounds)
    ends = bounds[1:] + [len(layers)]
    parts = [layers[a:b] for a, b in zip(bounds, ends)]
    mb = global_batch / microbatches
    hop = tuple(network.time("p2p", part[-1].activation_bytes * mb, 2) for part in parts[:-1])
    costs = ScheduleCosts(
        tuple(sum(x.forward_s for x in p) for p in parts),
        tuple(sum(x.backward_s for x in p) for p in parts),
        hop,
    )
    sim = simulate_pipeline(registry.get(strategy).schedule, microbatches, costs)
    busiest = max(range(stages), key=lambda s: costs.forward_s[s] + costs.backward_s[s])
    compute = microbatches * (costs.forward_s[busiest] + costs.backward_s[busiest])
    fwd_share = costs.forward_s[busiest] / max(
        1e-12, costs.forward_s[busiest] + costs.backward_s[busiest]
    )
    idle = sim["span_s"] - compute  # the busiest stage's wait: bubble + hops
    return StepPrediction(
        strategy,
        stages,
        global_batch,
        profile.data_s * microbatches,
        compute * fwd_share,
        compute * (1 - fwd_share),
        profile.optimizer_s / stages,
        comm_total_s=sum(hop) * 2 * microbatches,
        exposed_s=max(0.0, idle),
        comm_bytes=0.0,
        bubble=sim["bubble"],
    )


def scaling(
    profile: Profile,
    network: CollectiveModel,
    strategy: str,
    world_sizes: Sequence[int],
    batch_per_rank: int,
    **knobs,
) -> list[dict]:
    """Predicted step and scaling efficiency at each world size, the per-rank batch held fixed
    (weak scaling, as data parallelism is used): efficiency = throughput(n) / (n x
    throughput(1))."""
    one = predict(profile, network, "single", 1, batch_per_rank).samples_per_s
    rows = []
    for n in world_sizes:
        p = predict(
            profile, network, strategy if n > 1 else "single", n, batch_per_rank * n, **knobs
        )
        rows.append({**p.as_dict(), "efficiency": p.samples_per_s / (n * one)})
    return rows


def predict_balance(
    profile: Profile,
    network: CollectiveModel,
    world_size: int,
    global_batch: int,
    slowdown: Sequence[float] | None = None,
    *,
    policy: str = "static",
    weights: Sequence[float] | None = None,
) -> dict:
    """``ddp_naive`` on ranks of unequal speed (``labkit.rank.balancer``): each rank computes
    its share of the global batch ``slowdown[r]`` times slower than profiled, the step waits for the
    slowest, then one all-reduce of every gradient as a flat message, and the optimizer.

    ``policy="static"``: shares in proportion to ``weights`` (even, or the data skew);
    ``"dynamic"``: the shares the rebalancer settles on, where shares in proportion to measured
    throughput stop moving: every rank computes equally long. Returns the step, each rank's
    share, compute and wait, and the throughput against the sum of the ranks' solo throughputs
    (the measured ``throughput_fraction``'s prediction)."""
    factors = list(slowdown or [1.0] * world_size)
    if len(factors) != world_size:
        raise ValueError(f"slowdown has {len(factors)} factors for {world_size} ranks")

    def compute(r: int, n: float) -> float:  # data + slowed forward and backward
        layers = profile.at_batch(max(n, 1e-9)).layers
        fb = sum(x.forward_s + x.backward_s for x in layers)
        return profile.data_s * n / profile.batch + factors[r] * fb

    if policy == "dynamic":
        shares = [global_batch / world_size] * world_size
        for _ in range(200):  # shares <- shares x rate, to the fixed point
            rates = [n / compute(r, n) for r, n in enumerate(shares)]
            shares = [global_batch * x / sum(rates) for x in rates]
        shares = split(global_batch, shares)
    elif policy == "static":
        shares = split(global_batch, weights or [1.0] * world_size)
    else:
        raise ValueError(f"policy must be static or dynamic, got {policy!r}")
    own = [compute(r, n) for r, n in enumerate(shares)]
    comm = network.time("all_reduce", profile.grad_bytes, world_size) if world_size > 1 else 0.0
    step = max(own) + comm + profile.optimizer_s
    ideal = sum(n / (c + profile.optimizer_s) for n, c in zip(shares, own))
    return {
        "policy": policy,
        "shares": shares,
        "compute_s": own,
        "wait_s": [max(own) - c for c in own],
        "comm_s": comm,
        "optimizer_s": profile.optimizer_s,
        "step_s": step,
        "samples_per_s": global_batch / step,
        "ideal_samples_per_s": ideal,
        "throughput_fraction": global_batch / step / ideal,
    }


def straggler_throughput(factors: Sequence[float], mode: str) -> float:
    """Throughput with per-rank compute slowdowns ``factors``, as a fraction of the same run
    without them, when compute dominates the step (the sync/async lab).

    Synchronous modes (ddp, ddp_naive, local_sgd, diloco) wait for the slowest rank every step,
    or once a round, which over a round is the same wait: they run at its pace, 1 / max(f).
    Asynchronous ones (async_ps's workers, hogwild's ranks) never wait for each other: each rank
    contributes at its own pace, mean(1 / f)."""
    factors = [float(f) for f in factors]
    if not factors or min(factors) < 1:
        raise ValueError(f"factors must be >= 1, one per computing rank, got {factors}")
    if mode in ("async_ps", "hogwild"):
        return sum(1 / f for f in factors) / len(factors)
    if mode in ("ddp", "ddp_naive", "local_sgd", "diloco"):
        return 1 / max(factors)
    raise ValueError(
        f"unknown mode {mode!r}: choose ddp, ddp_naive, local_sgd, diloco, async_ps or hogwild"
    )


def compute_floor_s(
    cfg, forward_flops: float, backward_flops: float, flops_per_s: float, devices: int = 1
) -> float:
    """A lower bound on the seconds ``cfg``'s run computes: one sample's FLOPs
    (``labkit.labs.compute_profile.flops_per_sample``; activation checkpointing runs each forward
    twice)
    times every sample of every step, warm-up included, over ``devices`` devices each at
    ``flops_per_s`` (``labkit.env.matmul_flops_per_s``: on a CPU the whole machine, so 1).
    Not a prediction: communication, the optimizer, launching and slower small products all
    come on top of it. A panel says it before a run that will take long."""
    per_sample = forward_flops * (2 if cfg.activation_checkpointing else 1) + backward_flops
    return per_sample * cfg.global_batch * (cfg.steps + cfg.warmup) / (flops_per_s * devices)
