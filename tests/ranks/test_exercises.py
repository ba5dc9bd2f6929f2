"""The graded exercises on real ranks: a blank answer is "not written yet", every solution in
``solutions/`` passes, each catalogued wrong answer gets its own message, and a deadlocking
answer ends within its timeout, naming the ranks and where they wait."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from labkit import exercises

SOLUTIONS = pathlib.Path(__file__).resolve().parents[2] / "solutions"


def solution(name: str, function: str):
    """The reference answer, sent to the ranks by value (``solutions/`` is not a package)."""
    spec = importlib.util.spec_from_file_location(f"solution_{name}", SOLUTIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # cloudpickle sends only modules it can find there
    spec.loader.exec_module(module)
    cloudpickle.register_pickle_by_value(module)
    return getattr(module, function)


def answers(exercise: str, cases: dict) -> None:
    """Each wrong answer fails, with its own message."""
    for fn, said in cases.items():
        verdict = exercises.check(exercise, fn)
        assert verdict.passed is False and said in verdict.message, (fn.__name__, verdict.message)


def test_every_exercise_has_a_solution_and_a_lesson():
    assert sorted(exercises.EXERCISES) == sorted(p.stem for p in SOLUTIONS.glob("*.py"))
    with pytest.raises(ValueError, match="ring_all_reduce"):
        exercises.check("ring", lambda x: x)


def test_a_blank_is_not_written_yet_and_the_solutions_pass():
    def blank(x):
        raise NotImplementedError("your ring all-reduce")

    verdict = exercises.check("ring_all_reduce", blank)
    assert verdict.passed is None and "NotImplementedError" in verdict.message
    ring = exercises.check("ring_all_reduce", solution("ring_all_reduce", "my_ring_all_reduce"))
    assert ring.passed is True, ring.message
    for n in (2, 3):  # sent what the ring sends: 2(n-1)/n of x, in 2(n-1) sends and receives
        assert all(r["bytes"] == 2 * (n - 1) * r["payload_bytes"] / n for r in ring.details[n])
        assert all(r["calls"] == 4 * (n - 1) for r in ring.details[n])
    avg = exercises.check(
        "average_gradients", solution("average_gradients", "my_average_gradients")
    )
    assert avg.passed is True, avg.message


def test_each_common_wrong_ring_gets_its_message():
    def library(x):  # right sums, but not built by hand
        dist.all_reduce(x)
        return x

    def whole(x):  # sends all of x at each step
        n, r = dist.get_world_size(), dist.get_rank()
        acc, buf, out = x.clone(), x.clone(), torch.empty_like(x)
        for _ in range(n - 1):
            req = dist.isend(buf, (r + 1) % n)
            dist.recv(out, (r - 1) % n)
            req.wait()
            acc += out
            buf = out.clone()
        x.copy_(acc)
        return x

    def nothing(x):
        return x

    def mean(x):
        dist.all_reduce(x)
        return x / dist.get_world_size()

    cases = {
        library: "did you call dist.all_reduce",
        whole: "send one chunk (1/n of x) per step",
        nothing: "still holds its own values",
        mean: "holds the mean",
    }
    answers("ring_all_reduce", cases)


def test_a_ring_that_waits_to_receive_first_ends_in_its_timeout_naming_the_ranks():
    def receive_first(x):
        n, r = dist.get_world_size(), dist.get_rank()
        dist.recv(torch.empty_like(x), (r - 1) % n)  # everyone waits: nobody sends
        return x

    verdict = exercises.check("ring_all_reduce", receive_first, timeout_s=5)
    assert verdict.passed is False and "never finished" in verdict.message
    assert "rank 0 in recv" in verdict.message and "rank 1 in recv" in verdict.message


def test_each_common_wrong_average_gets_its_message():
    def summed(model):
        for p in model.parameters():
            dist.all_reduce(p.grad)

    def kept(model):
        pass

    def one_layer(model):  # forgets all but the first parameter
        p = next(model.parameters())
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()

    answers(
        "average_gradients",
        {
            summed: "you summed them; divide by the world size",
            kept: "kept its own gradients",
            one_layer: "differ from single-device training",
        },
    )


def test_megatron_mlp_passes_its_solution_and_names_each_misplaced_collective():
    import torch.nn.functional as F

    assert exercises.check("megatron_mlp", solution("megatron_mlp", "my_megatron_mlp")).passed

    def reduce(x):
        x = x.clone()
        dist.all_reduce(x)
        return x

    class Both(torch.autograd.Function):  # all-reduce forward and backward
        @staticmethod
        def forward(ctx, x):
            return reduce(x)

        @staticmethod
        def backward(ctx, grad):
            return reduce(grad)

    class Back(torch.autograd.Function):  # f: all-reduce backward
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return reduce(grad)

    class Fwd(torch.autograd.Function):  # g: all-reduce forward
        @staticmethod
        def forward(ctx, x):
            return reduce(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def no_g(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(Back.apply(x), w1, b1)), w2) + b2

    def bias_twice(x, w1, b1, w2, b2):
        return Fwd.apply(F.linear(F.gelu(F.linear(Back.apply(x), w1, b1)), w2, b2))

    def no_f(x, w1, b1, w2, b2):
        return Fwd.apply(F.linear(F.gelu(F.linear(x, w1, b1)), w2)) + b2

    def g_both_ways(x, w1, b1, w2, b2):
        return Both.apply(F.linear(F.gelu(F.linear(Back.apply(x), w1, b1)), w2)) + b2

    def f_forward(x, w1, b1, w2, b2):
        return Fwd.apply(F.linear(F.gelu(F.linear(Both.apply(x), w1, b1)), w2)) + b2

    answers(
        "megatron_mlp",
        {
            no_g: "g must all-reduce it forward",
            bias_twice: "counted twice",
            no_f: "f must all-reduce it backward",
            g_both_ways: "g is the identity backward",
            f_forward: "f is the identity forward",
        },
    )


def test_zero1_step_passes_its_solution_and_names_each_common_mistake():
    assert exercises.check("zero1_step", solution("zero1_step", "my_zero1_step")).passed

    def everything(params, state, lr, momentum):  # right numbers, no sharding
        for i, p in enumerate(params):
            state[i] = buf = p.grad.clone() if i not in state else state[i].mul_(momentum) + p.grad
            p.sub_(lr * buf)

    def no_broadcast(params, state, lr, momentum):
        rank, n = dist.get_rank(), dist.get_world_size()
        for i, p in enumerate(params):
            if i % n == rank:
                state[i] = buf = p.grad.clone() if i not in state else state[i] * momentum + p.grad
                p.sub_(lr * buf)

    def no_momentum(params, state, lr, momentum):
        rank, n = dist.get_rank(), dist.get_world_size()
        for i, p in enumerate(params):
            if i % n == rank:
                p.sub_(lr * p.grad)
        for i, p in enumerate(params):
            dist.broadcast(p, src=i % n)

    answers(
        "zero1_step",
        {
            everything: "which it does not own",
            no_broadcast: "broadcast every parameter from its owner",
            no_momentum: "differ from SGD with momentum",
        },
    )


def test_local_sgd_average_passes_its_solution_and_names_each_common_mistake():
    fn = solution("local_sgd_average", "my_average_parameters")
    assert exercises.check("local_sgd_average", fn).passed

    def nothing(model):
        pass

    def summed(model):
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p)

    def to_rank0(model):
        with torch.no_grad():
            for p in model.parameters():
                dist.reduce(p, dst=0)
                p /= dist.get_world_size()

    answers(
        "local_sgd_average",
        {
            nothing: "did not change",
            summed: "divide by the world size",
            to_rank0: "not a reduce to one rank",
        },
    )
