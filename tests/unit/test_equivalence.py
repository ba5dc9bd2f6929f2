"""check() with models labkit did not write: batch norm, dropout, a transformer, resnet18, and
resnet18 with faults check cannot see by inspection.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_equivalence.py."""

from __future__ import annotations

import torch

from labkit import RunConfig
from labkit.labs import equivalence
from labkit.labs.equivalence import batch_stat_layers, random_layers, without_dropout
from tests.helpers.models import TinyTransformer, bn_mlp, dropout_mlp, vectors

BASE = RunConfig(strategy="ddp", world_size=2, global_batch=32, dataset_size=128, timeout_s=180)


def test_inspection_names_batch_statistics_and_randomness():
    assert batch_stat_layers(bn_mlp(None)) == ["1"] and random_layers(bn_mlp(None)) == []
    assert random_layers(dropout_mlp(None)) == ["2"]
    assert len(random_layers(TinyTransformer(None))) >= 3  # dropouts and attention
    assert random_layers(TinyTransformer(0.0)) == []
    quiet = without_dropout(lambda cfg: TinyTransformer(None))(BASE)
    assert random_layers(quiet) == []


def test_float64_runs_cast_the_model_and_the_inputs_not_the_targets():
    model_fn, data_fn = equivalence.in_float64(bn_mlp, vectors)
    model, (x, y) = model_fn(BASE), data_fn(BASE)[0]
    assert {t.dtype for t in model.state_dict().values()} == {torch.float64, torch.int64}
    assert x.dtype == torch.float64 and y.dtype == torch.int64
    assert torch.equal(x.float(), vectors(BASE)[0][0])  # the same samples, widened
