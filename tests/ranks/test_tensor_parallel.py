"""Tensor parallelism (labkit.strategies.tp by hand, tp_dtensor through DTensor): each split
layer, each operator and each whole model against its dense counterpart; bytes per layer counted
where they travel against the Megatron-LM formulas. Real 2-rank gloo groups (labkit.launch).

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_tensor_parallel.py."""

from __future__ import annotations

import copy
import dataclasses
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import launch
from labkit.data import ToySequences
from labkit.models import mlp, transformer
from labkit.strategies import tp

T = 2  # tensor-parallel degree: the machine has 2 cores
B, S, H, HEADS = 4, 16, 64, 4  # batch, sequence, hidden, heads for the per-layer checks
TOL = 1e-5


def _launch(fn, *args):
    return launch(fn, T, args=args, device="cpu", timeout_s=120)


# ---- one Linear, split: two real ranks ----------------------------------------------------------


def _linears_on_ranks(ctx) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(range(ctx.world_size)))
    r, t = ctx.rank, ctx.world_size
    torch.manual_seed(0)
    dense = nn.Linear(8, 12)
    x = torch.randn(5, 8, requires_grad=True)
    up = torch.randn(5, 12)
    (dense(x) * up).sum().backward()
    out = {}

    col = tp.ColumnParallelLinear(dense, group)
    xc = x.detach().clone().requires_grad_()
    y = col(xc)
    (y * up.chunk(t, 1)[r]).sum().backward()
    grads = tp.full_state(col, group, grads=True)
    out["column"] = [
        (y - dense(x).chunk(t, 1)[r]).abs().max().item(),
        (grads["weight"] - dense.weight.grad).abs().max().item(),
        (grads["bias"] - dense.bias.grad).abs().max().item(),
        (xc.grad - x.grad).abs().max().item(),  # f's backward all-reduce made it whole
    ]
    row = tp.RowParallelLinear(dense, group)
    xr = x.detach().chunk(t, 1)[r].clone().requires_grad_()
    y = row(xr)
    (y * up).sum().backward()
    grads = tp.full_state(row, group, grads=True)
    out["row"] = [
        (y - dense(x)).abs().max().item(),  # g's all-reduce made it whole
        (grads["weight"] - dense.weight.grad).abs().max().item(),
        (grads["bias"] - dense.bias.grad).abs().max().item(),
        (xr.grad - x.grad.chunk(t, 1)[r]).abs().max().item(),
    ]
    out["local_shapes"] = [tuple(col.weight.shape), tuple(row.weight.shape)]
    return out


def test_column_and_row_parallel_linears_on_two_ranks_equal_the_dense_linear():
    for out in _launch(_linears_on_ranks):
        assert out["local_shapes"] == [(12 // T, 8), (12, 8 // T)]  # really split
        assert max(out["column"]) <= 1e-6, out
        assert max(out["row"]) <= 1e-6, out


# ---- the conjugate operators, against hand-computed values --------------------------------------


def _operators(ctx) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(range(ctx.world_size)))
    r = ctx.rank
    out = {}

    def run(fn, x, up):
        x = x.clone().requires_grad_()
        y = fn.apply(x, group)
        y.backward(up)
        return y.detach().flatten().tolist(), x.grad.flatten().tolist()

    c = float(r + 1)  # rank 0 holds 1s, rank 1 holds 2s
    out["f"] = run(tp.CopyToRegion, torch.full((2,), c), torch.full((2,), 10 * c))
    out["g"] = run(tp.ReduceFromRegion, torch.full((2,), c), torch.full((2,), 10 * c))
    # sequence dimension 1: (batch 1, sequence, hidden 1)
    seq = torch.tensor([1.0, 2.0]).view(1, 2, 1) + 2 * r  # rank 0 [1, 2], rank 1 [3, 4]
    full = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 4, 1) * c  # a whole sequence per rank
    out["gather_to_region"] = run(tp.GatherSequenceToRegion, seq, full)
    out["scatter_from_region"] = run(tp.ScatterSequenceFromRegion, full, seq)
    out["split"] = run(tp.SplitSequence, full, seq)
    out["gather"] = run(tp.GatherSequence, seq, full)
    return out


