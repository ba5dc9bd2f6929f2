"""Toy data (learnable, seeded, sharded) and toy models (splittable into stages)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from labkit.config import RunConfig
from labkit.data import SyntheticImages, ToyClassification, batches, make_dataset, shard_loader
from labkit.models import (
    cnn,
    even_bounds,
    make_model,
    mlp,
    split,
    stage_param_names,
    unbalanced_mlp,
)


class Indices(Dataset):
    """Sample i is the number i, so a loader's output says exactly which samples it drew."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _linear_probe_accuracy(x: torch.Tensor, y: torch.Tensor, n_train: int, classes: int) -> float:
    """Held-out accuracy of a least-squares linear classifier (closed form: cheap, no tuning)."""
    xa = torch.cat([x, torch.ones(len(x), 1)], dim=1)
    target = nn.functional.one_hot(y[:n_train], classes).float()
    w = torch.linalg.lstsq(xa[:n_train], target).solution
    return (xa[n_train:] @ w).argmax(1).eq(y[n_train:]).float().mean().item()


def _majority(y: torch.Tensor) -> float:
    return torch.bincount(y).max().item() / len(y)


# ---- toy data -----------------------------------------------------------------------------------


def test_toy_classification_is_learnable_by_a_linear_probe():
    ds = ToyClassification(2048, in_features=32, classes=10, seed=0)
    assert ds.y.unique().numel() == 10  # every class occurs
    acc = _linear_probe_accuracy(ds.x, ds.y, 1536, 10)
    # labels come from a nonlinear teacher; a linear probe still gets well past guessing
    assert acc > 2 * _majority(ds.y), f"probe accuracy {acc:.2f} vs chance {_majority(ds.y):.2f}"


def test_a_few_sgd_steps_on_the_config_model_beat_chance_on_held_out_data():
    cfg = RunConfig(strategy="single", world_size=1, dataset_size=1024, width=64, depth=2)
    ds, model = make_dataset(cfg), make_model(cfg)
    train, held_out = Subset(ds, range(768)), slice(768, 1024)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = batches(shard_loader(train, 64, rank=0, world_size=1, seed=cfg.seed))
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(60):
        x, y = next(loader)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        acc = model(ds.x[held_out]).argmax(1).eq(ds.y[held_out]).float().mean().item()
    assert acc > 2 * _majority(ds.y), f"accuracy {acc:.2f} vs chance {_majority(ds.y):.2f}"


def test_synthetic_images_are_learnable_and_transformed():
    ds = SyntheticImages(768, classes=10, seed=0)
    x0, y0 = ds[0]
    assert ds.images.dtype == torch.uint8 and ds.images.shape == (768, 3, 16, 16)
    assert x0.dtype == torch.float32 and x0.shape == (3, 16, 16) and y0.dtype == torch.int64
    assert -1.0 <= x0.min() and x0.max() <= 1.0  # ToDtype(scale) then Normalize(.5, .5)
    x = ds.transform(ds.images)  # v2 transforms take a batch, too
    assert torch.equal(x[0], x0)
    acc = _linear_probe_accuracy(x.flatten(1), ds.y, 512, 10)
    assert acc > 2 * _majority(ds.y), f"probe accuracy {acc:.2f} vs chance {_majority(ds.y):.2f}"


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: ToyClassification(256, 8, 4, seed=seed),
        lambda seed: SyntheticImages(64, 4, seed=seed),
    ],
    ids=["toy", "images"],
)
def test_datasets_are_seeded_and_identical_across_instances(make):
    a, b, c = make(0), make(0), make(1)
    xa = getattr(a, "x", None) if hasattr(a, "x") else a.images
    xb = getattr(b, "x", None) if hasattr(b, "x") else b.images
    xc = getattr(c, "x", None) if hasattr(c, "x") else c.images
    assert torch.equal(xa, xb) and torch.equal(a.y, b.y)
    assert not torch.equal(xa, xc)


def test_make_dataset_follows_the_config():
    toy = make_dataset(RunConfig(model="mlp", dataset_size=128, in_features=8, classes=3))
    assert isinstance(toy, ToyClassification) and len(toy) == 128
    assert toy.x.shape == (128, 8) and int(toy.y.max()) < 3
    images = make_dataset(RunConfig(model="cnn", dataset_size=128, classes=3))
    assert isinstance(images, SyntheticImages) and len(images) == 128


# ---- sharding -----------------------------------------------------------------------------------


def _shards(n: int, batch_size: int, world_size: int, seed: int = 0) -> list[list[int]]:
    return [
        [int(i) for b in shard_loader(Indices(n), batch_size, rank, world_size, seed) for i in b]
        for rank in range(world_size)
    ]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n, batch_size", [(100, 1), (100, 4), (97, 5)])
def test_shards_are_disjoint_and_cover_all_but_the_remainder(world_size, n, batch_size):
    shards = _shards(n, batch_size, world_size)
    seen = [i for shard in shards for i in shard]
    assert len(seen) == len(set(seen)), "a sample went to two ranks"
    per_rank = n // world_size  # the sampler drops n % world_size ...
    per_rank -= per_rank % batch_size  # ... and the loader a partial batch
    assert [len(s) for s in shards] == [per_rank] * world_size
    assert set(seen) <= set(range(n))
    if batch_size == 1:  # only the sampler's remainder is missing
        assert len(set(seen)) == n - n % world_size


