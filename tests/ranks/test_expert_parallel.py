"""Expert parallelism on real ranks: training equal to single-device training of the same mixture
of experts, the capacity dropping the very same tokens, and the all-to-alls' bytes counted on
the process group against the router's counts and the formula.

The dispatch alone, on thread ranks: tests/unit/test_moe.py."""

from __future__ import annotations

import pytest

from labkit import RunConfig
from labkit.labs import equivalence
from labkit.labs import experts as ex
from labkit.models import make_model
from labkit.predict.memory import moe_split

# 2 blocks of 4 experts, a skewed router and a tight capacity: every step drops tokens
MOE = RunConfig(
    strategy="ep",
    world_size=2,
    model="transformer",
    experts=4,
    width=32,
    depth=2,
    seq_len=8,
    global_batch=16,
    dataset_size=256,
    steps=4,
    warmup=0,
    capacity_factor=1.0,
    router_skew=1.0,
    timeout_s=120,
)


@pytest.mark.parametrize("world_size, top_k", [(2, 1), (4, 2)])
def test_ep_trains_as_single_does(world_size, top_k):
    """4 ranks on this 2-core machine are oversubscribed: slower, the same computation."""
    table = equivalence.check(MOE.replace(top_k=top_k), ["ep"], world_size=world_size, steps=4)
    assert table["ok"].all(), table.to_string()
    assert (table["compared_in"] == "float32").all(), table.to_string()


def test_the_capacity_drops_the_same_tokens_and_the_bytes_are_the_routers():
    out = ex.versus_single(MOE)
    assert out["max_abs_diff"] <= 1e-5
    drops = out["drops"]
    assert drops["same"].all(), drops[~drops["same"]].to_string()
    assert drops["dropped_single"].sum() > 0  # the skew overflows an expert every step
    b = ex.all_to_all_bytes(out["parallel"], MOE)
    assert (b["all_to_alls"] == 5 * MOE.depth).all()  # per block: counts, 2 forward, 2 backward
    # what the ranks handed the all-to-alls (labkit.wire) is exactly what the routers kept
    assert (b["counted_payload_bytes"] == b["router_payload_bytes"]).all(), b.to_string()
    # summed over ranks, the formula tokens x hidden x (N-1)/N per all-to-all, less exactly the
    # dropped assignments (never sent), four all-to-alls each
    per_step = b.groupby("step")[["counted_sent_bytes", "formula_bytes"]].sum()
    dropped = drops.groupby("step")["dropped_parallel"].sum()
    short = 4 * dropped * MOE.width * 4 * (MOE.world_size - 1) / MOE.world_size
    assert (per_step["formula_bytes"] - per_step["counted_sent_bytes"] - short).abs().max() < 1e-6
    # each rank holds the dense parameters and E/N experts: counted there, and as calculated
    dense, experts = moe_split(make_model(MOE.replace(strategy="single", world_size=1)))
    held = out["parallel"].groupby("rank")["mem_params_bytes"].max()
    assert (held == 4 * (dense + experts // MOE.world_size)).all(), held


def test_dp_by_ep_on_a_mesh_trains_as_single_and_counts_each_dimension_apart():
    """4 ranks (oversubscribed here): 2 groups of 2 share out the experts, 2 copies of each."""
    cfg = MOE.replace(world_size=4, ep=2)
    table = equivalence.check(cfg, ["ep"], world_size=4, steps=3)
    assert table["ok"].all(), table.to_string()
    res = ex.experiment.run(cfg.replace(steps=2))
    dense, experts = moe_split(make_model(cfg.replace(strategy="single", world_size=1, ep=None)))
    for _, rec in res.records.iterrows():
        # over all 4 ranks the dense gradients, over the 2 copies this rank's half of the experts
        reduced = sorted(s[3] for s in rec["comm_spans"] if s[0] == "all_reduce")
        assert reduced == sorted([4 * dense, 4 * experts // 2]), reduced
    b = ex.all_to_all_bytes(res.records, cfg)  # inside each group of 2, the routers' rows
    assert (b["all_to_alls"] == 5 * cfg.depth).all()
    assert (b["counted_payload_bytes"] == b["router_payload_bytes"]).all(), b.to_string()


def test_the_panel_runs_its_preset_then_a_skewed_router_and_refuses_bad_input():
    import json

    from labkit.widgets import moe_panel

    panel = moe_panel(MOE.replace(capacity_factor=1.25, router_skew=0.0), run_now=True)
    assert "done" in panel.status.value and len(panel.table) == 1
    shown = json.dumps([o["data"] for o in panel.out.outputs])
    assert "application/vnd.plotly.v1+json" in shown and "Load per expert" in shown
    panel.skew.value = 6.0
    panel.aux.value = 0.0
    panel.start().join(120)
    assert len(panel.table) == 2, panel.status.value
    even, skewed = panel.table["dropped_fraction"]
    assert skewed > even and panel.table["busiest_vs_even"].iloc[1] > 3.5  # one expert, ~all
    panel.experts.value = 2
    panel.top_k.value = 2
    assert not panel.run_button.disabled  # top-2 of 2 experts is allowed
    panel.base = panel.base.replace(world_size=4, global_batch=16)
    panel.check_controls()
    assert panel.run_button.disabled and "multiple of 4" in panel.status.value