def test_conjugate_operators_sum_where_the_papers_say_hand_computed():
    r0, r1 = _launch(_operators)
    # f: identity forward; backward sums dL/dX over ranks: 10 + 20 on both
    assert r0["f"] == ([1, 1], [30, 30]) and r1["f"] == ([2, 2], [30, 30])
    # g: forward sums over ranks (1 + 2); backward identity: each rank's own 10c
    assert r0["g"] == ([3, 3], [10, 10]) and r1["g"] == ([3, 3], [20, 20])
    # sequence parallelism's f: all-gather [1,2] + [3,4]; backward reduce-scatter of
    # c x [1,2,3,4] (c = 1, 2): sum 3 x [1,2,3,4], rank 0 keeps [3,6], rank 1 [9,12]
    assert r0["gather_to_region"] == ([1, 2, 3, 4], [3, 6])
    assert r1["gather_to_region"] == ([1, 2, 3, 4], [9, 12])
    # its g: reduce-scatter of c x [1,2,3,4]; backward all-gather of [1,2], [3,4]
    assert r0["scatter_from_region"] == ([3, 6], [1, 2, 3, 4])
    assert r1["scatter_from_region"] == ([9, 12], [1, 2, 3, 4])
    # into the sequence-parallel part: keep my slice; backward all-gather (no sum)
    assert r0["split"] == ([1, 2], [1, 2, 3, 4]) and r1["split"] == ([6, 8], [1, 2, 3, 4])
    # out of it: all-gather; backward keep my slice of my own gradient (not a sum: the head's
    # gradient is the same on every rank, summing would count it twice)
    assert r0["gather"] == ([1, 2, 3, 4], [1, 2]) and r1["gather"] == ([1, 2, 3, 4], [6, 8])


# ---- whole models: forward, backward and 5 SGD steps against the dense model --------------------


