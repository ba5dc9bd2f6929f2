"""``RunConfig`` as command-line flags, generated from its fields: one list, in ``config.py``.

Each field becomes ``--the-field-name`` with the field's type, default, allowed values and help;
booleans get ``--flag/--no-flag``. ``python -m labkit compare``/``check``/``demo``/``memory``,
the torchrun worker (``labkit.worker``) and the elastic agents it starts all read their flags
from here, so a new ``RunConfig`` field is a new flag everywhere, with nothing else to write.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing

from .config import RunConfig
from .shares import format_slowdown

# commands that run several configurations take lists for these two (``--strategies ddp,fsdp``)
SWEPT = {"strategy": "--strategies", "world_size": "--world-sizes"}


def flag(name: str) -> str:
    """The flag of RunConfig field ``name``: ``global_batch`` -> ``--global-batch``."""
    return "--" + name.replace("_", "-")


@functools.cache
def _hints() -> dict:
    """RunConfig's annotations, evaluated once (each evaluation reads every field's: 2 ms, and a
    command's parser asks for each field of each subcommand)."""
    return typing.get_type_hints(RunConfig)


def _kind(f: dataclasses.Field) -> type:
    """A field's value type, ``int | None`` read as int (None is its default)."""
    hint = _hints()[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_config_arguments(
    parser: argparse.ArgumentParser, *, sweep: tuple[str, ...] = (), skip: tuple[str, ...] = ()
) -> None:
    """Every RunConfig field as a flag of ``parser``. ``sweep``: fields that take a
    comma-separated list instead (``strategy`` as ``--strategies``, ``world_size`` as
    ``--world-sizes``); ``skip``: fields the command sets itself."""
    group = parser.add_argument_group("run config (every labkit.RunConfig field)")
    for f in dataclasses.fields(RunConfig):
        if f.name in skip:
            continue
        kind, help_text = _kind(f), f.metadata["help"]
        choices = f.metadata["choices"]
        if f.name in sweep:
            default = ",".join(choices[:3]) if f.name == "strategy" else "1,2"
            group.add_argument(
                SWEPT[f.name],
                default=default,
                help=f"comma-separated: {help_text} (default: %(default)s)",
            )
        elif kind is bool:
            group.add_argument(
                flag(f.name),
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=help_text,
            )
        elif kind is tuple:  # slowdown: RunConfig parses the text
            group.add_argument(flag(f.name), default="", help=help_text)
        else:
            # choices are checked by RunConfig, whose error names the flag in one line
            one_of = f"one of {', '.join(choices)}; " if choices else ""
            group.add_argument(
                flag(f.name),
                type=kind,
                default=f.default,
                metavar=kind.__name__.upper(),
                help=f"{help_text} ({one_of}default: %(default)s)",
            )


def config_from_args(args: argparse.Namespace, **override) -> RunConfig:
    """The RunConfig the parsed flags describe (``override`` wins); a bad value raises a
    ValueError that starts with the flag to change."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(RunConfig)
        if hasattr(args, f.name)
    }
    values.update(override)
    try:
        return RunConfig(**values)
    except ValueError as exc:
        text = str(exc)
        named = [
            f.name
            for f in dataclasses.fields(RunConfig)
            if text.startswith((f.name, f"unknown {f.name} "))
        ]
        if not named:
            raise
        raise ValueError(f"{flag(max(named, key=len))}: {text}") from None


def to_argv(cfg: RunConfig, skip: tuple[str, ...] = ("strategy", "world_size")) -> list[str]:
    """The flags that rebuild ``cfg`` (those that differ from the defaults): how the elastic
    agents hand a notebook's config to ``labkit.worker``."""
    argv = []
    for f in dataclasses.fields(RunConfig):
        value = getattr(cfg, f.name)
        if f.name in skip or value == f.default:
            continue
        if _kind(f) is bool:
            argv.append(flag(f.name) if value else "--no-" + flag(f.name)[2:])
        elif f.name == "slowdown":
            argv += [flag(f.name), format_slowdown(value)]
        else:
            argv += [flag(f.name), str(value)]
    return argv
