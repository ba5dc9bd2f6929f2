"""Bring your own model, data, loss and optimizer: misuse fails before any rank starts, every
factory is called once per rank, and each rank gets its own random stream.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_factories.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from labkit import experiment
from tests.helpers.configs import SMALL_DDP_3_LAYERS as SMALL
from tests.helpers.models import global_rng_data


class TinyTransformer(nn.Module):
    """Not a Sequential: pipelines cannot cut it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(torch.relu(self.proj(x)))


@pytest.fixture
def no_launch(monkeypatch):
    """Fail the test if anything reaches the launcher: misuse must be caught before."""

    def refuse(*args, **kwargs):
        raise AssertionError("a rank was launched before the misuse was reported")

    monkeypatch.setattr(experiment, "launch", refuse)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"model_fn": nn.Linear(32, 10)}, ["model_fn takes a factory", "lambda cfg: MyModel()"]),
        (
            {"data_fn": TensorDataset(torch.randn(64, 32), torch.zeros(64).long())},
            ["data_fn takes a factory"],
        ),
        (
            {"data_fn": lambda cfg: DataLoader(global_rng_data(cfg), batch_size=8)},
            ["returned a DataLoader", "return its Dataset"],
        ),
        ({"loss_fn": nn.MSELoss()}, ["loss_fn takes a factory", "lambda cfg: nn.MSELoss()"]),
        ({"optimizer_fn": torch.optim.Adam}, ["optimizer_fn takes the config and the parameters"]),
        ({"model_fn": lambda cfg: "not a model"}, ["returned a str, not an nn.Module"]),
        ({"model_fn": lambda cfg: nn.Linear(8, 10)}, ["cannot take a batch", "(2, 32)"]),
        (
            {"model_fn": lambda cfg: nn.Linear(32, 1)},
            [
                "one value per sample",
                "cross-entropy over one class is always 0",
                "loss_fn=lambda cfg: nn.MSELoss()",
            ],
        ),
        ({"loss_fn": lambda cfg: nn.CrossEntropyLoss(reduction="sum")}, ["reduction='mean'"]),
        (
            {"data_fn": lambda cfg: TensorDataset(torch.randn(8, 32), torch.zeros(8).long())},
            ["8 samples, fewer than one global batch (32)"],
        ),
    ],
)
def test_misuse_is_reported_before_any_rank_starts(no_launch, kwargs, words):
    with pytest.raises((TypeError, ValueError)) as err:
        experiment.run(SMALL, **kwargs)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_pipelines_name_the_options_for_a_model_they_cannot_cut(no_launch):
    cfg = SMALL.replace(strategy="pipeline_1f1b")
    with pytest.raises(TypeError, match="needs an nn.Sequential, got TinyTransformer") as err:
        experiment.run(cfg, model_fn=lambda cfg: TinyTransformer(), data_fn=global_rng_data)
    assert "list of stage modules" in str(err.value)


def test_activation_checkpointing_a_model_it_cannot_cut_is_refused_before_launch(no_launch):
    with pytest.raises(ValueError, match="checkpoints each block of an nn.Sequential") as err:
        experiment.run(
            SMALL.replace(activation_checkpointing=True),
            model_fn=lambda cfg: TinyTransformer(),
            data_fn=global_rng_data,
        )
    assert "set activation_checkpointing=False" in str(err.value)
