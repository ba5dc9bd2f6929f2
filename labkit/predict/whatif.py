"""What-if presets for the step-time predictor: published interconnects and devices.

Bandwidths and FLOP/s are the vendors' published figures (per direction, dense); latencies are
typical values, not published specifications, and are labelled so. This machine's entries are
measured (``labkit.labs.comm`` and ``labkit.labs.compute_profile``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .collectives import AlphaBeta, CollectiveModel
from .step import Profile, scaling

GB = 1e9

INTERCONNECTS = {
    "PCIe 4.0 x16": AlphaBeta(
        5e-6, 32 * GB, "published 32 GB/s per direction; 5 us latency typical"
    ),
    "NVLink 4 (H100)": AlphaBeta(
        3e-6,
        450 * GB,
        "published 900 GB/s bidirectional = 450 GB/s per direction; 3 us latency typical",
    ),
    "100 GbE": AlphaBeta(
        20e-6, 12.5 * GB, "published 100 Gb/s = 12.5 GB/s; 20 us latency typical (TCP)"
    ),
    "400 Gb/s InfiniBand (NDR)": AlphaBeta(
        3e-6, 50 * GB, "published 400 Gb/s = 50 GB/s; 3 us latency typical"
    ),
}


@dataclass(frozen=True)
class Device:
    name: str
    flops_per_s: float | None  # None: use the measured profile as it is
    source: str


DEVICES = {
    "this machine": Device("this machine", None, "measured (labkit.labs.compute_profile)"),
    "H100 SXM": Device(
        "H100 SXM",
        989e12 * 0.5,
        "published 989 TFLOP/s dense bf16; 50 % of it "
        "assumed reached (typical of large dense training)",
    ),
}


def scenario_rows(
    profile: Profile,
    measured: CollectiveModel | None,
    devices: list[str],
    interconnects: list[str],
    world_sizes: list[int],
    strategy: str = "ddp",
    batch_per_rank: int | None = None,
    **knobs,
) -> list[dict]:
    """Predicted scaling for every (device, interconnect) pair; "this machine (measured)" as an
    interconnect uses ``measured``."""
    rows = []
    for dev_name in devices:
        dev = DEVICES[dev_name]
        prof = profile if dev.flops_per_s is None else profile.on_device(dev.flops_per_s, dev.name)
        for net_name in interconnects:
            if net_name == "this machine (measured)":
                if measured is None:
                    continue
                net = measured
            else:
                net = CollectiveModel.uniform(INTERCONNECTS[net_name])
            for r in scaling(
                prof, net, strategy, world_sizes, batch_per_rank or profile.batch, **knobs
            ):
                rows.append(
                    {
                        **r,
                        "scenario": f"{dev_name} + {net_name}",
                        "device": dev_name,
                        "interconnect": net_name,
                        "step_ms": 1e3 * r["step_s"],
                    }
                )
    return rows
