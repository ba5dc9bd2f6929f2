"""The cluster-scheduling lab (notebook 11): jobs with throughput curves, traces, policies, an
event-driven simulator, and a real replay on this machine's cores to check it against.

    from labkit.labs.sched import traces, sim
    jobs = traces.generate(200, rate_per_hour=2.0, seed=0)
    table, runs = sim.compare(jobs, "4x8", ["fifo", "las", "elastic"])
"""

from .jobs import PRESETS, Curve, Job, curve_from_predictor, curve_from_records
from .policies import POLICIES, make_policy
from .sim import Cluster, SimResult, compare, metrics, simulate

__all__ = [
    "Curve",
    "Job",
    "PRESETS",
    "curve_from_predictor",
    "curve_from_records",
    "POLICIES",
    "make_policy",
    "Cluster",
    "SimResult",
    "simulate",
    "compare",
    "metrics",
]
