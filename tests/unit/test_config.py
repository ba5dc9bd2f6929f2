"""RunConfig: frozen, validated, and every ValueError says what to change."""

from __future__ import annotations

import dataclasses

import pytest

from labkit.config import MODELS, RunConfig
from labkit.registry import STRATEGIES

# (changes to the default config, words the error must contain: what is wrong and the fix)
INVALID = [
    (
        {"strategy": "telepathy"},
        ["unknown strategy 'telepathy'", "choose one of single, dataparallel, ddp"],
    ),
    ({"world_size": 0}, ["world_size must be at least 1, got 0"]),
    ({"steps": 0}, ["steps must be at least 1"]),
    ({"global_batch": 0}, ["global_batch must be at least 1"]),
    ({"depth": 0}, ["depth must be at least 1"]),
    ({"dataset_size": 0}, ["dataset_size must be at least 1"]),
    ({"microbatches": 0}, ["microbatches must be at least 1"]),
    ({"warmup": -1}, ["warmup must be >= 0"]),
    ({"model": "resnet"}, ["unknown model 'resnet'", "choose one of mlp, cnn, unbalanced_mlp"]),
    ({"device": "gpu"}, ["unknown device 'gpu'", "choose one of auto, cpu, cuda"]),
    ({"backend": "ucc"}, ["unknown backend 'ucc'", "choose one of gloo, nccl, mpi or None"]),
    ({"pipeline_impl": "fast"}, ["unknown pipeline_impl 'fast'", "scratch, torch"]),
    ({"rebalance": "often"}, ["unknown rebalance 'often'", "static, dynamic, join"]),
    ({"comm_hook": "zip"}, ["unknown comm_hook 'zip'", "none, fp16, bf16, powersgd"]),
    ({"precision": "fp8"}, ["unknown precision 'fp8'", "fp32, bf16, fp16"]),
    (
        {"strategy": "ddp_naive", "comm_hook": "fp16"},
        ["it is a knob of ddp, not of ddp_naive", "set comm_hook='none'"],
    ),
    (
        {"strategy": "local_sgd", "skew": 0.5},
        ["a knob of ddp, ddp_naive, not of local_sgd", "set strategy='ddp' or 'ddp_naive'"],
    ),
    (
        {"strategy": "ddp", "rebalance": "join"},
        ["a hand-written Joinable", "strategy='ddp_naive'"],
    ),
    (
        {"strategy": "pipeline_gpipe", "precision": "bf16"},
        ["a knob of single, dataparallel, ddp", "not of pipeline_gpipe", "precision='fp32'"],
    ),
    (
        {"strategy": "local_sgd", "accumulate": 2},
        ["local_sgd takes one batch per optimizer step", "set accumulate=1"],
    ),
    (
        {"strategy": "pipeline_1f1b", "accumulate": 2},
        ["set microbatches instead of accumulate"],
    ),
    ({"strategy": "single"}, ["single runs on one device: set world_size=1 (got 2)"]),
    (
        {"strategy": "pipeline_gpipe", "world_size": 2, "stages": 3},
        ["set world_size == stages", "world_size=2, stages=3"],
    ),
    (
        {"strategy": "pipeline_1f1b", "global_batch": 30, "microbatches": 4},
        ["global batch 30 is not divisible by 4 micro-batches x 1 pipeline(s)", "multiple of 4"],
    ),
    (
        {"strategy": "dp_pp", "world_size": 3, "stages": 2},
        ["world size 3 is not a multiple of 2", "set world_size to a multiple of stages"],
    ),
    (
        {"strategy": "model_parallel", "world_size": 4, "stages": 4, "depth": 2},
        ["depth 2 has 3 layers, too few for 4 stages", "raise depth or lower stages"],
    ),
    (
        {"global_batch": 30, "world_size": 4},
        ["global batch 30 is not divisible by world size 4", "a multiple of 4"],
    ),
    (
        {"dataset_size": 32, "global_batch": 64},
        ["dataset_size 32 is smaller than one global batch (64)", "raise dataset_size"],
    ),
    ({"threads": 0}, ["threads must be at least 1 or None"]),
    ({"timeout_s": 0}, ["timeout_s must be positive"]),
]


