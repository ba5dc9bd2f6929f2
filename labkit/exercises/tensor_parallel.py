"""Lesson 12 (tensor parallelism): Megatron's MLP with f and g; a column- and a row-parallel
Linear."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..launch import launch
from ..strategies.tp import CopyToRegion, ReduceFromRegion
from ._core import Verdict, diff, exercise


def _mlp_rank(ctx, fn) -> dict:
    from torch import nn

    t, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(8, 16).double(), nn.Linear(16, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    dense = fc2(nn.functional.gelu(fc1(x)))
    dense.square().sum().backward()
    rows = slice(16 // t * r, 16 // t * (r + 1))  # fc1: this rank's output features
    w1 = fc1.weight.detach()[rows].clone().requires_grad_()
    b1 = fc1.bias.detach()[rows].clone().requires_grad_()
    w2 = fc2.weight.detach()[:, rows].clone().requires_grad_()  # fc2: the same features, in
    b2 = fc2.bias.detach().clone().requires_grad_()
    mine = x.detach().clone().requires_grad_()
    out = fn(mine, w1, b1, w2, b2)
    out.square().sum().backward()

    def diff(a, b):
        return None if a is None else float((a - b).abs().max())

    return {
        "out": diff(out.detach(), dense.detach()),
        "x_summed": diff(out.detach(), fc2(nn.functional.gelu(fc1(t * x))).detach()),
        "bias_off": diff(out.detach() - (t - 1) * fc2.bias.detach(), dense.detach()),
        "x_grad": diff(mine.grad, x.grad),
        "x_grad_ratio": None if mine.grad is None else float(mine.grad.norm() / x.grad.norm()),
        "w1_grad": diff(w1.grad, fc1.weight.grad[rows]),
        "w2_grad": diff(w2.grad, fc2.weight.grad[:, rows]),
        "b2_grad": diff(b2.grad, fc2.bias.grad),
    }


@exercise(
    "megatron_mlp",
    lesson="12",
    what="Megatron's MLP: column, row, f and g",
    solution="my_megatron_mlp",
)
def grade_megatron_mlp(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(x, w1, b1, w2, b2)``: the MLP ``fc2(gelu(fc1(x)))`` on this rank's shards (``w1``,
    ``b1``: fc1's rows for this rank's hidden features; ``w2``: fc2's columns for the same
    features; ``b2``: fc2's whole bias), with ``f`` before fc1 and ``g`` after fc2, returning
    the whole output on every rank. Graded on 2 ranks: the output and the gradients of x, w1,
    w2 and b2 against the dense MLP's."""
    name = "megatron_mlp"
    ranks = launch(_mlp_rank, 2, args=(fn,), device="cpu", timeout_s=timeout_s)
    details = {2: ranks}
    tol = 1e-9
    for r, res in enumerate(ranks):
        if res["out"] > tol:
            if res["bias_off"] <= tol:
                return Verdict(
                    name,
                    False,
                    f"Rank {r}'s output is off by fc2's bias: every rank "
                    "added b2 before the sum, so it was counted twice. Add it once, "
                    "after g.",
                    details,
                )
            if res["x_summed"] <= tol:
                return Verdict(
                    name,
                    False,
                    f"Rank {r}'s output is the MLP of x summed over the ranks: f all-reduced x "
                    "on its way in. f is the identity forward (x is already whole everywhere).",
                    details,
                )
            return Verdict(
                name,
                False,
                f"Rank {r}'s output differs from the dense MLP's (by "
                f"{res['out']:.3g}): each rank holds only a partial sum after fc2. g "
                "must all-reduce it forward.",
                details,
            )
        for grad in ("w1_grad", "w2_grad", "b2_grad"):
            if res[grad] is None:
                return Verdict(
                    name,
                    False,
                    f"{grad[:2]} got no gradient on rank {r}: compute "
                    "with the tensors you were given (no .detach(), no copies).",
                    details,
                )
        if res["x_grad"] is None or res["x_grad"] > tol:
            ratio = res["x_grad_ratio"]
            if ratio is not None and abs(ratio - 2) < 1e-6:
                why = (
                    "twice what it should be: g all-reduced the gradient on the way back "
                    "too. g is the identity backward."
                )
            else:
                why = (
                    "only this rank's part: each rank's hidden features contribute to "
                    "dL/dx. f must all-reduce it backward."
                )
            return Verdict(
                name, False, f"The output is right, but rank {r}'s gradient of x is {why}", details
            )
        if max(res["w1_grad"], res["w2_grad"], res["b2_grad"]) > tol:
            return Verdict(
                name,
                False,
                f"The output and dL/dx are right, but rank {r}'s weight "
                "gradients differ from the dense MLP's slices: check what g hands "
                "back in backward.",
                details,
            )
    return Verdict(
        name,
        True,
        "On 2 ranks the output and every gradient equal the dense MLP's: "
        "one all-reduce forward (g), one backward (f), nothing else.",
        details,
    )


