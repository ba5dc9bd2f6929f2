"""``check`` picks the model each strategy needs when ``--model``/``--experts`` are left out:
cp splits a transformer's sequence, ep spreads a mixture of experts; the issue's command
``check --strategies cp,cp_ulysses,ep`` ran into "set model='transformer'" before."""

from __future__ import annotations

import pytest

from labkit.cli import build_parser
from labkit.cli.run import _check_config, _model_groups


def groups(argv: str) -> list[tuple[list[str], dict]]:
    args = build_parser().parse_args(["check", *argv.split()])
    found = _model_groups(args, args.strategies.split(","))
    for names, model in found:  # each group is a valid config (nothing runs)
        _check_config(args, names, **model)
    return found


def test_left_out_the_model_is_what_the_strategies_need():
    assert groups("--strategies ddp,fsdp") == [(["ddp", "fsdp"], dict(model="mlp", experts=0))]
    assert groups("--strategies cp,cp_ulysses,ep,ddp --world-size 2") == [
        (["cp", "cp_ulysses", "ddp"], dict(model="transformer", experts=0)),
        (["ep"], dict(model="transformer", experts=4)),
    ]
    assert groups("--strategies ep --world-size 4") == [
        (["ep"], dict(model="transformer", experts=8))
    ]


def test_what_the_flags_say_wins_and_a_contradiction_names_the_fix():
    assert groups("--strategies ep --experts 2 --world-size 2") == [
        (["ep"], dict(model="transformer", experts=2))
    ]
    assert groups("--strategies ddp --model cnn") == [(["ddp"], dict(model="cnn", experts=0))]
    with pytest.raises(ValueError, match="set model='transformer'"):
        groups("--strategies cp --model mlp")
