"""mesh4d on rank processes: every combination of two degrees of 2 at 4 ranks trains like
single-device training (the final parameters within 1e-5), three degrees of 2 at 8 ranks too
(slow; oversubscribed on a 2-core machine, which changes timing only), and the bytes each mesh
dimension carried (labkit.wire's tagged groups) equal their closed forms on every rank.

The layout (which ranks form each group) and the knobs are in tests/unit/test_mesh4d.py."""

from __future__ import annotations

import pytest

from labkit import RunConfig, experiment
from labkit.labs.equivalence import _max_diff
from labkit.strategies import mesh4d

TOL = 1e-5
F32 = 4  # bytes per value
# h = 64, 4 heads, s = 16, 2 blocks; a global batch of 32 in M = 2 micro-batches per replica
SMALL = RunConfig(
    strategy="mesh4d",
    model="transformer",
    width=64,
    depth=2,
    heads=4,
    seq_len=16,
    global_batch=32,
    microbatches=2,
    dataset_size=128,
    steps=2,
    warmup=0,
    deterministic=True,
)
PAIRS = {  # each two of the four degrees at 2, the others 1 (stages=1: no pipeline)
    "dp x tp": dict(tp=2, stages=1),
    "dp x cp": dict(cp=2, stages=1),
    "dp x pp": dict(stages=2),
    "tp x cp": dict(tp=2, cp=2, stages=1),
    "tp x pp": dict(tp=2, stages=2),
    "cp x pp": dict(cp=2, stages=2),
}


@pytest.fixture(scope="module")
def single():
    return experiment.run(SMALL.replace(strategy="single", world_size=1)).params


_RUNS: dict = {}


def mesh_run(world_size: int, **degrees):
    """One mesh4d run per layout in this module: the equivalence and the bytes tests read it."""
    key = (world_size, tuple(sorted(degrees.items())))
    if key not in _RUNS:
        _RUNS[key] = experiment.run(SMALL.replace(world_size=world_size, **degrees))
    return _RUNS[key]


@pytest.mark.parametrize("pair", PAIRS)
def test_two_degrees_of_2_at_4_ranks_train_like_single(single, pair):
    res = mesh_run(4, **PAIRS[pair])
    assert set(res.params) == set(single)
    diff = _max_diff(res.params, single)
    assert diff <= TOL, f"{pair}: {diff:g} from single"
    assert res.records["oversubscribed"].all()  # 4 ranks on 2 cores: said, not hidden


# ---- the bytes per dimension, each against its closed form --------------------------------------


def block_params(h: int, t: int) -> int:
    """One block's parameters on one tensor-parallel rank: qkv (3h^2 + 3h), proj's weight
    (h^2) and fc1 (4h^2 + 4h), fc2's weight (4h^2) split t ways; proj's and fc2's biases and the
    two LayerNorms (2h each) whole."""
    return (12 * h * h + 7 * h) // t + 6 * h


