"""The memory and mixed-precision lab: exact category counts on a model of known size, autocast
bf16 (and fp16 with its scaler) against fp32, ZeRO-1 and FSDP against single with real ranks on
gloo, activation checkpointing's saving, and the calculator against counted memory at world
sizes 1 and 2. Speed ratios are a benchmark (benchmarks/memory_precision.py), not a test.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_memory.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from labkit import env
from labkit.cli import build_parser
from labkit.flags import config_from_args
from labkit.models import checkpoint_blocks, cnn
from labkit.predict.memory import activation_bytes, shard_numels, transformer
from labkit.rank import precision
from labkit.rank.memory_meter import MemoryMeter
from tests.helpers.configs import SMALL_DDP as BASE

# ---- counting, in one process ---------------------------------------------------------------


def _one_step(model, x, y, opt, amp=None):
    meter = MemoryMeter(model, opt)
    amp = amp or precision.Amp("fp32", torch.device("cpu"))
    with meter.forward(x, y), amp.autocast():
        loss = nn.functional.cross_entropy(model(x), y)
    amp.backward(loss)
    meter.grads()
    amp.step(opt)
    meter.step()
    return meter.columns()


def test_categories_of_a_model_of_known_size_are_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    cols = _one_step(model, x, y, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    n = 8 * 16 + 16 + 16 * 4 + 4  # 212 parameters
    assert cols["mem_params_bytes"] == 4 * n
    assert cols["mem_grads_bytes"] == 4 * n
    assert cols["mem_optimizer_bytes"] == 4 * n  # one momentum buffer per parameter
    # ReLU's output (5x16 fp32), the log-probabilities (5x4 fp32), the mean's 4-byte weight; the
    # first Linear saves the batch itself, which is "rest" with the targets
    assert cols["mem_activations_bytes"] == 5 * 16 * 4 + 5 * 4 * 4 + 4
    assert cols["mem_rest_bytes"] == 5 * 8 * 4 + 5 * 8
    bn = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    cols_bn = _one_step(bn, x, y, torch.optim.SGD(bn.parameters(), lr=0.1))
    assert cols_bn["mem_rest_bytes"] == 5 * 8 * 4 + 5 * 8 + 2 * 16 * 4 + 8  # + running stats
    adam = torch.optim.Adam(model.parameters())
    cols = _one_step(model, x, y, adam)
    assert cols["mem_optimizer_bytes"] == 8 * n + 4 * 4  # two moments + a step per tensor


def test_bf16_saves_16_bit_activations_and_weight_copies():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    cols = _one_step(
        model,
        x,
        y,
        torch.optim.SGD(model.parameters(), lr=0.1),
        precision.Amp("bf16", torch.device("cpu")),
    )
    # bf16 cast of the input (the first Linear's saved input), ReLU's bf16 output, fp32 log-probs
    assert cols["mem_activations_bytes"] == 5 * 8 * 2 + 5 * 16 * 2 + 5 * 4 * 4 + 4
    # the batch, and the second Linear's bf16 weight copy (the first needs none: its input
    # needs no gradient)
    assert cols["mem_rest_bytes"] == 5 * 8 * 4 + 5 * 8 + 16 * 4 * 2
    assert cols["mem_params_bytes"] == 4 * 212  # master weights stay fp32


def test_checkpointing_keeps_block_inputs_only():
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    plain = cnn(width=8, depth=3)
    ckpt = checkpoint_blocks(copy.deepcopy(plain))
    a = _one_step(plain, x, y, torch.optim.SGD(plain.parameters(), lr=0.1))
    b = _one_step(ckpt, x, y, torch.optim.SGD(ckpt.parameters(), lr=0.1))
    assert b["mem_activations_bytes"] < a["mem_activations_bytes"] / 4
    for p, q in zip(plain.parameters(), ckpt.parameters()):  # same update, recomputed
        assert torch.allclose(p, q, atol=1e-6)
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    with pytest.raises(ValueError, match="nn.Sequential"):
        checkpoint_blocks(nn.Linear(2, 2))


def test_calculator_traces_the_same_bytes_without_running():
    model = cnn(width=8, depth=3)
    for prec in ("fp32", "bf16"):
        for ck in (False, True):
            got = activation_bytes(model, (8, 3, 16, 16), 10, precision=prec, checkpoint=ck)
            m = checkpoint_blocks(cnn(width=8, depth=3)) if ck else cnn(width=8, depth=3)
            x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
            cols = _one_step(
                m,
                x,
                y,
                torch.optim.SGD(m.parameters(), lr=0.1),
                precision.Amp(prec, torch.device("cpu")),
            )
            assert got["activations"] == cols["mem_activations_bytes"], (prec, ck)
            assert got["weight_copies"] + 8 * (3 * 256 * 4 + 8) == cols["mem_rest_bytes"]


def test_shards_follow_fsdp_padding_and_zero_partition():
    shapes = [(5, 3), (5,), (4, 4)]
    assert shard_numels(shapes, "fsdp", 2) == [3 * 3 + 3 + 2 * 4] * 2  # dim 0 rounded up
    assert sorted(shard_numels(shapes, "zero1", 2)) == [16, 20]  # whole tensors
    assert shard_numels(shapes, "ddp", 2) == [36, 36]


def test_seven_billion_transformer_row_is_the_paper_formula():
    row = transformer(7e9, strategy="ddp", world_size=1)
    assert row["params"] + row["grads"] + row["optimizer"] == 16 * 7e9  # 2 + 2 + 12
    sharded = transformer(7e9, strategy="fsdp", world_size=64)
    assert math.isclose(sharded["params"] + sharded["grads"] + sharded["optimizer"], 16 * 7e9 / 64)
    assert "computed" in row["model"]


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"strategy": "pipeline_gpipe", "precision": "bf16"}, "changes the shared training loop"),
        ({"strategy": "fsdp", "precision": "fp16"}, "use precision='bf16'"),
    ],
)
def test_bad_memory_settings_say_how(changes, match):
    with pytest.raises(ValueError, match=match):
        BASE.replace(**changes)


def test_fp16_unsupported_names_bf16(monkeypatch):
    monkeypatch.setattr(env, "fp16_supported", lambda kind: False)
    with pytest.raises(ValueError, match="use precision='bf16'"):
        BASE.replace(strategy="single", world_size=1, precision="fp16", device="cpu")


def test_cli_flags_reach_the_config():
    args = build_parser().parse_args(
        ["memory", "--precision", "bf16", "--activation-checkpointing"]
    )
    cfg = config_from_args(args, strategy="ddp", world_size=2)
    assert (cfg.precision, cfg.activation_checkpointing) == ("bf16", True)
