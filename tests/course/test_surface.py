"""What a learner follows exists: every module (``labkit.x.y``), function or attribute
(``labkit.x.f``, ``from labkit.x import f``) and file (``labkit/x/y.py``) that a notebook's code or
prose or the README names resolves; and the notebooks import only from the public places
ARCHITECTURE.md lists."""

from __future__ import annotations

import importlib
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# the places a notebook imports from (ARCHITECTURE.md, "What the notebooks import")
PLACES = (
    "labkit",
    "labkit.experiment",
    "labkit.labs",
    "labkit.plots",
    "labkit.widgets",
    "labkit.records",
    "labkit.report",
    "labkit.trace",
    "labkit.predict",
    "labkit.models",
    "labkit.data",
    "labkit.strategies",
    "labkit.rank",
    "labkit.launch",
    "labkit.env",
    "labkit.pipeline_schedules",
)

DOTTED = re.compile(r"(?<![\w./-])labkit(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./-])(?:labkit|benchmarks|tests|docs)/[\w/.-]*\w")
FROM_IMPORT = re.compile(r"^\s*from (labkit[\w.]*) import \(?([\w, \n]+?)\)?\s*(?:#.*)?$", re.M)
IMPORT = re.compile(r"^\s*import (labkit[\w.]*)", re.M)


def documents() -> dict[str, list[tuple[str, str, bool]]]:
    """Per document, (where, text, is_code): the README, and every cell of every notebook."""
    out = {"README.md": [("README.md", (ROOT / "README.md").read_text(), False)]}
    for path in NOTEBOOKS:
        out[path.name] = [
            (f"cell {i}", "".join(cell["source"]), cell["cell_type"] == "code")
            for i, cell in enumerate(json.loads(path.read_text())["cells"])
        ]
    return out


def names(text: str) -> set[str]:
    """Every labkit name the text mentions, as dotted paths (imports expanded) or file paths."""
    found = set(DOTTED.findall(text))
    for module, imported in FROM_IMPORT.findall(text):
        for name in imported.replace("\n", " ").split(","):
            name = name.split(" as ")[0].strip()
            if name:
                found.add(f"{module}.{name}")
    found |= set(IMPORT.findall(text))
    found |= set(PATH.findall(text))
    return found


def resolves(name: str) -> bool:
    """A file path exists; a dotted path imports, module by module, then attribute by
    attribute (``labkit.launch.free_port``: the module, though ``labkit.launch`` is a function)."""
    if "/" in name:
        return (ROOT / name).exists()
    parts = name.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=2):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            continue
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def unresolved(text: str) -> list[str]:
    return sorted(n for n in names(text) if not resolves(n))


def test_the_check_finds_a_planted_bad_name():
    text = (
        "see `labkit/strategies/common.py` and `labkit.checkpoint`\n"
        "from labkit.labs.memory import memory_table, no_such_table\n"
        "labkit.labs.sched.POLICIES; labkit.launch.free_port; labkit.launch.nope\n"
    )
    assert unresolved(text) == [
        "labkit.checkpoint",
        "labkit.labs.memory.no_such_table",
        "labkit.launch.nope",
        "labkit/strategies/common.py",
    ]


@pytest.mark.parametrize("document", list(documents()))
def test_every_name_a_learner_follows_exists(document):
    parts = documents()[document]
    assert sum(len(names(text)) for _, text, _ in parts) > 0  # the patterns still match
    missing = [f"{where}: {name}" for where, text, _ in parts for name in unresolved(text)]
    assert missing == []


def public(module: str) -> bool:
    return module == "labkit" or any(module == p or module.startswith(p + ".") for p in PLACES[1:])


def test_notebooks_import_only_from_the_public_places():
    architecture = (ROOT / "ARCHITECTURE.md").read_text()
    unlisted = [p for p in PLACES if f"`{p}`" not in architecture]
    assert unlisted == [], "ARCHITECTURE.md lists the places notebooks import from"
    stray = []
    for document, parts in documents().items():
        for where, text, is_code in parts:
            if not is_code:
                continue
            for module in [m for m, _ in FROM_IMPORT.findall(text)] + IMPORT.findall(text):
                if not public(module):
                    stray.append(f"{document} {where}: {module}")
    assert stray == []
