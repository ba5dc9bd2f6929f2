"""What this machine has, and what labkit will use on it.

This is the articles' "check your environment" step (``torch.cuda.is_available()``,
``device_count()``) done properly: it also says which backends exist, which one labkit picks,
and how many ranks the machine can run honestly.
"""

from __future__ import annotations

import dataclasses
import html
import os
import platform
import warnings
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.distributed as dist


class OversubscribedWarning(UserWarning):
    """More CPU ranks than cores: they time-share, so speed-ups are not real parallelism."""


def usable_cores() -> list[int] | None:
    """The cores this process may run on, in order (taskset/cgroup affinity); None where the
    platform cannot say (macOS, Windows)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return None


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity, unlike os.cpu_count)."""
    cores = usable_cores()
    return len(cores) if cores is not None else os.cpu_count() or 1


def threads_per_rank(ranks: int, device: str) -> int:
    """Torch threads each of ``ranks`` processes gets: on CPU the ranks share the cores (never
    more threads than cores in all); on GPUs one, to feed its device."""
    return max(1, cpu_cores() // ranks) if device == "cpu" else 1


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    memory_gib: float
    capability: str


@dataclass(frozen=True)
class EnvReport:
    python: str
    torch: str
    cuda: str | None
    cudnn: int | None
    devices: tuple[Device, ...]
    cpu_cores: int
    backends: dict = field(default_factory=dict)  # name -> available
    device: str = "cpu"  # what labkit uses by default: "cuda" or "cpu"
    backend: str = "gloo"
    max_world_size: int = 1  # largest world size served without sharing

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def lines(self) -> list[str]:
        cuda = f"built for CUDA {self.cuda}" if self.cuda else "CPU-only build"
        out = [f"python {self.python}, torch {self.torch} ({cuda})", f"CPU cores: {self.cpu_cores}"]
        if self.devices:
            out += [
                f"cuda:{d.index}  {d.name}  {d.memory_gib:.1f} GiB  sm_{d.capability}"
                for d in self.devices
            ]
        else:
            out.append("GPUs: none (ranks will be CPU processes talking over gloo)")
        out.append(
            "backends: "
            + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in self.backends.items())
        )
        out.append(f"labkit uses: device={self.device}, backend={self.backend}")
        unit = "GPU" if self.device == "cuda" else "core"
        out.append(f"largest honest world size: {self.max_world_size} (one rank per {unit})")
        if self.device == "cpu":
            out.append(
                "  more ranks are allowed on CPU, but they share cores and are flagged "
                "as oversubscribed"
            )
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td style='text-align:left'>{html.escape(k)}</td>"
            f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
            for k, v in self._table().items()
        )
        return (
            f"<table><thead><tr><th colspan=2 style='text-align:left'>labkit environment"
            f"</th></tr></thead><tbody>{rows}</tbody></table>"
        )

    def _table(self) -> dict:
        gpus = (
            "; ".join(
                f"cuda:{d.index} {d.name} ({d.memory_gib:.1f} GiB, sm_{d.capability})"
                for d in self.devices
            )
            or "none"
        )
        return {
            "Python": self.python,
            "torch": self.torch,
            "torch built for CUDA": self.cuda or "none (CPU-only build)",
            "GPUs": gpus,
            "CPU cores": self.cpu_cores,
            "backends": ", ".join(k for k, v in self.backends.items() if v),
            "labkit device / backend": f"{self.device} / {self.backend}",
            "largest honest world size": self.max_world_size,
        }


def probe() -> EnvReport:
    """Inspect this machine without initialising any process group."""
    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            devices.append(Device(i, p.name, p.total_memory / 2**30, f"{p.major}{p.minor}"))
    backends = {
        "nccl": dist.is_nccl_available() and bool(devices),
        "gloo": dist.is_gloo_available(),
        "mpi": dist.is_mpi_available(),
    }
    device = "cuda" if devices else "cpu"
    cores = cpu_cores()
    return EnvReport(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        devices=tuple(devices),
        cpu_cores=cores,
        backends=backends,
        device=device,
        backend=default_backend(device),
        max_world_size=len(devices) or cores,
    )


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"


def resolve_device(device: str, ranks: int) -> str:
    """Turn "auto"/"cpu"/"cuda" into the device type ranks will use, or say what to change."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "auto":
        return "cuda" if gpus >= ranks else "cpu"
    if device == "cuda":
        if gpus == 0:
            raise ValueError(
                "device='cuda' but this machine has no usable GPU: use device='cpu' (or 'auto')"
            )
        if ranks > gpus:
            raise ValueError(
                f"world size {ranks} needs {ranks} GPUs (one per rank) but this machine "
                f"has {gpus}: lower world_size to {gpus} or use device='cpu'"
            )
    elif device != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return device


def oversubscription(ranks: int, threads_per_rank: int = 1) -> str | None:
    """A sentence saying why timings of this many CPU ranks mislead, or None if they don't."""
    cores = cpu_cores()
    if ranks * threads_per_rank <= cores:
        return None
    return (
        f"{ranks} CPU ranks x {threads_per_rank} thread(s) on {cores} cores: ranks time-share "
        f"the cores, so throughput and speed-ups at this world size are not real parallelism"
    )


def warn_if_oversubscribed(ranks: int, threads_per_rank: int = 1) -> str | None:
    msg = oversubscription(ranks, threads_per_rank)
    if msg:
        warnings.warn(msg, OversubscribedWarning, stacklevel=3)
    return msg


@cache
def matmul_flops_per_s(device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """This machine's matmul rate in FLOP/s on ``device`` (on a CPU with every core at work):
    1024 x 1024 products in ``dtype``, the best of five windows of 30 ms (a window another
    program shared reads slow; the best is the machine's), measured once per process.
    Training's smaller and thinner products run slower than this, so FLOPs divided by it bound
    a run's compute time from below (``labkit.predict.step.compute_floor_s``)."""
    import time

    a = torch.randn(1024, 1024, device=device).to(dtype)
    a @ a  # the first product pays for thread pools and kernel selection
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    best = 0.0
    for _ in range(5):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.03:
            a @ a
            n += 1
            sync()
        best = max(best, n * 2 * 1024**3 / (time.perf_counter() - t0))
    return best


@cache
def fp16_supported(device_type: str) -> bool:
    """Does this torch run fp16 autocast and a GradScaler on ``device_type``? (Tried, not
    assumed: some torch releases raise on CPU.)"""
    if device_type == "cuda":
        return torch.cuda.is_available()
    try:
        x = torch.ones(2, 2, requires_grad=True)
        with torch.autocast(device_type, dtype=torch.float16):
            y = x @ x
        if y.dtype != torch.float16:
            return False
        scaler = torch.amp.GradScaler(device_type)
        scaler.scale(y.float().sum()).backward()
        return scaler.is_enabled()
    except (RuntimeError, ValueError, AssertionError, TypeError):
        return False
