"""The dry run equals a real run: the same step of the same strategy code, once on real gloo
ranks (processes, real tensors) and once as each rank in this process on tensors without
storage, read by the same meter and the same byte hooks. Every rank's memory by category and
every collective (op, group size, count, payload, bytes sent) must be equal, to the byte."""

from __future__ import annotations

import pytest

from labkit.config import RunConfig
from labkit.labs import dryrun as D

LM = D.Transformer(layers=2, hidden=32, heads=4, seq_len=16, vocab=64)
TOY = dict(model="transformer", width=32, depth=2, heads=4)

CASES = {
    "ddp-2": (RunConfig(strategy="ddp", world_size=2, global_batch=16), None, "labkit"),
    "zero1-4": (RunConfig(strategy="zero1", world_size=4, global_batch=16), None, "labkit"),
    "fsdp-4": (RunConfig(strategy="fsdp", world_size=4, global_batch=16), None, "labkit"),
    "hsdp-4": (RunConfig(strategy="hsdp", world_size=4, global_batch=16), None, "labkit"),
    "tp-2": (RunConfig(strategy="tp", world_size=2, global_batch=8, **TOY), None, "labkit"),
    "dp_tp-4-sp": (LM.config(strategy="dp_tp", world_size=4, tp=2, global_batch=4,
                             sequence_parallel=True), LM, "paper"),
    "fsdp_tp-4": (LM.config(strategy="fsdp_tp", world_size=4, tp=2, global_batch=4), LM, "paper"),
    "dp_pp-4": (RunConfig(strategy="dp_pp", world_size=4, stages=2, global_batch=16), None,
                "labkit"),
    "1f1b-2-bf16": (LM.config(strategy="pipeline_1f1b", world_size=2, stages=2, global_batch=8),
                    LM, "labkit"),
    # the context-parallel, 4-D and interleaved strategies, as they landed
    "cp-2": (RunConfig(strategy="cp", world_size=2, global_batch=8, seq_len=16, **TOY), None,
             "labkit"),
    "cp_ulysses-2": (RunConfig(strategy="cp_ulysses", world_size=2, global_batch=8, seq_len=16,
                               **TOY), None, "labkit"),
    "mesh4d-4": (RunConfig(strategy="mesh4d", world_size=4, tp=2, stages=2, global_batch=16,
                           seq_len=16, **TOY), None, "labkit"),
    "interleaved-2": (RunConfig(strategy="pipeline_interleaved", world_size=2, stages=2,
                                virtual_stages=2, microbatches=4, global_batch=16, depth=4),
                      None, "labkit"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_dry_run_equals_a_real_run_rank_by_rank(name):
    cfg, shape, recipe = CASES[name]
    real = D.real(cfg, shape=shape, recipe=recipe)
    dry = D.dryrun(cfg, rank=list(range(cfg.world_size)), shape=shape, recipe=recipe)
    assert not dry.failed, dry.failed[0].error
    for r, d in zip(real.ranks, dry.ranks):
        assert d.rank == r.rank
        assert d.memory == r.memory, (name, r.rank)
        assert d.collectives == r.collectives, (name, r.rank)
        assert r.collectives or cfg.world_size == 1  # something was sent and counted
