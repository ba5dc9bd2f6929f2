"""Synchronous vs asynchronous training: the same task in five modes, read off their records.

Modes (``labkit.strategies``): ``ddp`` (every step waits for every rank: the reference),
``local_sgd`` and ``diloco`` (ranks train alone for ``period`` steps, then average: synchronous
once a round), ``async_ps`` (a parameter server applies each worker's gradient when it arrives)
and ``hogwild`` (ranks write one shared-memory model without locks).

Every mode's records become one **update curve** (``updates``): one row per optimizer update of
the model that is trained, in the order the updates landed, with the time since the first
measured step, the samples and bytes spent so far, the loss and (async modes) the update's
staleness. What one update is differs by mode, and the table says so:

* ddp, local_sgd, diloco: step k of every rank, ending when its slowest rank ends it; the loss is
  the global batch's (every rank's shard). local_sgd and diloco update W local models at once.
* async_ps: each gradient the server applied (a worker's batch of global_batch / workers).
* hogwild: each rank's write into the shared model (a rank's batch of global_batch / world_size).

Losses are training losses on the batch each update trained on, so they are noisy, and an async
update's batch is smaller. ``loss_smooth`` is their mean over the last ``window`` samples
(4 global batches by default) for every mode alike; ``to_target`` reads when it first falls
below a target. Bytes are the payload every rank handed to communication, summed over ranks
(DDP's gradients each step, local SGD's parameters each round, the server's pushes and replies);
hogwild's shared memory sends nothing.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from .. import registry
from ..records import BUSY_SHARE, cpu_share, run_label
from ..registry import SYNC_ASYNC

ASYNCHRONOUS = registry.names("asynchronous")


def _label(g: pd.DataFrame) -> str:
    row = g.iloc[0]
    v = row.get("variant", "")
    return run_label(
        row["strategy"],
        int(row["world_size"]),
        row.get("threads", 1),
        v if isinstance(v, str) else "",
    )


def runs(records: pd.DataFrame):
    """(label, records) per run, in the order the runs appear."""
    keys = ["strategy", "world_size"] + (["variant"] if "variant" in records else [])
    recs = (
        records.assign(variant=records["variant"].fillna("")) if "variant" in records else records
    )
    for _, g in recs.groupby(keys, sort=False):
        yield _label(g), g


def updates(records: pd.DataFrame, window: int | None = None) -> pd.DataFrame:
    """One row per model update of every run (see the module doc): run, strategy, update,
    time_s, loss, loss_smooth, samples, bytes (cumulative), staleness, averaged."""
    frames = []
    for label, g in runs(records):
        curve = _curve(g)
        batch = int(g["global_batch"].iloc[0])
        per_update = max(1.0, float(curve["samples_step"].median()))
        span = max(1, round((window or 4 * batch) / per_update))
        curve["loss_smooth"] = curve["loss"].rolling(span, min_periods=1).mean()
        curve["samples"] = curve.pop("samples_step").cumsum()
        curve["bytes"] = curve.pop("bytes_step").cumsum()
        curve.insert(0, "run", label)
        curve.insert(1, "strategy", g["strategy"].iloc[0])
        curve["update"] = np.arange(1, len(curve) + 1)
        frames.append(curve)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _curve(g: pd.DataFrame) -> pd.DataFrame:
    g = g.assign(end_s=g["start_s"] + g["step_s"])
    strategy = registry.get(g["strategy"].iloc[0])
    if strategy.server:  # the server's records: one per applied update
        server = g[g["role"] == "server"].sort_values("end_s")
        pushed = float(g.loc[g["role"] == "worker", "comm_bytes"].median())
        return pd.DataFrame(
            {
                "time_s": server["end_s"].to_numpy(),
                "loss": server["shard_loss"].to_numpy(),
                "samples_step": server["samples"].to_numpy(),
                "bytes_step": server["comm_bytes"].to_numpy() + pushed,
                "staleness": server["staleness"].to_numpy(),
                "averaged": 0,
            }
        )
    if strategy.kind == "asynchronous":  # every rank's own updates, in time order
        rows = g.sort_values("end_s")
        return pd.DataFrame(
            {
                "time_s": rows["end_s"].to_numpy(),
                "loss": rows["shard_loss"].to_numpy(),
                "samples_step": rows["samples"].to_numpy(),
                "bytes_step": rows["comm_bytes"].to_numpy(),
                "staleness": rows["staleness"].to_numpy(),
                "averaged": 0,
            }
        )
    steps = g.groupby("step").agg(
        time_s=("end_s", "max"),
        loss=("loss", "first"),
        samples_step=("samples", "sum"),
        bytes_step=("comm_bytes", "sum"),
    )
    steps["staleness"] = math.nan
    steps["averaged"] = g.groupby("step")["averaged"].max() if "averaged" in g else 1
    return steps.reset_index(drop=True)


def to_target(records: pd.DataFrame, target: float, window: int | None = None) -> pd.DataFrame:
    """Per run: the updates, wall time, samples and bytes until ``loss_smooth`` first reached
    ``target`` (NaN if it never did), beside the whole run's throughput (samples per second of
    wall time), final smoothed loss, averaging rounds and staleness; ``cpu_share``/``busy`` as
    ``summarize`` reads them (the least share any rank got, median over steps)."""
    curves = updates(records, window)
    rows = []
    for (label, g), (_, recs) in zip(curves.groupby("run", sort=False), runs(records)):
        hit = g[g["loss_smooth"] <= target]
        first = hit.iloc[0] if len(hit) else None
        stale = g["staleness"].dropna()
        share = cpu_share(recs)
        rows.append(
            {
                "run": label,
                "strategy": g["strategy"].iloc[0],
                "updates_to_target": math.nan if first is None else int(first["update"]),
                "seconds_to_target": math.nan if first is None else float(first["time_s"]),
                "samples_to_target": math.nan if first is None else int(first["samples"]),
                "bytes_to_target": math.nan if first is None else float(first["bytes"]),
                "final_loss": float(g["loss_smooth"].iloc[-1]),
                "samples_per_s": float(g["samples"].iloc[-1] / g["time_s"].iloc[-1]),
                "updates": len(g),
                "seconds": float(g["time_s"].iloc[-1]),
                "bytes": float(g["bytes"].iloc[-1]),
                "averaging_rounds": _rounds(g),
                "staleness_mean": float(stale.mean()) if len(stale) else math.nan,
                "staleness_max": float(stale.max()) if len(stale) else math.nan,
                "cpu_share": share,
                "busy": share < BUSY_SHARE,
            }
        )
    return pd.DataFrame(rows)


def _rounds(g: pd.DataFrame) -> int:
    """Parameter or gradient averages over the run: every update of a synchronous data-parallel
    mode, the rounds of a periodic one, none of an asynchronous one."""
    strategy = registry.get(g["strategy"].iloc[0])
    if strategy.kind == "periodic":
        return int(g["averaged"].sum())
    return len(g) if strategy.data_parallel else 0


def default_target(
    records: pd.DataFrame, fraction: float = 0.6, window: int | None = None
) -> float:
    """A target to read every run against: ``fraction`` of the way from the first smoothed loss
    down to the final smoothed loss of the synchronous reference (the first ddp run without a
    straggler, else the first run). Modes that never get there say so (NaN)."""
    curves = updates(records, window)
    start = float(curves.groupby("run", sort=False)["loss_smooth"].first().max())
    finals = curves.groupby("run", sort=False).agg(
        strategy=("strategy", "first"), final=("loss_smooth", "last")
    )
    ref = finals[(finals["strategy"] == SYNC_ASYNC[0]) & ~finals.index.str.contains("slow")]
    end = float((ref if len(ref) else finals)["final"].iloc[0])
    return start - fraction * (start - end)


def staleness(records: pd.DataFrame) -> pd.DataFrame:
    """Per async run, how many updates with each staleness: run, staleness, count, share."""
    curves = updates(records)
    curves = curves[curves["strategy"].isin(ASYNCHRONOUS)].dropna(subset=["staleness"])
    out = curves.groupby(["run", "staleness"], sort=False).size().rename("count").reset_index()
    out["share"] = out["count"] / out.groupby("run")["count"].transform("sum")
    return out


def sweep(base, modes=SYNC_ASYNC, straggler: float = 1.0, **overrides) -> list:
    """Configs for ``modes`` on ``base``'s task, each with rank 1 slowed ``straggler``x when
    above 1 (async_ps: world_size + 1 ranks, so it has as many workers as the others ranks)."""
    configs = []
    for mode in modes:
        w = base.world_size + registry.get(mode).server
        slow = ((1, straggler, None),) if straggler > 1 else ()
        configs.append(base.replace(strategy=mode, world_size=w, slowdown=slow, **overrides))
    return configs


def people_table(table: pd.DataFrame) -> pd.DataFrame:
    """``to_target``'s table with readable headers and units (for a notebook or a terminal)."""

    def num(v, fmt):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    return pd.DataFrame(
        {
            "run": table["run"],
            "updates to target": [num(v, ".0f") for v in table["updates_to_target"]],
            "samples to target": [num(v, ".0f") for v in table["samples_to_target"]],
            "s to target": [num(v, ".2f") for v in table["seconds_to_target"]],
            "MB to target": [num(v / 1e6, ".1f") for v in table["bytes_to_target"]],
            "samples/s": [num(v, ".0f") for v in table["samples_per_s"]],
            "final loss": [num(v, ".3f") for v in table["final_loss"]],
            "averaging rounds": table["averaging_rounds"],
            "staleness mean / max": [
                f"{num(a, '.2f')} / {num(b, '.0f')}"
                for a, b in zip(table["staleness_mean"], table["staleness_max"])
            ],
            "cpu share": [
                num(v, ".2f") + (" busy" if b else "")
                for v, b in zip(table["cpu_share"], table["busy"])
            ],
        }
    )
