"""Load balancing in data parallelism, read off the records: throughput against what the ranks
could do alone, and the step-time predictor beside the measurement.

The rank side (stragglers, arrival times, dynamic shares, ``Join``) is ``labkit.rank.balancer``
and ``labkit.rank.join``; the shares themselves are ``labkit.shares``.
"""

from __future__ import annotations

import pandas as pd

from ..predict.step import predict_balance
from ..records import config_label
from ..shares import skew_weights, slowdown_at

# ---- prediction beside measurement --------------------------------------------------------------


def prediction_rows(table, configs, profile, network):
    """Per load-balancing run: the median step measured beside ``labkit.predict.step``'s
    ``predict_balance`` (steady state: each rank's final slowdown; dynamic shares at their
    fixed point), and the throughput fraction measured (whole run) beside predicted."""

    rows = []
    for cfg in configs:
        if not cfg.balancing or cfg.rebalance == "join":
            continue
        got = table[table["run"] == config_label(cfg)]
        if got.empty:
            continue
        factors = [slowdown_at(cfg.slowdown, r, 1 << 30) for r in range(cfg.world_size)]
        pred = predict_balance(
            profile,
            network,
            cfg.world_size,
            cfg.global_batch,
            factors,
            policy=cfg.rebalance,
            weights=skew_weights(cfg.world_size, cfg.skew),
        )
        measured = float(got["step_ms"].iloc[0])
        rows.append(
            {
                "run": config_label(cfg),
                "measured_ms": measured,
                "predicted_ms": 1e3 * pred["step_s"],
                "error": 1e3 * pred["step_s"] / measured - 1,
                "shares_predicted": "/".join(str(s) for s in pred["shares"]),
                "fraction_measured": float(got["throughput_fraction"].iloc[0]),
                "fraction_predicted": pred["throughput_fraction"],
            }
        )
    return pd.DataFrame(rows)