def expected_bytes(cfg: RunConfig, sizes: dict, rank_row: dict) -> dict:
    """Bytes this rank sends along each dimension in one step (the ring convention of
    labkit.wire: an all-reduce of S bytes on n ranks sends 2(n-1)/n S), from the model's sizes:

    * tp: Megatron's four all-reduces per block and micro-batch (f's and g's, forward and
      backward) of the activations, b x s/cp x h values each;
    * cp: the ring: each block and micro-batch passes K and V (2 b s/cp h/tp values) N-1 times
      forward, and again with dK, dV beside them backward: 3(N-1) messages; the last position
      broadcast from its owner to the head (b h values, each micro-batch; a chain: every rank
      but the one before the root sends it); and the parameters' partial gradients all-reduced
      (every parameter this rank holds but the head's);
    * pp: one activation forward and one gradient back per micro-batch and boundary, b s/cp h
      values each;
    * dp: every gradient this rank holds, all-reduced once.
    """
    h, s, L, P = cfg.width, cfg.seq_len, cfg.depth, sizes["pp"]
    d, c, t, M = sizes["dp"], sizes["cp"], sizes["tp"], cfg.microbatches
    b = cfg.global_batch // (d * M)
    stage = rank_row["stage"]
    blocks = L // P  # this test's cuts: the embedding and a block, a block and the head
    first, last = stage == 0, stage == P - 1
    embed = cfg.in_features * h + h + s * h
    head = 2 * h + h * cfg.classes + cfg.classes
    held = blocks * block_params(h, t) + first * embed  # all but the head
    act = b * (s // c) * h * F32  # one micro-batch's activations at a boundary
    ring = 2 * (t - 1) / t
    tp = M * blocks * 4 * ring * act
    kv = 2 * b * (s // c) * (h // t) * F32
    owner = 0  # zig-zag: rank 0 holds the last position
    cp_ring = M * blocks * 3 * (c - 1) * kv
    cp_bcast = M * b * h * F32 if last and c > 1 and rank_row["cp_rank"] != (owner - 1) % c else 0
    cp_grads = 2 * (c - 1) / c * held * F32
    pp = M * act * ((not last) + (not first))
    dp = 2 * (d - 1) / d * (held + last * head) * F32
    return {
        "tp": tp,
        "cp": cp_ring + cp_bcast + cp_grads,
        "cp ring": cp_ring,
        "pp": pp,
        "dp": dp,
    }


@pytest.mark.parametrize("pair", PAIRS)
def test_each_dimension_s_bytes_are_its_formula_s(pair):
    res = mesh_run(4, **PAIRS[pair])
    sizes = {"pp": res.cfg.stages, "dp": 1, "cp": res.cfg.cp or 1, "tp": res.cfg.tp or 1}
    sizes["dp"] = 4 // (sizes["pp"] * sizes["cp"] * sizes["tp"])
    for _, row in res.records.iterrows():
        want = expected_bytes(res.cfg, sizes, row)
        for d in ("tp", "cp", "pp", "dp"):
            assert row[f"comm_bytes_{d}"] == round(want[d]), (pair, row["rank"], d)
        ring = row["comm_tagged"]["cp"].get("send", (0, 0, 0))[2]
        assert ring == want["cp ring"], (pair, row["rank"])
    # the dimensions that are 1 carried nothing; each that is 2 carried something
    totals = {d: res.records[f"comm_bytes_{d}"].sum() for d in ("tp", "cp", "pp", "dp")}
    assert {d for d, v in totals.items() if v} == {d for d in sizes if sizes[d] > 1}


# ---- a fifth dimension: experts shared out over ep, carved out of dp ----------------------------

# nothing dropped (capacity >= every token of a group) and no auxiliary loss: a micro-batch's
# token groups hold other samples than single's (labkit.strategies.mesh4d says why)
EXPERTS = dict(experts=4, capacity_factor=4.0, aux_loss=0.0)
WITH_EP = {
    "dp x ep": dict(stages=1, ep=2),  # dp 4: two ep groups of 2, two copies of each expert
    "ep x pp": dict(stages=2, ep=2),
    "ep x cp": dict(cp=2, stages=1, ep=2),
}


@pytest.fixture(scope="module")
def single_experts():
    return experiment.run(SMALL.replace(strategy="single", world_size=1, **EXPERTS)).params


@pytest.mark.parametrize("layout", WITH_EP)
def test_experts_over_ep_train_like_single(single_experts, layout):
    res = mesh_run(4, **WITH_EP[layout], **EXPERTS)
    assert set(res.params) == set(single_experts)  # every expert, from the rank that holds it
    diff = _max_diff(res.params, single_experts)
    assert diff <= TOL, f"{layout}: {diff:g} from single"


@pytest.mark.parametrize("layout", WITH_EP)
def test_ep_s_all_to_alls_carry_the_rows_the_router_sent(layout):
    """Per MoE block and micro-batch, the counts (E int64) and the kept rows there and back,
    forward and backward: 8E + 2 x 4h x (rows this rank routed + rows routed to its experts)
    bytes handed to the all-to-alls, the rows read from every rank's router tally (the
    records' ``expert_routed`` minus ``expert_dropped``); the gradients over dp (the dense
    parameters) and edp (the experts', held by dp / ep copies)."""
    res = mesh_run(4, **WITH_EP[layout], **EXPERTS)
    cfg, df = res.cfg, res.records
    h, E, M = cfg.width, cfg.experts, cfg.microbatches
    sizes = {"pp": cfg.stages, "cp": cfg.cp or 1, "tp": 1, "ep": cfg.ep}
    sizes["dp"] = 4 // (sizes["pp"] * sizes["cp"])
    sizes["edp"] = sizes["dp"] // sizes["ep"]
    groups = mesh4d.layout(sizes, mesh4d.EXPERT_DIMS)["ep"]
    per = E // sizes["ep"]
    for step, at in df.groupby("step"):
        kept = {
            int(r["rank"]): [
                [a - b for a, b in zip(routed, dropped)]
                for routed, dropped in zip(r["expert_routed"], r["expert_dropped"])
            ]
            for _, r in at.iterrows()
        }
        for _, row in at.iterrows():
            r = int(row["rank"])
            peers = next(g for g in groups if r in g)
            mine = range(peers.index(r) * per, (peers.index(r) + 1) * per)
            layers = len(kept[r])
            rows = sum(sum(counts) for counts in kept[r])
            arriving = sum(
                kept[q][layer][e] for q in peers for layer in range(layers) for e in mine
            )
            want = layers * M * 8 * E + 2 * 4 * h * (rows + arriving)
            assert row["comm_tagged"]["ep"]["all_to_all"][1] == want, (layout, step, r)
            # gradients: every dense one over dp, the experts' over their edp copies
            stage, P = row["stage"], sizes["pp"]
            embed = cfg.in_features * h + h + cfg.seq_len * h
            head = 2 * h + h * cfg.classes + cfg.classes
            dense = layers * (4 * h * h + 8 * h + h * E + E)
            dense += (stage == 0) * embed + (stage == P - 1) * head
            experts = layers * per * (8 * h * h + 5 * h)
            d, edp = sizes["dp"], sizes["edp"]
            assert row["comm_bytes_dp"] == round(2 * (d - 1) / d * dense * F32), (layout, r)
            assert row["comm_bytes_edp"] == round(2 * (edp - 1) / edp * experts * F32), (layout, r)


# ---- the whole mesh: three degrees of 2 at 8 ranks ----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, degrees",
    [
        ("tp x cp x pp", dict(tp=2, cp=2, stages=2)),
        ("dp x tp x cp", dict(tp=2, cp=2, stages=1)),
        ("dp x cp x pp", dict(cp=2, stages=2)),
    ],
)
def test_three_degrees_of_2_at_8_ranks_train_like_single(single, name, degrees):
    res = mesh_run(8, **degrees)
    diff = _max_diff(res.params, single)
    assert diff <= TOL, f"{name}: {diff:g} from single"
    assert res.records["oversubscribed"].all()  # 8 ranks on 2 cores: said, not hidden
    sizes = {"pp": degrees["stages"], "cp": degrees.get("cp", 1), "tp": degrees.get("tp", 1)}
    sizes["dp"] = 8 // (sizes["pp"] * sizes["cp"] * sizes["tp"])
    for _, row in res.records.iterrows():
        want = expected_bytes(res.cfg, sizes, row)
        for d in ("tp", "cp", "pp", "dp"):
            assert row[f"comm_bytes_{d}"] == round(want[d]), (name, row["rank"], d)


@pytest.mark.slow
def test_experts_on_a_pp_x_dp_x_cp_mesh_with_ep_at_8_ranks_train_like_single(single_experts):
    """Four dimensions with a mixture of experts: pp 2 x dp 2 x cp 2, the dp pairs sharing out
    the experts (ep 2)."""
    res = mesh_run(8, stages=2, cp=2, ep=2, **EXPERTS)
    diff = _max_diff(res.params, single_experts)
    assert diff <= TOL, f"pp x dp(ep) x cp: {diff:g} from single"
    assert res.records["comm_bytes_ep"].gt(0).all()  # every rank sent rows to the others
