"""check() with models labkit did not write: batch norm, dropout, a transformer, resnet18, and
resnet18 with faults check cannot see by inspection.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_equivalence.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from labkit import RunConfig
from labkit.cli import main
from labkit.labs import equivalence
from tests.helpers.models import TinyTransformer, bn_mlp, centred_mlp, dropout_mlp, vectors

BASE = RunConfig(strategy="ddp", world_size=2, global_batch=32, dataset_size=128, timeout_s=180)


def sequences(cfg):  # 128 sequences of 6 tokens with 16 features
    g = torch.Generator().manual_seed(cfg.seed)
    return TensorDataset(
        torch.randn(128, 6, 16, generator=g), torch.randint(0, 10, (128,), generator=g)
    )


def images(cfg):  # small synthetic RGB images, like decoded files
    g = torch.Generator().manual_seed(cfg.seed)
    return TensorDataset(
        torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
    )


@pytest.mark.parametrize(
    "name, model_fn, data_fn, adjust",
    [
        ("batchnorm mlp", bn_mlp, vectors, "sync batchnorm (labkit.rank.syncbn over gloo)"),
        ("dropout mlp", dropout_mlp, vectors, "dropout off"),
        (
            "transformer, default dropout",
            lambda cfg: TinyTransformer(None),
            sequences,
            "dropout off",
        ),
        ("transformer, no dropout", lambda cfg: TinyTransformer(0.0), sequences, "none"),
    ],
)
def test_check_passes_with_what_must_hold_stated(name, model_fn, data_fn, adjust):
    if "transformer" in name and torch.cuda.is_available():
        pytest.skip("CPU ranks are what this checks")
    result = equivalence.check(
        BASE, ["ddp", "ddp_naive"], steps=3, model_fn=model_fn, data_fn=data_fn
    )
    assert result["ok"].all(), result.to_string()
    assert (result["adjustments"] == adjust).all(), result["adjustments"].tolist()
    expected = "parameters + buffers" if "batchnorm" in name else "parameters"
    assert (result["compared"] == expected).all()
    if adjust != "none":
        assert result["why"].str.len().gt(20).all()  # it says why


def test_buffers_are_compared_and_a_batchnorm_pipeline_says_why_it_differs():
    result = equivalence.check(
        BASE.replace(microbatches=4),
        ["model_parallel", "pipeline_1f1b"],
        steps=2,
        model_fn=bn_mlp,
        data_fn=vectors,
    ).set_index("strategy")
    assert result.loc["model_parallel", "ok"]  # one micro-batch: exact
    assert not result.loc["pipeline_1f1b", "ok"]  # each micro-batch normalised alone
    assert "micro-batch" in result.loc["pipeline_1f1b", "why"]


def test_a_real_difference_fails_in_float64_too_and_says_so():
    # a batch statistic that is not a BatchNorm: DDP's ranks centre their halves
    table = equivalence.check(BASE.replace(width=64, depth=2), ["ddp"], 2, steps=3,
                              model_fn=centred_mlp)  # fmt: skip
    row = table.iloc[0]
    assert not row["ok"] and row["compared_in"] == "float64", row.to_dict()
    assert row["max_abs_diff"] > 100 * row["tol"] and row["float32_diff"] > row["tol"]
    assert "differs beyond rounding" in row["why"]


def batchnorm_mlp(cfg):
    torch.manual_seed(0)
    layers, width = [], cfg.in_features
    for _ in range(4):
        layers += [nn.Linear(width, cfg.width), nn.BatchNorm1d(cfg.width), nn.ReLU()]
        width = cfg.width
    return nn.Sequential(*layers, nn.Linear(width, cfg.classes))


def test_training_that_amplifies_rounding_passes_in_float64_and_says_so():
    # batch norm at lr 2 for 30 steps: float32's rounding, amplified, ends far above tol; the
    # same training in float64 rounds 2^29 times finer and ends within it
    cfg = BASE.replace(width=64, lr=2.0)
    table = equivalence.check(cfg, ["ddp"], 2, steps=30, model_fn=batchnorm_mlp)
    row = table.iloc[0]
    assert row["float32_diff"] > row["tol"] >= row["max_abs_diff"], row.to_dict()
    assert row["ok"] and row["compared_in"] == "float64", row.to_dict()
    assert "training amplifies rounding" in row["why"]
    assert row["max_buffer_diff"] <= row["tol"]  # running statistics in float64 too


def test_a_row_that_cannot_run_in_float64_keeps_float32s_verdict_and_says_why():
    with pytest.raises(ValueError, match="hogwild cannot be compared in float64"):
        equivalence.check(BASE.replace(strategy="hogwild"), ["hogwild"], compare_in="float64")
    cfg = BASE.replace(width=64, depth=2, precision="bf16")  # a real difference, at bf16
    table = equivalence.check(cfg, ["ddp"], steps=3, model_fn=centred_mlp)
    row = table.iloc[0]
    assert not row["ok"] and row["compared_in"] == "float32", row.to_dict()
    assert "not compared in float64: precision='bf16'" in row["why"]


def test_the_check_command_says_which_rows_float64_judged(capsys):
    # labkit's MLP at lr 4 for 40 steps: float32 rounding, amplified, ends far above 1e-5
    argv = ["check", "--strategies", "ddp", "--lr", "4", "--steps", "40", "--width", "64"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "float64" in out.splitlines()[1].split(), out  # ddp's row, compared_in
    assert "note (ddp): training amplifies rounding" in out
    assert out.rstrip().endswith("within 1e-05 after 40 steps (ddp compared in float64)"), out


# resnet18 on noise images at lr 0.05 trains unstably: float32 rounding (a sum over two ranks is
# not added in one's order) grows far above tol in 5 steps, so only float64 can give the verdict
RESNET = BASE.replace(global_batch=16, dataset_size=32, lr=0.05, timeout_s=300)


def resnet18(cfg, **kw):
    torchvision = pytest.importorskip("torchvision")
    return torchvision.models.resnet18(num_classes=10, **kw)


class ShardNorm(nn.Module):
    """Batch norm written by hand: it normalises by its own batch's statistics, and is no
    BatchNorm that check could find and synchronise."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        mean, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), keepdim=True, correction=0)
        xhat = (x - mean) / (var + 1e-5).sqrt()
        return xhat * self.weight[:, None, None] + self.bias[:, None, None]