@pytest.mark.parametrize(
    "changes, words", INVALID, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c, _ in INVALID]
)
def test_each_invalid_config_raises_a_value_error_naming_the_fix(changes, words):
    with pytest.raises(ValueError) as info:
        RunConfig(**changes)
    for w in words:
        assert w in str(info.value), f"{w!r} missing from: {info.value}"


def test_replace_validates_too():
    cfg = RunConfig(world_size=2, global_batch=64)
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        cfg.replace(world_size=3)
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        dataclasses.replace(cfg, world_size=3)


def test_defaults_are_valid_and_every_strategy_and_model_has_a_valid_config():
    RunConfig()
    for strategy in STRATEGIES:
        # context parallelism splits a sequence: only the transformer has one; expert
        # parallelism spreads a mixture of experts, which only the transformer's blocks become
        s = STRATEGIES[strategy]
        model = "transformer" if "cp" in s.knobs or s.kind == "expert_parallel" else "mlp"
        experts = 4 if s.kind == "expert_parallel" else 0
        ws = 1 if strategy == "single" else 2
        cfg = RunConfig(strategy=strategy, world_size=ws, model=model, experts=experts)
        assert cfg.strategy == strategy
    for model in MODELS:
        assert RunConfig(model=model).model == model


def test_expert_parallelism_without_experts_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="set experts, a multiple of the ranks"):
        RunConfig(strategy="ep", model="transformer")


def test_frozen():
    cfg = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.world_size = 4


@pytest.mark.parametrize(
    "strategy, world_size, ranks",
    [
        ("single", 1, 1),
        ("dataparallel", 2, 1),
        ("ddp", 2, 2),
        ("ddp_naive", 4, 4),
        ("model_parallel", 2, 2),
        ("pipeline_gpipe", 2, 2),
        ("pipeline_1f1b", 2, 2),
    ],
)
def test_ranks_is_the_number_of_processes(strategy, world_size, ranks):
    assert RunConfig(strategy=strategy, world_size=world_size).ranks == ranks


def test_batch_per_rank():
    assert RunConfig(strategy="ddp", world_size=4, global_batch=64).batch_per_rank == 16
    assert RunConfig(strategy="dataparallel", world_size=2, global_batch=64).batch_per_rank == 64
    assert (
        RunConfig(
            strategy="pipeline_gpipe", world_size=2, stages=2, global_batch=64, microbatches=8
        ).batch_per_rank
        == 8
    )


def test_to_dict_round_trips():
    cfg = RunConfig(strategy="ddp_naive", world_size=4, lr=0.1, threads=1, backend="gloo")
    assert RunConfig(**cfg.to_dict()) == cfg


def test_shard_size_is_hsdps_and_must_divide_the_world():
    assert RunConfig(strategy="hsdp", world_size=4).shard_group == 2  # two copies by default
    assert RunConfig(strategy="hsdp", world_size=2).shard_group == 2  # one copy: FSDP
    with pytest.raises(ValueError, match="does not divide world size 4"):
        RunConfig(strategy="hsdp", world_size=4, shard_size=3)
    with pytest.raises(ValueError, match="shard_size"):
        RunConfig(strategy="fsdp", world_size=4, shard_size=2)


@pytest.mark.parametrize("knob", ["tp", "cp", "shard_size", "ep", "stages", "virtual_stages"])
def test_a_degree_that_does_not_fit_the_world_is_a_valueerror_for_every_strategy(knob):
    """A degree larger than the world (8 on 2 ranks) is refused with a ValueError naming the
    fix, by every strategy that takes it: never an arithmetic error from dividing by it
    (fsdp_tp with tp=8 raised ZeroDivisionError)."""
    for name, s in STRATEGIES.items():
        if knob not in s.knobs:
            continue
        model = "transformer" if "cp" in s.knobs or s.kind == "expert_parallel" else "mlp"
        experts = 8 if s.kind == "expert_parallel" else 0
        with pytest.raises(ValueError):
            RunConfig(strategy=name, world_size=2, model=model, experts=experts, **{knob: 8})
