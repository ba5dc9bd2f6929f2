"""The dry run in this process (no rank is started): bad input refused before anything runs, a
configuration the code cannot run without data reported as such, and what the dry run counts
beside what two other sources say: the trace calculator on the same model, and the formulas
with every named modelling choice sized from the model's shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from labkit.config import RunConfig
from labkit.labs import dryrun as D
from labkit.labs.dryrun import beside as B
from labkit.rank.storage_less import lazy_chunks

SMALL = D.Transformer(layers=2, hidden=128, heads=4, seq_len=256, vocab=1000)


@pytest.mark.parametrize(
    "make, fix",
    [
        (lambda: D.dryrun(RunConfig(strategy="local_sgd"), world_size=8), "choose one of"),
        (lambda: D.dryrun(RunConfig(strategy="ddp", global_batch=64), world_size=48),
         "multiple of 48"),
        (lambda: SMALL.config(strategy="dp_tp", world_size=8, tp=3, global_batch=8),
         "set tp to a divisor of world size 8"),
        (lambda: SMALL.config(strategy="tp", world_size=8, global_batch=1),
         "pick heads that are a multiple of 8"),
        (lambda: D.Transformer(2, 100, 8, 16, 10), "multiple of heads"),
        (lambda: D.dryrun(RunConfig(strategy="ddp"), rank=2), "rank must be in 0..1"),
        (lambda: D.dryrun(RunConfig(strategy="ddp"), recipe="fp8"), "recipe must be one of"),
        (lambda: D.dryrun(RunConfig(strategy="pipeline_1f1b", balance_stages=True)),
         "balance_stages=False"),
        (lambda: D.dryrun(D.Transformer(2, 64, 4, 16, 10, tie=True).config(
            strategy="pipeline_1f1b", world_size=2, global_batch=4),
            shape=D.Transformer(2, 64, 4, 16, 10, tie=True)), "tie=False"),
        (lambda: D.dryrun(RunConfig(strategy="ddp", precision="bf16"), recipe="paper"),
         "precision='fp32'"),
    ],
)  # fmt: skip
def test_bad_input_is_refused_with_the_fix_before_anything_runs(make, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_an_op_without_data_is_reported_never_filled_in():
    class Masked(nn.Module):  # boolean indexing: the output's size depends on the data
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(32, 10)

        def forward(self, x):
            return self.lin(x[x.sum(1) > 0])

    run = D.dryrun(RunConfig(strategy="ddp", world_size=4, global_batch=16),
                   model_fn=lambda cfg: Masked())  # fmt: skip
    assert run.failed and "could not run without data" in run.ranks[0].error
    assert "nonzero" in run.ranks[0].error and run.ranks[0].memory == {}
    assert run.memory()["total"].isna().all()


@pytest.mark.parametrize("size, n", [(10, 4), (12, 4), (3, 8), (0, 4), (1024, 1024), (7, 1)])
def test_lazy_chunks_are_torch_chunk_padded_with_empty_tensors(size, n):
    t = torch.arange(size * 3).reshape(size, 3)
    eager = list(torch.chunk(t, n, dim=0)) if size else [t]
    while len(eager) < n:
        eager.append(eager[0].new_empty(0))
    lazy = lazy_chunks(t, n, 0)
    assert len(lazy) == n
    for i in (0, n - 1, n // 2):
        assert torch.equal(lazy[i], eager[i]) and lazy[i].shape == eager[i].shape


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp", "hsdp"])
def test_dry_run_equals_the_trace_calculator_on_labkits_mlp(strategy):
    """Two sources: the meter on the fake rank's real step, the calculator tracing the model."""
    run = D.dryrun(RunConfig(strategy=strategy, world_size=4, global_batch=16))
    for rank in run.ranks:
        run.ranks = [rank]
        table = B.beside(run).set_index("category")
        assert table.attrs["source"] == "predict.memory.calculate"
        assert (table["difference"] == 0).all(), (strategy, rank.role, table)


LAYOUTS = [
    dict(strategy="single", world_size=1, global_batch=2),
    dict(strategy="single", world_size=1, global_batch=2, activation_checkpointing=True),
    dict(strategy="tp", world_size=4, global_batch=2),
    dict(strategy="tp", world_size=4, global_batch=2, sequence_parallel=True),
    dict(strategy="ddp", world_size=4, global_batch=8),
    dict(strategy="zero1", world_size=4, global_batch=8),
    dict(strategy="fsdp", world_size=4, global_batch=8),
    dict(strategy="fsdp_tp", world_size=8, tp=4, global_batch=4),
    dict(strategy="dp_tp", world_size=8, tp=4, global_batch=4, sequence_parallel=True),
    dict(strategy="pipeline_1f1b", world_size=2, stages=2, microbatches=4, global_batch=8),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda k: "-".join(map(str, k.values())))
def test_every_difference_from_the_formulas_is_a_named_choice(layout):
    """The formulas (Megatron-LM's parameters, ZeRO's shards, Korthikanti's activations, the
    advisor's bytes) plus each named choice, sized from the shape alone, give what the dry run
    counted: model states and bytes to the byte, activations but for the LayerNorms' and
    attention's statistics (under 1 % here, 1/h of a layer)."""
    run = D.dryrun(SMALL.config(**layout), shape=SMALL, recipe="paper")
    assert not run.failed, run.failed[0].error
    table = B.beside(run).set_index("category")
    for c in ("params", "grads", "optimizer"):
        assert table.loc[c, "residual"] == 0, (c, table.loc[c, "why"])
    acts = table.loc["activations"]
    assert acts["difference"] != 0  # the formula alone is off...
    assert 0 <= acts["residual"] < 0.01 * acts["dry_run"]  # ...the named choices are not
    traffic = B.traffic_beside(run).set_index("traffic")
    assert (traffic["residual"] == 0).all(), traffic


@pytest.mark.parametrize(
    "cfg, where",
    [
        (RunConfig(strategy="ep", world_size=2, experts=4, global_batch=16, model="transformer",
                   width=32, depth=2, heads=4), "nonzero"),  # routing sizes depend on the data
        (RunConfig(strategy="pipeline_zb", world_size=2, stages=2, microbatches=4,
                   global_batch=16), "distributed_c10d"),  # torch's stages pickle their shapes
    ],
    ids=["ep", "pipeline_zb"],
)  # fmt: skip
def test_strategies_that_need_data_are_reported_not_estimated(cfg, where):
    run = D.dryrun(cfg)
    assert run.failed and all(where in r.error for r in run.ranks), [r.error for r in run.ranks]
