"""Bring your own model, data, loss and optimizer: misuse fails before any rank starts, every
factory is called once per rank, and each rank gets its own random stream.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_factories.py."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from labkit import experiment
from labkit.labs import equivalence
from tests.helpers.configs import SMALL_DDP_3_LAYERS as SMALL
from tests.helpers.models import global_rng_data


def global_rng_model(cfg):
    return nn.Sequential(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Linear(64, 10),
    )


def test_a_list_of_stage_modules_is_a_pipeline():
    def stages(cfg):
        return [nn.Sequential(nn.Linear(32, 64), nn.ReLU()), nn.Linear(64, 10)]

    cfg = SMALL.replace(strategy="pipeline_gpipe", deterministic=True)
    got = experiment.run(cfg, model_fn=stages, data_fn=global_rng_data).params
    ref = experiment.run(
        cfg.replace(strategy="single", world_size=1),
        model_fn=lambda cfg: nn.Sequential(*stages(cfg)),
        data_fn=global_rng_data,
    ).params
    assert set(got) == set(ref)
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-5


def test_a_global_rng_data_fn_gives_every_strategy_the_same_data():
    # data_fn and model_fn draw from the global RNG: each is called once per rank, from the
    # same seeded state, so every strategy (pipelines too) trains on the same data and weights
    result = equivalence.check(
        SMALL,
        ["ddp", "ddp_naive", "model_parallel", "pipeline_gpipe", "pipeline_1f1b"],
        world_size=2,
        steps=3,
        model_fn=global_rng_model,
        data_fn=global_rng_data,
    )
    assert result["ok"].all(), result
    assert (result["max_abs_diff"] <= 1e-5).all(), result


def test_a_regression_model_with_its_own_loss_and_optimizer_trains_the_same_under_ddp():
    def data(cfg):
        g = torch.Generator().manual_seed(cfg.seed)
        x = torch.randn(256, 8, generator=g)
        return TensorDataset(x, x.sum(dim=1, keepdim=True))

    kwargs = dict(
        model_fn=lambda cfg: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)),
        data_fn=data,
        loss_fn=lambda cfg: nn.MSELoss(),
        optimizer_fn=lambda cfg, params: torch.optim.Adam(params, lr=1e-2),
    )
    cfg = SMALL.replace(steps=20, deterministic=True)
    ddp = experiment.run(cfg, **kwargs)
    single = experiment.run(cfg.replace(strategy="single", world_size=1), **kwargs)
    loss = single.records.groupby("step")["loss"].first()
    assert loss.iloc[-1] < 0.5 * loss.iloc[0], loss  # it really trains
    got = ddp.records.groupby("step")["loss"].first()
    assert (got - loss).abs().max() <= 1e-5
    assert max((ddp.params[k] - single.params[k]).abs().max().item() for k in single.params) <= 1e-5


class Draws(nn.Module):
    """Keeps the last number drawn from the global RNG in a buffer: which stream a rank has."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 10)
        self.register_buffer("draw", torch.zeros(()))

    def forward(self, x):
        self.draw.fill_(torch.rand(()).item())
        return self.lin(x)


def test_each_rank_draws_its_own_random_numbers_from_identical_weights():
    cfg = SMALL.replace(deterministic=True)
    first = experiment.run(cfg, model_fn=lambda cfg: Draws(), data_fn=global_rng_data)
    again = experiment.run(cfg, model_fn=lambda cfg: Draws(), data_fn=global_rng_data)
    draws = [res["params"]["draw"].item() for res in first.results]
    assert draws[0] != draws[1]  # dropout masks would differ per rank
    assert draws == [res["params"]["draw"].item() for res in again.results]  # and repeat
    w0, w1 = (res["params"]["lin.weight"] for res in first.results)
    assert torch.equal(w0, w1)
