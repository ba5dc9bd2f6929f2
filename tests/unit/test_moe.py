"""The mixture-of-experts block (labkit.moe) against a token-by-token loop that says the rules in
the plainest way, and expert parallelism's all-to-all dispatch (labkit.strategies.ep) on gloo
ranks that are threads, against the same block computed densely in one process, drops and
all."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from labkit.config import RunConfig
from labkit.dist import on_threads
from labkit.models import FeedForward, make_model
from labkit.moe import MoE, MoESpec, capacity, groups_of, route, ungroup
from labkit.strategies.ep import owned, spread_experts

H = 8


def block(**spec) -> MoE:
    torch.manual_seed(0)
    return MoE(H, MoESpec(**spec), lambda: FeedForward(H))


def loop_route(logits: torch.Tensor, k: int, factor: float):
    """The rules one token at a time: per group, every token's first choice queues before any
    second choice; an expert takes assignments while it holds fewer than its capacity."""
    m, t, e = logits.shape
    cap = math.ceil(factor * t * k / e)
    kept, dropped, aux = [], [0] * e, 0.0
    for g in range(m):
        p = logits[g].softmax(-1)
        top = [p[i].topk(k) for i in range(t)]
        load = [0] * e
        for c in range(k):
            for i in range(t):
                w, x = top[i]
                gate = (w[c] / w.sum()) if k > 1 else w[c]
                ex = int(x[c])
                if load[ex] < cap:
                    kept.append((g * t + i, ex, float(gate)))
                else:
                    dropped[ex] += 1
                load[ex] += 1
        f = [sum(int(ex) == j for i in range(t) for ex in top[i][1]) / (k * t) for j in range(e)]
        aux += e * sum(f[j] * float(p[:, j].mean()) for j in range(e)) / m
    return kept, dropped, cap, aux


@pytest.mark.parametrize("k, factor", [(1, 1.0), (2, 1.0), (2, 0.5), (1, 2.0)])
def test_route_follows_the_rules_token_by_token(k, factor):
    torch.manual_seed(k)
    logits = torch.randn(3, 10, 4)
    logits[..., 1] += 1.0  # a popular expert, so some queue overflows
    r = route(logits, k, factor)
    kept, dropped, cap, aux = loop_route(logits, k, factor)
    got = sorted(zip(r.token.tolist(), r.expert.tolist(), r.gate.tolist()))
    assert [(t, e) for t, e, _ in got] == sorted((t, e) for t, e, _ in kept)
    assert torch.allclose(torch.tensor([g for *_, g in got]), torch.tensor(sorted(kept)).T[2])
    assert r.dropped.tolist() == dropped and r.capacity == cap == capacity(10, 4, k, factor)
    assert r.routed.sum() == 3 * 10 * k and r.aux.item() == pytest.approx(aux, rel=1e-6)


def test_an_even_router_has_aux_loss_one_and_a_skewed_one_more():
    even = route(torch.zeros(1, 8, 4) + torch.eye(4).repeat(2, 1)[None] * 5, 1, 1.0)
    assert even.aux.item() == pytest.approx(1.0, abs=0.05) and even.dropped.sum() == 0
    skewed = route(torch.zeros(1, 8, 4) + torch.tensor([5.0, 0, 0, 0]), 1, 1.0)
    assert skewed.aux.item() > 3 and skewed.dropped.tolist() == [6, 0, 0, 0]  # capacity 2


def test_groups_are_every_gth_sample_and_ungroup_inverts():
    x = torch.arange(6 * 2 * 1.0).view(6, 2, 1)
    g = groups_of(x, 3)
    assert g[1, :, 0].tolist() == [2.0, 3.0, 8.0, 9.0]  # samples 1 and 4, in position order
    assert torch.equal(ungroup(g, 6, 2), x)
    with pytest.raises(ValueError, match="does not split into 4 token groups"):
        groups_of(x, 4)


def test_a_dropped_token_passes_through_the_residual_unchanged():
    moe = block(experts=2, top_k=1, capacity_factor=0.5, router_skew=50.0)
    x = torch.randn(2, 4, H)
    y = moe(x)
    r = moe.last  # capacity 2 of 8 tokens, all routed to expert 0: 6 dropped
    assert r.dropped.tolist() == [6, 0] and r.token.tolist() == [0, 1]
    assert (groups_of(y, 1)[0, 2:] == 0).all() and (groups_of(y, 1)[0, :2] != 0).all()


def test_every_expert_gets_a_gradient_even_with_no_tokens():
    moe = block(experts=4, top_k=1, capacity_factor=1.0, router_skew=50.0)
    moe(torch.randn(2, 4, H, requires_grad=True)).sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None, name
    assert (moe.experts["3"].fc1.weight.grad == 0).all()


def test_the_aux_loss_pulls_the_router_off_a_popular_expert():
    moe = block(experts=4, top_k=1, aux_loss=1.0, router_skew=2.0)
    y = moe(torch.randn(4, 4, H))
    (0 * y).sum().backward()  # the outputs give no gradient: what remains is the aux loss's
    assert moe.router.bias.grad[0] > 0 > moe.router.bias.grad[1:].max()  # SGD lowers expert 0
    moe.zero_grad()
    moe.spec = dataclasses.replace(moe.spec, aux_loss=0.0)
    (0 * moe(torch.randn(4, 4, H))).sum().backward()
    assert (moe.router.bias.grad == 0).all()


def test_the_transformer_takes_a_mixture_of_experts_from_the_config():
    cfg = RunConfig(
        strategy="single", world_size=1, model="transformer", experts=4, top_k=2, width=32
    )
    model = make_model(cfg)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(moes) == cfg.depth and moes[0].spec.groups == 1 and moes[0].spec.top_k == 2
    assert "1.mlp.experts.3.fc2.weight" in dict(model.named_parameters())
    ep = cfg.replace(strategy="ep", world_size=2, expert_groups=4)
    assert make_model(ep)[1].mlp.spec.groups == 2  # 4 groups over 2 ranks


@pytest.mark.parametrize(
    "changes, said",
    [
        (dict(experts=4), "set model='transformer'"),
        (dict(top_k=2), "set experts"),
        (dict(model="transformer", experts=4, top_k=5), "set top_k in that range"),
        (dict(model="transformer", experts=4, accumulate=2), "set accumulate=1"),
        (dict(model="transformer", experts=4, expert_groups=3), "multiple of 2"),
        (dict(model="transformer", experts=4, expert_groups=4, global_batch=6), "multiple of"),
        (dict(model="transformer", experts=3, strategy="ep"), "multiple of 2"),
        (dict(model="transformer", experts=0, strategy="ep"), "nothing to spread"),
        (dict(model="transformer", experts=4, strategy="zero1"), "set experts=0"),
        (dict(model="transformer", experts=4, skew=0.5, strategy="ddp"), "skew=0"),
        (dict(model="transformer", experts=4, strategy="ep", world_size=4, ep=3), "divisor of 4"),
        (dict(model="transformer", experts=4, strategy="ddp", ep=2), "set ep=None"),
        (dict(model="transformer", experts=6, strategy="ep", world_size=4, ep=4), "multiple of 4"),
    ],
)
def test_bad_mixtures_of_experts_are_refused_with_the_fix(changes, said):
    base = dict(strategy="ddp", world_size=2, global_batch=32)
    with pytest.raises(ValueError, match=said.replace("(", r"\(")):
        RunConfig(**{**base, **changes})


# ---- expert parallelism's dispatch, on gloo ranks that are threads -------------------------


def dense_and_parallel(n: int, **spec):
    """One MoE block run densely on the whole batch (groups: one per rank), and on ``n`` thread
    ranks with its experts spread, each on every n-th sample; per rank its output, input
    gradient, parameter gradients and routing, from mean losses as training uses."""
    dense = block(groups=n, **spec)
    torch.manual_seed(1)
    x = torch.randn(4 * n, 3, H)
    xd = x.clone().requires_grad_()
    y = dense(xd)
    (y**2).mean().backward()

    def rank(group):
        r = group.rank()
        moe = copy.deepcopy(dense)
        moe.zero_grad()
        moe.spec = dataclasses.replace(moe.spec, groups=1)
        spread_experts(moe, group)
        xr = x[r::n].clone().requires_grad_()
        yr = moe(xr)
        (yr**2).mean().backward()
        grads = {k: p.grad for k, p in moe.named_parameters()}
        return yr.detach(), xr.grad, grads, moe.last

    return dense, xd, y.detach(), on_threads(rank, n)


@pytest.mark.parametrize("n, spec", [(2, dict(experts=4, top_k=1)), (4, dict(experts=4, top_k=2))])
def test_all_to_all_dispatch_equals_the_dense_block_drops_and_all(n, spec):
    dense, xd, y, ranks = dense_and_parallel(n, capacity_factor=1.0, router_skew=1.5, **spec)
    routed = sum(r.routed for *_, r in ranks)
    dropped = sum(r.dropped for *_, r in ranks)
    assert dropped.sum() > 0  # the skew overflows expert 0: the check covers drops
    assert torch.equal(routed, dense.last.routed) and torch.equal(dropped, dense.last.dropped)
    want = dict(dense.named_parameters())
    for r, (yr, gx, grads, _) in enumerate(ranks):
        assert torch.allclose(yr, y[r::n], atol=1e-6)
        assert torch.allclose(gx / n, xd.grad[r::n], atol=1e-7)  # each rank's mean is over 1/n
        mine = {k for k in grads if ".experts." in f".{k}"}
        assert mine == {f"experts.{e}.{w}" for e in owned(r, n, 4) for w in FC}
        for k in mine:  # an expert's gradient: every rank's tokens, summed in on its owner
            assert torch.allclose(grads[k] / n, want[k].grad, atol=1e-7), k
    for k in ("router.weight", "router.bias"):  # replicated: averaged over the ranks
        assert torch.allclose(sum(g[k] for _, _, g, _ in ranks) / n, want[k].grad, atol=1e-7)


FC = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def test_a_different_grouping_drops_different_tokens():
    """Why groups matter: the same batch as one group keeps other tokens than as two."""
    torch.manual_seed(3)
    logits = torch.randn(1, 16, 4)
    logits[..., 0] += 1.0
    one = route(logits, 1, 1.0)  # capacity 4 of 16 tokens, or 2 of each 8
    two = route(logits.view(2, 8, 4), 1, 1.0)
    assert set(one.token.tolist()) != set(two.token.tolist())


# ---- the lesson's picture of one dispatch, and the figures -----------------------------------


def test_the_drawn_dispatch_is_what_the_all_to_all_delivered():
    from labkit.labs import experts as ex
    from labkit.plots import experts as px

    d = ex.dispatch(2, 4, 8, top_k=2, capacity_factor=0.75, router_skew=1.0)
    kept = d.trips[d.trips["kept"]]
    assert len(d.trips) == 2 * 8 * 2 and 0 < len(kept) < len(d.trips)  # some dropped
    sent = sorted(zip(kept["rank"], kept["token"], kept["expert"]))
    got = sorted(zip(d.arrived["rank"], d.arrived["token"], d.arrived["expert"]))
    assert sent == got  # every kept assignment computed once, by its expert; no dropped one
    assert (d.arrived["owner"] == d.arrived["expert"] // 2).all()
    per_group = kept.groupby(["rank", "expert"]).size()
    assert per_group.max() <= d.capacity == math.ceil(0.75 * 8 * 2 / 4)
    for fig in (px.dispatch(d), px.capacity(d)):
        assert fig.data


def test_a_list_all_to_all_counts_exactly_the_pieces_that_leave():
    from types import SimpleNamespace

    from labkit import wire

    if not wire.COUNTING:
        pytest.skip(wire.WHY_NOT)
    pieces = [torch.zeros(3), torch.zeros(5), torch.zeros(1)]  # rank 1 keeps its 5
    args = SimpleNamespace(name=wire.HookOpName.ALLTOALL, input_tensors=pieces, root=0)
    assert wire.sent(args, 9 * 4, 3, 1) == 4 * 4
    one = SimpleNamespace(name=wire.HookOpName.ALLTOALL, input_tensors=[torch.zeros(9)], root=0)
    assert wire.sent(one, 9 * 4, 3, 1) == 9 * 4 * 2 / 3  # one tensor: equal splits assumed