def test_union_of_rank_batches_is_the_one_rank_batch():
    # Why DDP can match single-device training sample for sample (shard_loader's docstring).
    ds, world_size, b = Indices(96), 3, 4
    ranks = [list(shard_loader(ds, b, r, world_size, seed=5)) for r in range(world_size)]
    whole = list(shard_loader(ds, b * world_size, 0, 1, seed=5))
    assert len(whole) == len(ranks[0])
    for step, batch in enumerate(whole):
        assert sorted(batch.tolist()) == sorted(i for r in ranks for i in r[step].tolist())


def test_shard_smaller_than_a_batch_says_so():
    with pytest.raises(ValueError, match="fewer than one batch of 64"):
        shard_loader(Indices(100), 64, rank=0, world_size=2)


def test_batches_reshuffles_each_epoch_and_is_seeded():
    def epochs(rank, seed=0):
        it = batches(shard_loader(Indices(40), 5, rank=rank, world_size=2, seed=seed))
        flat = [int(i) for _ in range(8) for i in next(it)]  # 4 batches per epoch
        return flat[:20], flat[20:]

    (first0, second0), (first1, second1) = epochs(0), epochs(1)
    assert first1 != second1  # a new order each epoch (set_epoch)
    assert sorted(first0 + first1) == sorted(second0 + second1) == list(range(40))
    assert epochs(1) == (first1, second1)  # the same run for the same seed
    assert epochs(1, seed=1)[0] != first1


def test_batches_works_with_a_plain_loader():
    it = batches(DataLoader(Indices(6), batch_size=3))
    assert [next(it).tolist() for _ in range(3)] == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]


# ---- models -------------------------------------------------------------------------------------

MODELS = {
    "mlp": (lambda: mlp(16, 32, 4, 5), (6, 16)),
    "unbalanced_mlp": (lambda: unbalanced_mlp(16, 32, 4, 5), (6, 16)),
    "cnn": (lambda: cnn(3, 8, 3, 5), (6, 3, 16, 16)),
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_split_stages_recomposed_equal_the_whole_model(name, stages):
    torch.manual_seed(0)
    build, shape = MODELS[name]
    model = build()
    x = torch.randn(*shape)
    bounds = even_bounds(len(model), stages)
    parts = split(model, bounds)
    assert len(parts) == stages and sum(len(p) for p in parts) == len(model)
    h = x
    for part in parts:
        h = part(h)
    assert h.shape == (6, 5)
    assert torch.equal(h, model(x))


@pytest.mark.parametrize("name", MODELS)
def test_split_stages_hold_the_whole_models_own_parameters(name):
    model = MODELS[name][0]()
    whole = {id(p) for p in model.parameters()}
    parts = split(model, even_bounds(len(model), 3))
    local = [id(p) for part in parts for p in part.parameters()]
    assert sorted(local) == sorted(whole)  # shared, not copied; each once


@pytest.mark.parametrize("name", MODELS)
def test_stage_param_names_map_to_the_whole_model(name):
    model = MODELS[name][0]()
    whole = dict(model.named_parameters())
    bounds = even_bounds(len(model), 3)
    mapped = {}
    for stage, part in enumerate(split(model, bounds)):
        names = stage_param_names(bounds, stage, part)
        assert set(names) == {local for local, _ in part.named_parameters()}
        for local, param in part.named_parameters():
            assert names[local] in whole, f"stage {stage}: {local} -> {names[local]}"
            assert whole[names[local]] is param  # the very same tensor
            mapped[names[local]] = local
    assert set(mapped) == set(whole)  # every parameter, exactly one stage


@pytest.mark.parametrize("n_layers, stages", [(5, 1), (5, 2), (5, 3), (5, 5), (8, 3), (2, 2)])
def test_even_bounds_balance_layer_counts(n_layers, stages):
    bounds = even_bounds(n_layers, stages)
    sizes = [b - a for a, b in zip(bounds, bounds[1:] + [n_layers])]
    assert bounds[0] == 0 and len(bounds) == stages
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("stages", [0, 6])
def test_even_bounds_refuses_impossible_splits(stages):
    with pytest.raises(ValueError, match="use between 1 and 5 stages"):
        even_bounds(5, stages)


@pytest.mark.parametrize("bounds", [[1, 3], [0, 3, 2], [0, 2, 2], [0, 5]])
def test_split_refuses_bad_bounds(bounds):
    with pytest.raises(ValueError, match="must start at 0 and strictly increase below 5"):
        split(mlp(4, 8, 4, 2), bounds)


def test_make_model_is_seeded_and_follows_the_config():
    cfg = RunConfig(width=32, depth=3, in_features=8, classes=4)
    a, b = make_model(cfg), make_model(cfg)
    c = make_model(cfg.replace(seed=1))
    assert len(a) == cfg.depth + 1
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert a(torch.randn(2, 8)).shape == (2, 4)
    images = make_model(cfg.replace(model="cnn"))
    assert images(torch.randn(2, 3, 16, 16)).shape == (2, 4)


def test_unbalanced_mlp_puts_most_work_late():
    model = unbalanced_mlp(32, 256, 4, 10)
    sizes = [sum(p.numel() for p in block.parameters()) for block in model[:-1]]
    assert sizes == sorted(sizes) and sizes[-1] > 4 * sizes[0]
    assert len(unbalanced_mlp(8, 16, 1, 2)) == 2  # depth 1 falls back to a plain MLP
