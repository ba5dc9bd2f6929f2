"""Every command's ``--help`` formats: argparse expands ``%`` in help texts, and the flags are
generated from ``RunConfig``'s fields, so one help text with a bare ``%`` broke ``check --help``."""

from __future__ import annotations

import argparse

from labkit.cli import build_parser


def test_every_command_prints_its_help():
    parser = build_parser()
    parser.format_help()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(sub.choices) >= 5
    for name, command in sub.choices.items():
        text = command.format_help()
        assert name in text, name