def times_world_size(grad):
    """A gradient scaled by the world size: DDP's average of it is the sum of the ranks'."""
    return grad * (dist.get_world_size() if dist.is_initialized() else 1)


def resnet18_summing(cfg):
    model = resnet18(cfg)
    for p in model.parameters():
        p.register_hook(times_world_size)
    return model


@pytest.mark.slow
def test_resnet18_at_lr_0_05_passes_for_ddp_though_float32_rounding_grows_past_tol():
    row = equivalence.check(RESNET, ["ddp"], steps=5, model_fn=resnet18, data_fn=images).iloc[0]
    assert row["float32_diff"] > 100 * row["tol"], row.to_dict()  # rounding, amplified
    assert row["ok"] and row["compared_in"] == "float64", row.to_dict()
    assert row["max_abs_diff"] < 1e-3 * row["tol"], row.to_dict()  # far inside
    assert row["compared"] == "parameters + buffers"  # running stats compared too
    assert "sync batchnorm" in row["adjustments"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, model_fn",
    [
        ("a per-rank batch statistic", lambda cfg: resnet18(cfg, norm_layer=ShardNorm)),
        ("gradients summed, not averaged", resnet18_summing),
    ],
)
def test_resnet18_with_a_hidden_fault_fails_in_float64_by_a_wide_margin(fault, model_fn):
    row = equivalence.check(RESNET, ["ddp"], steps=5, model_fn=model_fn, data_fn=images).iloc[0]
    assert not row["ok"] and row["compared_in"] == "float64", (fault, row.to_dict())
    assert row["max_abs_diff"] > 1e3 * row["tol"], (fault, row.to_dict())
    assert "differs beyond rounding" in row["why"]
