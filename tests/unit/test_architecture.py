"""The package's shape: imports flow one way, the CLI is generated from RunConfig, and one
registry names every strategy. (The layers themselves are import-linter's contract in
pyproject.toml, run by ``make lint``.)

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_architecture.py."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import pathlib
import sys

import pytest

from labkit import registry
from labkit.cli import build_parser
from labkit.config import RunConfig
from labkit.flags import SWEPT, flag, to_argv
from labkit.worker import build_parser as worker_parser

ROOT = pathlib.Path(__file__).resolve().parents[2] / "labkit"


@functools.cache
def _imports() -> dict[str, tuple[pathlib.Path, tuple[ast.stmt, ...]]]:
    """Module -> its file and every import statement in it (inside functions and under
    TYPE_CHECKING too), parsed once per test process: the tests below read the same sources."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(path.read_text())
        out[name] = (
            path,
            tuple(n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))),
        )
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the labkit modules it imports, every import statement counted (inside
    functions and under TYPE_CHECKING too): read from the source, not from sys.modules."""
    modules = {name: path for name, (path, _) in _imports().items()}
    graph = {}
    for name, (path, nodes) in _imports().items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                # ``from . import x``: module x; ``from .x import f``: module x
                targets = [
                    f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                    for a in node.names
                ]
            else:
                targets = [a.name for a in node.names]
            for t in targets:
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                # the root package runs before any submodule anyway: not an edge
                if t in modules and t not in (name, "labkit"):
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_cycle_check_finds_a_cycle_made_inside_a_function():
    graph = {"labkit.a": {"labkit.b"}, "labkit.b": {"labkit.c"}, "labkit.c": {"labkit.a"}}
    assert cycles(graph) == [["labkit.a", "labkit.b", "labkit.c"]]
    real = import_graph()
    assert "labkit.experiment" in real["labkit.labs.equivalence"]  # a module-level import, read
    assert "labkit.rank.resume" in real["labkit.worker"]


def test_every_relative_import_names_a_module_that_exists():
    """Imports inside functions run only when called: a moved module's broken one would wait
    for the one test (or user) that calls it."""
    modules = _imports()
    broken = []
    for name, (path, nodes) in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if target not in modules:
                    broken.append(f"{name}:{node.lineno} imports {target}")
    assert broken == []


def test_no_import_cycle_counting_every_import():
    assert cycles(import_graph()) == []


def test_only_the_entry_points_import_the_command_line():
    graph = import_graph()
    for name, deps in graph.items():
        assert "labkit.__main__" not in deps, name
        if not name.startswith(("labkit.cli", "labkit.__main__", "labkit.worker")):
            assert not any(d.startswith("labkit.cli") for d in deps), f"{name} imports the CLI"


def _help_flags(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command", ["compare", "check", "demo", "memory"])
def test_every_runconfig_field_is_a_flag_of_the_commands_that_run_strategies(command):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    flags = _help_flags(sub)
    for f in dataclasses.fields(RunConfig):
        if command == "demo" and f.name == "world_size":  # the demo picks world sizes itself
            continue
        assert flag(f.name) in flags or SWEPT.get(f.name) in flags, (command, f.name)


def test_every_runconfig_field_is_a_flag_of_the_torchrun_worker():
    flags = _help_flags(worker_parser())
    missing = [f.name for f in dataclasses.fields(RunConfig) if flag(f.name) not in flags]
    assert missing == []


def test_flags_round_trip_a_config():
    cfg = RunConfig(
        strategy="ddp_naive",
        world_size=2,
        slowdown="1:2@3",
        rebalance="dynamic",
        activation_checkpointing=True,
        threads=1,
        in_features=12,
        sync_batchnorm=True,
    )
    args = worker_parser().parse_args(["--strategy", "ddp_naive", *to_argv(cfg)])
    from labkit.flags import config_from_args

    assert config_from_args(args, world_size=2) == cfg


def test_one_registry_names_every_strategy_and_its_module():
    names = set(registry.STRATEGIES)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    for name, s in registry.STRATEGIES.items():
        module = importlib.import_module(f"labkit.strategies.{s.module}")
        assert callable(module.run), name
        assert s.knobs <= fields, (name, s.knobs - fields)
        assert (s.schedule is not None) == (name in registry.STAGED), name
        assert s.kind != "pipeline" or s.schedule is not None, name
    choices = next(f for f in dataclasses.fields(RunConfig) if f.name == "strategy")
    assert set(choices.metadata["choices"]) == names
    assert len({s.colour for s in registry.STRATEGIES.values()}) == len(names)