# ---- one Linear cut two ways: by output features (column), by input features (row) ------------

IN, OUT = 6, 8  # the column-parallel layer is Linear(6, 8), the row-parallel one Linear(8, 6)


def _f(x):
    """Megatron's f, labkit's own: identity forward, all-reduce backward."""
    return CopyToRegion.apply(x, None)


def _g(x):
    """Megatron's g, labkit's own: all-reduce forward, identity backward."""
    return ReduceFromRegion.apply(x, None)


def _layer_rank(ctx, fn, kind: str) -> dict:
    t, r = ctx.world_size, ctx.rank
    torch.manual_seed(0)
    dense = (nn.Linear(IN, OUT) if kind == "column" else nn.Linear(OUT, IN)).double()
    n_in, n_out = dense.in_features, dense.out_features
    x = torch.randn(4, n_in, dtype=torch.float64, requires_grad=True)
    up = torch.randn(4, n_out, dtype=torch.float64)  # dL/dY: the loss is (Y * up).sum()
    want = dense(x)
    (want * up).sum().backward()
    w = dense.weight.detach().clone().requires_grad_()
    b = dense.bias.detach().clone().requires_grad_()
    if kind == "column":  # the input whole, the output features cut
        part = slice(n_out // t * r, n_out // t * (r + 1))
        mine = x.detach().clone().requires_grad_()
        out = fn(mine, w, b, _f)
        target, up_mine = want[:, part], up[:, part]
        cut = slice(n_in // t * r, n_in // t * (r + 1))  # what a split input would compute
        alt = {"split_input": F.linear(x[:, cut], dense.weight[part, cut], dense.bias[part])}
        w_want, x_want = dense.weight.grad[part], x.grad
        w_mine = lambda: w.grad[part]  # noqa: E731
    else:  # the input's features cut, the output whole on every rank
        part = slice(n_in // t * r, n_in // t * (r + 1))
        mine = x.detach()[:, part].clone().requires_grad_()
        out = fn(mine, w, b, _g)
        target, up_mine = want, up
        partial = F.linear(x[:, part], dense.weight[:, part])
        alt = {"bias_each": want + (t - 1) * dense.bias, "partial": partial + dense.bias,
               "partial_no_bias": partial}  # fmt: skip
        w_want, x_want = dense.weight.grad[:, part], x.grad[:, part]
        w_mine = lambda: w.grad[:, part]  # noqa: E731
    res = {"shape": list(out.shape), "want_shape": list(target.shape)}
    if list(out.shape) != list(target.shape):
        return res
    (out * up_mine).sum().backward()
    res.update({name: diff(out, a) for name, a in alt.items()})
    res["out"] = diff(out, target)
    res["x_grad"] = diff(mine.grad, x_want)
    res["x_grad_ratio"] = None if mine.grad is None else float(mine.grad.norm() / x_want.norm())
    res["w_grad"] = None if w.grad is None else diff(w_mine(), w_want)
    if w.grad is not None:  # a rank's gradient lies in its slice of the weight, zero elsewhere
        res["w_grad_outside"] = float(w.grad.abs().sum() - w_mine().abs().sum())
    return res


def _shapes(kind: str) -> Callable:
    """A rank's shape error, in the learner's words: which way nn.Linear's weight is cut."""

    def explain(exc) -> str | None:
        last = exc.traceback.strip().splitlines()[-1] if exc.traceback.strip() else ""
        if not any(s in last for s in ("shapes cannot be multiplied", "must match the size",
                                       "size mismatch", "expanded size")):  # fmt: skip
            return None
        if kind == "column":
            how = (
                f"nn.Linear's weight is (out_features, in_features) = ({OUT}, {IN}): a "
                "column-parallel rank keeps the rows of its output features, weight[rows] and "
                "bias[rows], and multiplies the whole input by them"
            )
        else:
            how = (
                f"nn.Linear's weight is (out_features, in_features) = ({IN}, {OUT}): a "
                "row-parallel rank keeps the columns of its input features, weight[:, cols], "
                "multiplies its part of the input by them, and adds the whole bias once, after g"
            )
        return f"Rank {exc.rank}: a shape did not fit ({last.split(': ', 1)[-1]}). {how}."

    return explain


def _column_wrong(res: dict, r: int) -> str | None:
    t = 2
    if res["shape"] != res["want_shape"]:
        whole = res["shape"][-1:] == [OUT]
        return (
            f"Rank {r} returned a {tuple(res['shape'])} output; a column-parallel rank returns "
            f"its {OUT // t} output features, {tuple(res['want_shape'])}"
            + (": you gathered the whole output (the next, row-parallel layer takes the "
               "features split, so Megatron never gathers them)." if whole else ".")
        )  # fmt: skip
    if res["out"] > 1e-9:
        if res["split_input"] <= 1e-9:
            return (
                f"Rank {r}'s output is what half the input gives: a column-parallel layer "
                "needs the whole input on every rank (each output feature reads every input "
                "feature). Cut only the weight's rows and the bias."
            )
        return (
            f"Rank {r}'s output features differ from nn.Linear's same features by "
            f"{res['out']:.3g}: rank r computes features r*{OUT // t} to (r+1)*{OUT // t} - 1, "
            "from weight[rows] and bias[rows]."
        )
    if res["w_grad"] is None:
        return (
            f"The output is right, but the weight got no gradient on rank {r}: slice the weight "
            "you were given (no .detach(), no copies), so backward reaches it."
        )
    if res["x_grad"] is None or res["x_grad"] > 1e-9:
        return (
            f"The output is right, but rank {r}'s dL/dx is only its own features' part "
            f"({res['x_grad_ratio'] or 0:.2f}x the whole in size): pass the input through f "
            "(f(x)), whose backward sums dL/dx over the ranks."
        )
    if res["w_grad"] > 1e-9 or res["w_grad_outside"] > 1e-9:
        return (
            f"The output and dL/dx are right, but rank {r}'s weight gradient differs from "
            "nn.Linear's rows it owns: compute with weight[rows] itself."
        )
    return None


def _row_wrong(res: dict, r: int) -> str | None:
    t = 2
    if res["shape"] != res["want_shape"]:
        return (
            f"Rank {r} returned a {tuple(res['shape'])} output; a row-parallel layer returns "
            f"the whole output on every rank, {tuple(res['want_shape'])}."
        )
    if res["out"] > 1e-9:
        if res["bias_each"] <= 1e-9:
            return (
                f"Rank {r}'s output holds the bias {t} times: every rank added it before g "
                "summed the ranks' outputs. Add the bias once, after g."
            )
        if res["partial"] <= 1e-9 or res["partial_no_bias"] <= 1e-9:
            return (
                f"Rank {r}'s output is only its own input features' partial sum: g must sum "
                "the ranks' partial outputs (g(F.linear(x_part, weight[:, cols]))) before the "
                "bias."
            )
        return (
            f"Rank {r}'s output differs from nn.Linear's by {res['out']:.3g}: rank r "
            f"multiplies its {OUT // t} input features by weight[:, cols], g sums, then the "
            "bias."
        )
    if res["w_grad"] is None:
        return (
            f"The output is right, but the weight got no gradient on rank {r}: slice the weight "
            "you were given (no .detach(), no copies), so backward reaches it."
        )
    if res["x_grad"] is None or res["x_grad"] > 1e-9 or res["w_grad"] > 1e-9:
        return (
            f"The output is right, but rank {r}'s gradients differ from nn.Linear's: g is the "
            "identity backward, each rank's part of the input gets its own gradient."
        )
    return None


def _grade_layer(kind: str, fn: Callable, timeout_s: float) -> Verdict:
    name = f"{kind}_parallel_linear"
    ranks = launch(_layer_rank, 2, args=(fn, kind), device="cpu", timeout_s=timeout_s)
    wrong = _column_wrong if kind == "column" else _row_wrong
    for r, res in enumerate(ranks):
        said = wrong(res, r)
        if said:
            return Verdict(name, False, said, {2: ranks})
    if kind == "column":
        said = (
            "On 2 ranks each rank's output features, dL/dx and its rows of the weight "
            "gradient equal nn.Linear's (to 1e-9): the input whole, the weight cut by rows, "
            "the bias with them."
        )
    else:
        said = (
            "On 2 ranks the output on every rank, each rank's part of dL/dx and its columns of "
            "the weight gradient equal nn.Linear's (to 1e-9): the input split, the weight cut "
            "by columns, one sum, the bias added once."
        )
    return Verdict(name, True, said, {2: ranks})


@exercise(
    "column_parallel_linear",
    lesson="12",
    what="a column-parallel Linear: the weight cut by output features",
    solution="my_column_linear",
    explain=_shapes("column"),
)
def grade_column_parallel_linear(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(x, weight, bias, f)``: this rank's output features of ``nn.Linear`` (``weight``
    and ``bias`` whole, the same on every rank; ``x`` whole), through ``f``. Graded on 2 ranks
    against ``nn.Linear``: each rank's features, dL/dx, and the weight gradient's rows."""
    return _grade_layer("column", fn, timeout_s)


@exercise(
    "row_parallel_linear",
    lesson="12",
    what="a row-parallel Linear: the weight cut by input features",
    solution="my_row_linear",
    explain=_shapes("row"),
)
def grade_row_parallel_linear(fn: Callable, timeout_s: float = 30.0) -> Verdict:
    """``fn(x_part, weight, bias, g)``: ``nn.Linear``'s whole output on every rank from this
    rank's part of the input features (``weight``, ``bias`` whole), through ``g``. Graded on 2
    ranks against ``nn.Linear``: the output, this rank's part of dL/dx and its columns of the
    weight gradient."""
    return _grade_layer("row", fn, timeout_s)
