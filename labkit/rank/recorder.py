"""The one place a rank builds its records: one flat dict per (rank, step).

Every loop and strategy that records (the shared loop, the pipeline loop, the parameter server)
builds through ``Recorder.build``, so a record always has the same columns in the same order:
the run's identity, the step, this rank's loss on its own samples, every phase of
``TIME_COLUMNS`` on one clock, the clock reading the step started at, the CPU share, the memory
high-water mark, the bytes and calls on the process groups; then the loop's and the strategy's
own columns. The caller's side (``labkit.records.finalize``) combines ranks into the global-batch
loss and puts every rank on one origin; nothing stored here is an aggregate.
"""

from __future__ import annotations

import torch

from ..config import RunConfig
from ..dist import RankContext
from .probes import TIME_COLUMNS, peak_memory


class Recorder:
    """This rank's records of one run.

    ``identity``: columns beyond the run's own (strategy, world size, rank, device, global
    batch, accumulation, precision, activation checkpointing, threads) that every record of
    this rank carries: a pipeline's stage, a parameter server's role. ``loss_as``: the column
    this rank's loss goes to (an asynchronous worker's loss is not a shard of any global batch,
    so it goes to ``worker_loss`` and ``shard_loss`` is NaN)."""

    def __init__(self, cfg: RunConfig, ctx: RankContext, loss_as: str = "shard_loss", **identity):
        self.base = {
            "strategy": cfg.strategy,
            "world_size": cfg.world_size,
            "rank": ctx.rank,
            "device": str(ctx.device),
            "global_batch": cfg.global_batch,
            "accumulate": cfg.accumulate,
            "precision": cfg.precision,
            "checkpoint": cfg.activation_checkpointing,
            "threads": torch.get_num_threads(),
            **identity,
        }
        self.device, self.loss_as = ctx.device, loss_as
        self.records: list[dict] = []

    def build(
        self,
        step: int,
        loss: float | None,
        samples: int,
        timing: dict,
        traffic: dict,
        peak_mem_bytes: int | None = None,
        **columns,
    ) -> dict:
        """One step's record. ``loss``: this rank's mean loss over its own samples (None: it has
        none, e.g. a pipeline stage before the last); ``timing``: ``StepProbe.finish``'s columns;
        ``traffic``: ``labkit.wire.Traffic.take``'s counts; ``peak_mem_bytes``: the high-water
        mark read at the step's end (default: now); ``columns``: the loop's and the strategy's
        own, last."""
        if peak_mem_bytes is None:
            peak_mem_bytes = peak_memory(self.device)
        loss = float("nan") if loss is None else float(loss)
        rec = {
            **self.base,
            "step": step,
            "shard_loss": loss if self.loss_as == "shard_loss" else float("nan"),
            "samples": int(samples),
            **{c: float(timing[c]) for c in TIME_COLUMNS},
            "start_s": timing["start_s"],
            "compute_cpu_share": timing["compute_cpu_share"],
            "peak_mem_bytes": peak_mem_bytes,
            "comm_bytes": _count(traffic["comm_bytes"]),
            "comm_calls": _count(traffic["comm_calls"]),
            "comm_payload_bytes": _count(traffic["comm_payload_bytes"]),
            "comm_total_s": float(timing["comm_total_s"]),
        }
        if "comm_ops" in traffic:  # each operation by (name, group size): labkit.wire.count_ops
            rec["comm_ops"] = traffic["comm_ops"]
        if "comm_tagged" in traffic:  # a tagged group's share (labkit.wire.tag: a mesh dimension)
            rec["comm_tagged"] = traffic["comm_tagged"]
            for name, ops in traffic["comm_tagged"].items():
                rec[f"comm_bytes_{name}"] = int(round(sum(row[2] for row in ops.values())))
                rec[f"comm_calls_{name}"] = sum(row[0] for row in ops.values())
        if self.loss_as != "shard_loss":
            rec[self.loss_as] = loss
        rec.update(columns)
        return rec


def _count(n: float) -> int | float:
    """A whole count, or NaN where nothing could count it (``labkit.wire.COUNTING``)."""
    return int(n) if n == n else float("nan")
