"""A step of known phase lengths driven through a StepProbe (labkit.rank.probes)."""

from __future__ import annotations

import time

from labkit.rank.probes import PHASES, StepProbe


def timed_step(probe: StepProbe, naps: dict[str, float], **finish) -> dict:
    """One step through every phase, sleeping ``naps[phase]`` seconds in each (0 if absent);
    the probe's record, ``finish`` passed on to ``probe.finish``."""
    probe.start()
    for phase in PHASES:
        time.sleep(naps.get(phase, 0.0))
        probe.mark(phase)
    return probe.finish(**finish)
