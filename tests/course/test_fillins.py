"""The graded fill-ins as the lessons ship them: every exercise has its cell in the lesson that
teaches it, the blank is answered "not written yet", and with ``LABKIT_SOLUTIONS=1`` the same
cell passes (the shipped solution graded on real ranks in its place).

nbval runs the notebooks with the blanks left; running every notebook a second time with the
solutions would double that, so this runs only the fill-in cells, each with the imports its
notebook made before it, in a fresh namespace.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CHECK = re.compile(r"exercises\.check\(\s*\"(\w+)\"")


def _fillins() -> list[tuple[str, str, tuple[str, ...], str]]:
    """(notebook, exercise, the imports before the cell, the cell) for every graded fill-in."""
    found = []
    for path in NOTEBOOKS:
        imports = []
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = "".join(cell["source"])
            for name in CHECK.findall(source):
                found.append((path.name, name, tuple(imports), source))
            imports += _imports(source)
    return found


def _imports(source: str) -> list[str]:
    """The top-level import statements of a cell (a cell with IPython magics has none here)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    return [
        ast.get_source_segment(source, node)
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]


FILLINS = _fillins()


def _run(imports: tuple[str, ...], source: str):
    """The cell's last expression (the verdict), run after the notebook's imports."""
    tree = ast.parse(source)
    *body, last = tree.body
    assert isinstance(last, ast.Expr), "a fill-in cell ends with exercises.check(...)"
    namespace: dict = {}
    for statement in imports:
        try:
            exec(compile(statement, "<imports>", "exec"), namespace)
        except ImportError:  # a module the notebook wrote itself (01's spawn_ddp.py)
            pass
    exec(compile(ast.Module(body=body, type_ignores=[]), "<cell>", "exec"), namespace)
    return eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)


def test_every_exercise_has_its_fillin_in_the_lesson_that_teaches_it():
    from labkit.exercises._core import EXERCISES

    where = {}
    for notebook, name, _, _ in FILLINS:
        where.setdefault(name, []).append(notebook)
    assert sorted(where) == sorted(EXERCISES), (
        f"exercises without a fill-in cell: {sorted(set(EXERCISES) - set(where))}; "
        f"fill-ins of no exercise: {sorted(set(where) - set(EXERCISES))}"
    )
    for name, notebooks in where.items():
        assert len(notebooks) == 1, f"{name} is filled in by {notebooks}"
        assert notebooks[0].startswith(EXERCISES[name].lesson + "_"), (
            f"{name} is taught in {EXERCISES[name].lesson}, its cell is in {notebooks[0]}"
        )


def test_each_lessons_exercises_section_lists_its_graded_fillins():
    """Each notebook's exercises section names its graded fill-ins ("Graded, with ...")."""
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        names = {name for nb, name, _, _ in FILLINS if nb == path.name}
        if not names:
            continue
        graded = [
            "".join(c["source"])
            for c in cells
            if c["cell_type"] == "markdown" and "Graded, with" in "".join(c["source"])
        ]
        assert graded, f"{path.name} has fill-ins {sorted(names)} but no 'Graded, with' list"
        for name in names:
            assert any(f"`{name}`" in text for text in graded), (
                f"{path.name}'s exercises section does not list `{name}`"
            )


@pytest.mark.parametrize(
    "notebook, name, imports, source", FILLINS, ids=[f"{nb[:2]}-{n}" for nb, n, _, _ in FILLINS]
)
def test_the_blank_is_not_written_yet_and_the_solution_passes(
    notebook, name, imports, source, monkeypatch
):
    monkeypatch.delenv("LABKIT_SOLUTIONS", raising=False)
    blank = _run(imports, source)
    assert blank.passed is None, f"{notebook} {name}, as shipped: {blank}"
    monkeypatch.setenv("LABKIT_SOLUTIONS", "1")
    answered = _run(imports, source)
    assert answered.graded == "solution" and answered.passed, f"{notebook} {name}: {answered}"
