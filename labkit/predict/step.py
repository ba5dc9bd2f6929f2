"""Predict one training step from a measured compute profile and an alpha-beta network.

    predict(profile, network, strategy, world_size, global_batch, **knobs) -> StepPrediction

The profile (``labkit.labs.compute_profile.measure``) holds, per layer in forward order, the
forward and backward seconds at one per-rank batch and the bytes of each gradient tensor, plus the
optimizer's and the data loader's time per step. The network is a
``labkit.predict.collectives.CollectiveModel``: fitted on this machine (``labkit.labs.comm``) or a
published interconnect (``labkit.predict.whatif``). How each strategy spends a step, by what the
registry says of it (``labkit.registry.Strategy``):

* the reference (``single``): data + forward + backward + optimizer on the whole global batch.
* ``grad_sync="buckets"`` (``ddp``): gradients are packed into buckets in the order backward
  produces them (the reverse of the forward order) of ``bucket_cap_mb`` each (DDP's default:
  25 MB, the first bucket 1 MiB); a bucket's all-reduce starts once its last gradient is ready
  and the previous bucket's all-reduce is done, so it runs while backward computes earlier
  layers. What finishes after backward is exposed; the rest was hidden.
* ``grad_sync="per_tensor"`` (``ddp_naive``): one all-reduce per gradient tensor, back to back,
  after backward: all exposed.
* pipelines (``labkit.predict.pipeline_step``): the schedule simulator of
  ``labkit.predict.schedule`` on the profile's layers split into stages, each hand-off a
  point-to-point message of one micro-batch's activations.
* tensor splits (``labkit.predict.tensor_step``): each rank's share of every split block and
  the activation collectives of each Megatron pair.

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

from .. import registry
from ..shares import split
from .collectives import CollectiveModel, coefficients
from .pipeline_step import predict_pipeline
from .profile import Layer, Profile, StepPrediction
from .tensor_step import predict_tensor_parallel

MIB = 2**20
FIRST_BUCKET_BYTES = MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_BUCKET_MB = 25.0
# the strategies with a predictor: the reference, the data-parallel ones whose gradient average
# it times, the pipelines and the tensor splits
PREDICTED = tuple(
    n
    for n, s in registry.STRATEGIES.items()
    if s.reference or s.grad_sync or s.kind == "pipeline" or "tp" in s.knobs
)


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
    s = registry.get(strategy)
    if "tp" in s.knobs:  # every layer split over the ranks, or over each replica's tp ranks
        degree = world_size if s.kind == "tensor_parallel" else tp
        return predict_tensor_parallel(
            profile, network, s, world_size, global_batch, degree, sequence_parallel
        )
    if s.kind == "pipeline":
        return predict_pipeline(profile, network, s, world_size, global_batch, microbatches, bounds)
    if not (s.reference or s.grad_sync):
        raise ValueError(f"no predictor for strategy {strategy!r}: {', '.join(PREDICTED)}")
    return _data_parallel(
        profile, network, s, world_size, global_batch, bucket_cap_mb, accumulate, no_sync,
        compression,
    )  # fmt: skip


def _data_parallel(
    profile: Profile,
    network: CollectiveModel,
    strategy: registry.Strategy,
    world_size: int,
    global_batch: int,
    bucket_cap_mb: float | None,
    accumulate: int,
    no_sync: bool,
    compression: float,
) -> StepPrediction:
    """The reference on the whole batch, or every rank on its slice, then the gradient average
    as ``strategy.grad_sync`` says: DDP's buckets overlapped with backward, or one all-reduce
    per gradient after it."""
    ranks = 1 if strategy.reference else world_size
    micro = profile.at_batch(global_batch / ranks / accumulate)
    fwd = accumulate * sum(layer.forward_s for layer in micro.layers)
    bwd = accumulate * sum(layer.backward_s for layer in micro.layers)
    syncs = 1 if no_sync else accumulate
    data_s = accumulate * profile.data_s
    pred = StepPrediction(
        strategy.name, world_size, global_batch, data_s, fwd, bwd, profile.optimizer_s,
        0.0, 0.0, 0.0,
    )  # fmt: skip
    if ranks == 1:
        return pred
    per_byte = coefficients("all_reduce", ranks)[1]  # a ring all-reduce sends 2(n-1)/n of it
    pred.comm_bytes = syncs * profile.grad_bytes * compression * per_byte
    if strategy.grad_sync == "buckets":
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
    reference = registry.REFERENCE
    one = predict(profile, network, reference, 1, batch_per_rank).samples_per_s
    rows = []
    for n in world_sizes:
        p = predict(
            profile, network, strategy if n > 1 else reference, n, batch_per_rank * n, **knobs
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

    Synchronous modes (the data-parallel strategies, local SGD and DiLoCo) wait for the slowest
    rank every step, or once a round, which over a round is the same wait: they run at its pace,
    1 / max(f). Asynchronous ones (async_ps's workers, hogwild's ranks) never wait for each
    other: each rank contributes at its own pace, mean(1 / f)."""
    factors = [float(f) for f in factors]
    if not factors or min(factors) < 1:
        raise ValueError(f"factors must be >= 1, one per computing rank, got {factors}")
    s = registry.STRATEGIES.get(mode)
    if s is not None and s.kind == "asynchronous":
        return sum(1 / f for f in factors) / len(factors)
    if s is not None and (s.data_parallel or s.kind == "periodic"):
        return 1 / max(factors)
    modes = [n for n, s in registry.STRATEGIES.items() if s.data_parallel or s.kind in _PACED]
    raise ValueError(f"unknown mode {mode!r}: choose {', '.join(modes)}")


_PACED = ("periodic", "asynchronous")


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
