"""mesh4d's layout and knobs, with no process started: which global ranks form each group of
each dimension (by hand, and against torch's own DeviceMesh on the fake process group, in this
process), each rank's coordinates, and the configurations refused with their fix.

Training equal to single and the bytes per dimension are in tests/ranks/test_mesh4d.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from labkit import RunConfig, registry
from labkit.dist import fake_rank
from labkit.strategies import mesh4d

MESH = RunConfig(strategy="mesh4d", model="transformer", width=64, depth=2, world_size=8)


def test_the_layout_of_a_2x2x2_mesh_by_hand():
    groups = mesh4d.layout({"pp": 2, "dp": 1, "cp": 2, "tp": 2})
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # neighbours: the innermost
    assert groups["cp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["dp"] == [[r] for r in range(8)]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]  # the outermost
    groups = mesh4d.layout({"pp": 2, "dp": 2, "cp": 1, "tp": 2})
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert mesh4d.coordinates(5, {"pp": 2, "dp": 1, "cp": 2, "tp": 2}) == {
        "pp": 1,
        "dp": 0,
        "cp": 0,
        "tp": 1,
    }


def test_every_rank_is_in_one_group_of_each_dimension():
    sizes = {"pp": 2, "dp": 3, "cp": 2, "tp": 2}
    for d, groups in mesh4d.layout(sizes).items():
        assert sorted(r for g in groups for r in g) == list(range(24)), d
        assert {len(g) for g in groups} == {sizes[d]}


@pytest.mark.parametrize(
    "sizes",
    [
        {"pp": 2, "dp": 1, "cp": 2, "tp": 2},
        {"pp": 1, "dp": 2, "cp": 2, "tp": 2},
        {"pp": 2, "dp": 2, "cp": 1, "tp": 1},
    ],
)
def test_the_layout_is_torch_s_device_mesh_s(sizes):
    """What each rank's mesh makes on torch's fake process group (one rank at a time, in this
    process): its group along each dimension, and its coordinate there."""
    groups = mesh4d.layout(sizes)
    n = 1
    for s in sizes.values():
        n *= s
    for rank in range(n):
        with fake_rank(rank, n):
            shape = [sizes[d] for d in mesh4d.DIMS]
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=mesh4d.DIMS)
            for d in mesh4d.DIMS:
                mine = next(g for g in groups[d] if rank in g)
                assert dist.get_process_group_ranks(mesh.get_group(d)) == mine, (rank, d)
                assert mesh.get_local_rank(d) == mesh4d.coordinates(rank, sizes)[d], (rank, d)


def test_the_registry_row_names_the_module_s_dimensions():
    s = registry.get("mesh4d")
    assert s.mesh == mesh4d.DIMS and s.kind == "composed" and s.schedule == "1f1b"
    assert mesh4d.DIMS[-1] == "tp"  # tensor parallelism innermost


def test_degrees_unset_are_1_and_dp_takes_the_rest():
    cfg = MESH.replace(tp=2, cp=2, stages=2)
    assert mesh4d.degrees(cfg) == {"pp": 2, "dp": 1, "cp": 2, "tp": 2, "edp": 1, "ep": 1}
    cfg = MESH.replace(world_size=4, stages=1)
    assert mesh4d.degrees(cfg) == {"pp": 1, "dp": 4, "cp": 1, "tp": 1, "edp": 4, "ep": 1}
    cfg = MESH.replace(world_size=8, tp=2, stages=2, global_batch=64, microbatches=4)
    assert cfg.pipelines == 2 and cfg.batch_per_rank == 64 // (2 * 4)


@pytest.mark.parametrize(
    "changes, fix",
    [
        (dict(world_size=6, tp=2, stages=2), "set world_size to a multiple of 4"),
        (dict(tp=2, heads=3, width=66), "pick heads that are a multiple of 2"),
        (dict(cp=2, seq_len=6, stages=1), "pick a seq_len that is a multiple of 4"),
        (dict(tp=2, sequence_parallel=True), "set sequence_parallel=False"),
        (dict(stages=4, depth=2, world_size=4), "raise depth or lower stages"),
        (dict(model="mlp"), "set model='transformer'"),
        (dict(tp=2, stages=2, global_batch=60), "pick a batch that is a multiple of 8"),
    ],
)
def test_bad_layouts_are_refused_with_the_fix(changes, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        MESH.replace(**changes)


def test_the_expert_layout_splits_each_dp_group_into_ep_groups():
    """Experts: dp's groups (of the 4-D mesh) are each an edp x ep block of the 5-D one."""
    sizes = {"pp": 2, "dp": 4, "cp": 1, "tp": 1, "edp": 2, "ep": 2}
    dense = mesh4d.layout(sizes)
    experts = mesh4d.layout(sizes, mesh4d.EXPERT_DIMS)
    assert dense["dp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert experts["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert experts["edp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    for group in dense["dp"]:  # every ep and edp group lies inside one dp group
        for d in ("ep", "edp"):
            inside = [g for g in experts[d] if set(g) <= set(group)]
            assert sorted(r for g in inside for r in g) == group, d
    with fake_rank(5, 8):
        shape = [sizes[d] for d in mesh4d.EXPERT_DIMS]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=mesh4d.EXPERT_DIMS)
        assert dist.get_process_group_ranks(mesh.get_group("ep")) == [4, 5]
        assert dist.get_process_group_ranks(mesh.get_group("edp")) == [5, 7]


@pytest.mark.parametrize(
    "changes, fix",
    [
        (dict(tp=2), "set tp=1 (or experts=0)"),
        (dict(ep=3, world_size=6, global_batch=48), "set ep to a divisor of both 6 and 4"),
        (dict(ep=8), "set ep to a divisor of both 8 and 4"),
    ],
)
def test_bad_expert_layouts_are_refused_with_the_fix(changes, fix):
    experts = MESH.replace(experts=4, stages=1)
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        experts.replace(**changes)
    assert mesh4d.degrees(experts.replace(ep=2)) == {
        "pp": 1, "dp": 8, "cp": 1, "tp": 1, "edp": 4, "ep": 2
    }  # fmt: skip