def _whole_model(ctx, impl: str, kind: str, sp: bool, sync_sp_grads: bool = True) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.strategies import tp_dtensor

    torch.manual_seed(0)
    dense = transformer(32, H, 2, 10, heads=HEADS, seq_len=S) if kind == "transformer" else None
    dense = dense or mlp(32, H, 3, 10)  # depth 3: a pair and an unpaired hidden Linear
    if impl == "hand":
        group = dist.new_group(list(range(ctx.world_size)))
        model = tp.parallelize(copy.deepcopy(dense), group, sp)

        def whole(grads=False):
            return tp.full_state(model, group, grads=grads)
    else:
        model = tp_dtensor.parallelize(copy.deepcopy(dense), init_device_mesh("cpu", (T,)), sp)

        def whole(grads=False):
            if grads:
                return {n: p.grad.full_tensor() for n, p in model.named_parameters()}
            return tp_dtensor.full_state(model)

    g = torch.Generator().manual_seed(1)
    shape = (8, S, 32) if kind == "transformer" else (8, 32)
    x, y = torch.randn(*shape, generator=g), torch.randint(0, 10, (8,), generator=g)
    # foreach: the GPU default, where DTensor and plain parameters must not mix
    opts = [
        torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, foreach=True) for m in (dense, model)
    ]
    diffs = {}
    for step in range(5):
        out_dense, out = dense(x), model(x)
        F.cross_entropy(out_dense, y).backward()
        F.cross_entropy(out, y).backward()
        if impl == "hand" and sp and sync_sp_grads:
            tp.allreduce_sequence_parallel_grads(model, group)
        if step == 0:
            diffs["forward"] = (out - out_dense).abs().max().item()
            grads = whole(grads=True)
            diffs["grads"] = max(
                (p.grad - grads[n]).abs().max().item() for n, p in dense.named_parameters()
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
    state = whole()
    assert set(state) == {n for n, _ in dense.named_parameters()}
    diffs["params"] = max(
        (p.detach() - state[n]).abs().max().item() for n, p in dense.named_parameters()
    )
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    diffs["local_share"] = local / sum(p.numel() for p in dense.parameters())
    return diffs


CASES = [
    ("hand", "mlp", False),
    ("hand", "transformer", False),
    ("hand", "transformer", True),
    ("dtensor", "mlp", False),
    ("dtensor", "transformer", False),
    ("dtensor", "transformer", True),
]


@pytest.mark.parametrize("impl,kind,sp", CASES)
def test_parallel_model_equals_the_dense_model_forward_backward_and_5_steps(impl, kind, sp):
    for diffs in _launch(_whole_model, impl, kind, sp):
        assert diffs["forward"] <= TOL, diffs
        assert diffs["grads"] <= TOL, diffs
        assert diffs["params"] <= TOL, diffs
        assert diffs["local_share"] < 0.8, diffs  # each rank holds a part of the model


def test_sequence_parallel_without_the_layernorm_all_reduce_drifts_from_dense():
    # the control: the same check fails when the LayerNorms' partial gradients are not summed
    for diffs in _launch(_whole_model, "hand", "transformer", True, False):
        assert diffs["grads"] > 1e-3, diffs


# ---- bytes per transformer layer, counted where they travel -------------------------------------


@contextmanager
def _wrapped_collectives(calls: list):
    """Record (name, bytes handed to it) for every torch.distributed collective tp.py calls."""
    import torch.distributed as dist

    names = ("all_reduce", "all_gather_single", "reduce_scatter_single")
    saved = {n: getattr(dist, n) for n in names}

    def counting(name, fn):
        def call(*args, **kwargs):
            # the whole message: all-reduce's buffer, all-gather's gathered output,
            # reduce-scatter's input (the larger of the two tensors these take)
            nbytes = max(a.numel() * a.element_size() for a in args if torch.is_tensor(a))
            calls.append((name, nbytes))
            return fn(*args, **kwargs)

        return call

    for n in names:
        setattr(dist, n, counting(n, saved[n]))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _layer_bytes(ctx, impl: str, sp: bool) -> dict:
    """One transformer block's forward and backward: each collective, from two counters: the
    torch.distributed functions wrapped (tp.py's calls), and a pre-hook on the process group
    itself (which also sees DTensor's functional collectives)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from labkit.strategies import tp_dtensor

    torch.manual_seed(0)
    model = transformer(32, H, 1, 10, heads=HEADS, seq_len=S)
    if impl == "hand":
        group = dist.new_group(list(range(ctx.world_size)))
        tp.parallelize(model, group, sp)
    else:
        mesh = init_device_mesh("cpu", (T,))
        group = mesh.get_group()
        tp_dtensor.parallelize(model, mesh, sp)
    hooked: list = []

    def pre(args):  # bytes the op was handed: the input (an all-gather: its gathered output)
        name = str(args.name).rpartition(".")[2].lower()
        t = args.output_tensors if name == "allgather" else args.input_tensors
        hooked.append((name, sum(x.numel() * x.element_size() for x in t)))

    group.register_pre_hook(0x7E57, pre)
    block = model[1]
    x = torch.randn(B, S // T if sp else S, H, requires_grad=True)
    wrapped: list = []
    out = {}
    with _wrapped_collectives(wrapped):
        y = block(x)
        out["forward"], out["forward_hooked"] = list(wrapped), list(hooked)
        wrapped.clear(), hooked.clear()
        y.backward(torch.randn_like(y))
        out["backward"], out["backward_hooked"] = list(wrapped), list(hooked)
        wrapped.clear(), hooked.clear()
        if impl == "hand" and sp:
            tp.allreduce_sequence_parallel_grads(model, group)
            out["after"] = list(wrapped)
    group.unregister_pre_hook(0x7E57)
    return out


def _ring(calls: list, t: int = T) -> float:
    """Bytes a rank sends for these collectives under the ring algorithms."""
    share = {"allreduce": 2 * (t - 1) / t, "allgather": (t - 1) / t, "reduce_scatter": (t - 1) / t}
    return sum(share[name] * n for name, n in calls)


@pytest.mark.parametrize("impl", ["hand", "dtensor"])
def test_bytes_per_transformer_layer_match_megatron_formulas(impl):
    activation = B * S * H * 4  # b s h e: the whole layer's activations, fp32
    plain, seq = (_launch(_layer_bytes, impl, sp)[0] for sp in (False, True))
    for when in ("forward", "backward"):
        # tensor parallelism: two all-reduces of b s h e each way (f and g, attention and MLP)
        assert plain[f"{when}_hooked"] == [("allreduce", activation)] * 2, plain
        # sequence parallelism: each all-reduce becomes an all-gather and a reduce-scatter of
        # the same b s h e (forward: gather into the region, scatter out of it; backward the
        # reverse)
        pair = [("allgather", activation), ("reduce_scatter", activation)]
        if when == "backward":
            pair = pair[::-1]
        assert sorted(seq[f"{when}_hooked"]) == sorted(pair * 2), seq
        # the same volume on the wire: an all-reduce is a reduce-scatter then an all-gather
        assert _ring(seq[f"{when}_hooked"]) == _ring(plain[f"{when}_hooked"]) == 2 * activation
    if impl == "hand":  # tp.py's own calls, wrapped: the same collectives, the same bytes
        names = {"all_reduce": "allreduce", "all_gather_single": "allgather"}
        names["reduce_scatter_single"] = "reduce_scatter"
        for res in (plain, seq):
            for when in ("forward", "backward"):
                assert [(names[n], b) for n, b in res[when]] == res[f"{when}_hooked"]
        # after backward, sequence parallelism sums the partial gradients of two LayerNorms
        # (weight and bias) and two row-parallel biases: 6 h values, in one message
        assert seq["after"] == [("all_reduce", 6 * H * 4)]
    else:  # DTensor's functional collectives bypass torch.distributed's Python functions: only
        for res in (plain, seq):  # the process group (labkit.wire's place) sees them
            assert res["forward"] == res["backward"] == [], res


# ---- the strategies' entry points: the shared training loop, against single --------------------


def _entry_points(ctx) -> dict:
    from labkit import registry
    from labkit.config import RunConfig, knob
    from labkit.factories import Factories
    from labkit.strategies import single, tp_dtensor

    base = dict(width=32, depth=2, global_batch=8, dataset_size=64, steps=5, warmup=0)
    base |= dict(deterministic=True)
    if "tp" in registry.STRATEGIES:  # RunConfig knows tensor parallelism and the transformer
        fns, cls, named = Factories(), RunConfig, True
        base |= dict(model="transformer", heads=4, seq_len=8)
    else:  # until it does: a subclass with the two fields, and the model through factories

        @dataclasses.dataclass(frozen=True)
        class TPConfig(RunConfig):
            tp: int | None = knob(None, "tensor-parallel degree (None: every rank)")
            sequence_parallel: bool = knob(False, "shard the sequence between the regions")

        def model_fn(cfg):
            return transformer(cfg.in_features, cfg.width, cfg.depth, cfg.classes, seq_len=8)

        def data_fn(cfg):
            return ToySequences(cfg.dataset_size, 8, cfg.in_features, cfg.classes, cfg.seed)

        fns, cls, named = Factories(model_fn=model_fn, data_fn=data_fn), TPConfig, False
    ref = single.run(RunConfig(strategy="single", world_size=1, **base), ctx, fns)["params"]
    out = {}
    for module in (tp, tp_dtensor):
        name = module.__name__.rpartition(".")[2]
        for sp in (False, True):
            cfg = cls(strategy=name if named else "ddp", world_size=T, sequence_parallel=sp, **base)
            res = module.run(cfg, ctx, fns)
            assert set(res["params"]) == set(ref)
            out[f"{name}{'+sp' if sp else ''}"] = {
                "max_abs_diff": max((res["params"][n] - ref[n]).abs().max().item() for n in ref),
                "comm_bytes": [rec["comm_bytes"] for rec in res["records"]],
                "comm_calls": [rec["comm_calls"] for rec in res["records"]],
                "samples": [rec["samples"] for rec in res["records"]],
            }
    return out


def test_strategy_entry_points_train_like_single_and_send_what_the_formula_says():
    for out in _launch(_entry_points):
        b, s, h, layers = 8, 8, 32, 2  # every rank the whole global batch of 8
        activation = b * s * h * 4
        for key, res in out.items():
            assert res["max_abs_diff"] <= TOL, (key, res)
            assert res["samples"] == [b] * 5, (key, res)
        # a step on the wire (labkit.wire, ring, t = 2): per layer 4 all-reduces of b s h e,
        # each sending 2(t-1)/t of it; by hand and through DTensor alike
        assert out["tp"]["comm_bytes"] == [layers * 4 * activation] * 5
        assert out["tp_dtensor"]["comm_bytes"] == out["tp"]["comm_bytes"]
        assert out["tp"]["comm_calls"] == out["tp_dtensor"]["comm_calls"] == [layers * 4] * 5
        # sequence parallelism: the same per layer, plus the embedding's backward all-gather
        # and the head's forward all-gather ((t-1)/t of b s h e each), plus the partial
        # gradients, all-reduced (2(t-1)/t): by hand, two LayerNorms and two row-parallel
        # biases (6 h values a layer, one message); DTensor adds the row-parallel bias before
        # its reduce-scatter (as a Partial term), so only the LayerNorms' 4 h are left, each
        # tensor summed on its own when the optimizer reads its Partial gradient
        regions = layers * 4 * activation + activation
        assert out["tp+sp"]["comm_bytes"] == [regions + layers * 6 * h * 4] * 5
        assert out["tp+sp"]["comm_calls"] == [layers * 8 + 2 + 1] * 5
        assert out["tp_dtensor+sp"]["comm_bytes"] == [regions + layers * 4 * h * 4] * 5
        assert out["tp_dtensor+sp"]["comm_calls"] == [layers * 8 + 2 + layers * 4] * 5


# ---- the predictor's bytes against the bytes counted on the wire -------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, world_size, tp_degree, model, sp",
    [
        ("tp", 2, None, "mlp", False),
        ("tp", 2, None, "transformer", False),
        ("tp", 2, None, "transformer", True),
        ("tp_dtensor", 2, None, "transformer", True),
        ("dp_tp", 4, 2, "mlp", False),
        ("dp_tp", 4, 2, "transformer", True),
    ],
)
def test_predicted_bytes_are_the_bytes_counted_on_the_wire(
    strategy, world_size, tp_degree, model, sp
):
    """predict.step reads the layout from the profile (each block's output and gradient
    sizes) and the Megatron pairs (labkit.predict.tensor_step.tensor_parallel_layout);
    labkit.wire counts what each rank's process group is handed. Every step, every rank: the
    same bytes."""
    from labkit import RunConfig, experiment
    from labkit.labs import compute_profile
    from labkit.predict.collectives import AlphaBeta, CollectiveModel
    from labkit.predict.step import predict

    cfg = RunConfig(
        strategy=strategy, world_size=world_size, tp=tp_degree, model=model,
        sequence_parallel=sp, width=64, steps=3, warmup=1,
    )  # fmt: skip
    prof = compute_profile.measure(cfg, repeats=1)
    net = CollectiveModel.uniform(AlphaBeta(1e-5, 1e9))
    pred = predict(
        prof, net, strategy, world_size, cfg.global_batch, tp=cfg.tensor_parallel,
        sequence_parallel=sp,
    )  # fmt: skip
    counted = experiment.run(cfg).records["comm_bytes"]
    assert len(counted) == world_size * cfg.steps
    assert (counted == pred.comm_bytes).all(), (sorted(set(counted)), pred.comm_bytes)
