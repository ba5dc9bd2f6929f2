"""What a step prediction reads and returns: a rank's measured compute profile (``Profile``, one
``Layer`` per block) and the predicted step (``StepPrediction``), split as the probes split a
measured one. The predictors are ``labkit.predict.step`` (and the tensor-parallel and pipeline
steps it dispatches to)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


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
