"""PyTorch's profiler over a rank's measured steps (``RunConfig.profile_dir``).

``torch.profiler`` records every operator a rank runs (and, on GPUs, every CUDA kernel); labkit
names its own phases inside that view (``forward``, ``backward``, ``comm``, ``optimizer``, ...,
as ``record_function`` ranges around each phase the loop marks), so PyTorch's operators appear
under the phase that ran them and DDP's all-reduce under the communication hook. A schedule skips
the first measured step (warm-up) and records up to ``ACTIVE`` steps; each rank writes one
Chrome trace, ``<strategy>@<world size>_rank<r>.json``, that Perfetto and ``chrome://tracing``
open.
"""

from __future__ import annotations

import os

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile, schedule

ACTIVE = 5  # steps recorded after one of warm-up: enough to see a pattern, small enough to open


class RankProfiler:
    """``start()`` before the first measured step, ``step()`` after each, ``stop()`` at the end;
    ``enter(phase)``/``exit(phase)`` name each phase's range; does nothing unless
    ``cfg.profile_dir`` is set."""

    def __init__(self, cfg, rank: int, device: torch.device, steps: int):
        self.on = cfg.profile_dir is not None
        self._ranges: list[record_function] = []
        if not self.on:
            return
        os.makedirs(cfg.profile_dir, exist_ok=True)
        # Kineto, the profiler's engine, logs every CUDA probe it tries on a machine without
        # a GPU at ERROR level: keep its log to what matters
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self.path = os.path.join(
            cfg.profile_dir, f"{cfg.strategy}@{cfg.world_size}_rank{rank}.json"
        )
        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.prof = profile(
            activities=activities,
            schedule=schedule(
                wait=0, warmup=min(1, steps - 1), active=max(1, min(ACTIVE, steps - 1)), repeat=1
            ),
            on_trace_ready=lambda p: p.export_chrome_trace(self.path),
        )

    def enter(self, phase) -> None:
        """Open ``phase``'s range (a phase of ``labkit.rank.watch``: its ``name``)."""
        self._ranges.append(record_function(phase.name))
        self._ranges[-1].__enter__()

    def exit(self, phase) -> None:
        self._ranges.pop().__exit__(None, None, None)

    def start(self) -> None:
        if self.on:
            self.prof.start()

    def step(self) -> None:
        if self.on:
            self.prof.step()

    def stop(self) -> None:
        if self.on:
            self.prof.stop()
