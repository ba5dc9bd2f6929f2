"""The notebooks read as a course: no development log in a lesson, at least two moments where
the learner records a prediction before the cell that measures it, sections numbered in order,
and no saved outputs (every figure a learner sees comes from their own run)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
LESSONS = [p for p in NOTEBOOKS if not p.name.startswith("00_")]  # 00 is the machine's check-up
# words of a project's history, not of the subject: an issue, CI, a test run, a work list
DEVELOPMENT_LOG = re.compile(
    r"\bissues? #?\d|\bthe issue\b|\bCI\b|fresh clone|\bnbval\b|\bpytest\b|\bflaky\b|TODO|FIXME"
)
SECTION = re.compile(r"^## (\d+)[.·\s]", re.M)
GUESS = re.compile(r"^(my_guess\w*)\s*=(?!\s*guesses\.ask)", re.M)  # the guess, not its reading
ASK = re.compile(r'^(my_guess\w*) = guesses\.ask\("([^"]+)", \1, fill=', re.M)


def cells(path: pathlib.Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def text(cell: dict) -> str:
    return "".join(cell["source"])


def test_notebooks_are_numbered_once_each_from_00():
    numbers = [p.name[:2] for p in NOTEBOOKS]
    assert numbers[0] == "00" and all(n.isdigit() for n in numbers), numbers
    assert len(set(numbers)) == len(numbers), numbers


# one sitting (COURSE.md, habit 2): about 30 cells and 1,500 words of prose; the "about" is
# this much, and no more
MOST_CELLS, MOST_WORDS = 31, 1650


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_is_one_sitting(path):
    nb = cells(path)
    words = sum(len(text(c).split()) for c in nb if c["cell_type"] == "markdown")
    assert len(nb) <= MOST_CELLS and words <= MOST_WORDS, f"{len(nb)} cells, {words} prose words"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_each_lesson_ends_with_a_summary_and_exercises(path):
    headings = [text(c).splitlines()[0] for c in cells(path) if c["cell_type"] == "markdown"]
    assert "## Summary" in headings and headings[-1] == "## Exercises", headings[-3:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_development_log_in_a_lesson(path):
    nb = cells(path)
    found = [(i, m.group(0)) for i, c in enumerate(nb) for m in DEVELOPMENT_LOG.finditer(text(c))]
    assert not found, found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_sections_are_numbered_in_order(path):
    numbers = [int(n) for c in cells(path) if c["cell_type"] == "markdown"
               for n in SECTION.findall(text(c))]  # fmt: skip
    assert numbers == list(range(1, len(numbers) + 1)), numbers


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_are_saved_without_outputs(path):
    assert not [i for i, c in enumerate(cells(path)) if c.get("outputs")]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_each_lesson_asks_for_two_predictions_before_measuring(path):
    nb = cells(path)
    asked = [i for i, c in enumerate(nb) if re.search(r"\*\*Predict( first)?:\*\*", text(c))]
    assert len(asked) >= 2, f"{path.name}: predict-first moments at cells {asked}"
    for i, c in enumerate(nb):
        for name in GUESS.findall(text(c)) if c["cell_type"] == "code" else []:
            # the guess has a cell of its own, and a later cell (the measurement's) compares it
            assert text(c).strip().startswith(name), (path.name, i, "the guess shares its cell")
            later = [j for j in range(i + 1, len(nb)) if re.search(rf"\b{name}\b", text(nb[j]))]
            assert later, (path.name, name, "recorded, never compared")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_guesses_start_empty_are_read_once_measured_and_shown_in_the_summary(path):
    """No guess is pre-filled: the learner writes it (``None`` until then, and ``guesses.ask``
    refuses None unless LABKIT_FILL_GUESSES says nobody is there); every guess is asked for,
    its measurement recorded under the same name, and the summary shows the table."""
    nb = cells(path)
    code = [text(c) for c in nb if c["cell_type"] == "code"]
    guessed = [GUESS.findall(c) for c in code]
    made = [name for names in guessed for name in names]
    prefilled = [c.strip() for c, names in zip(code, guessed) if names and not
                 re.fullmatch(r"my_guess\w* = None(\s+#.*)?", c.strip())]  # fmt: skip
    assert not prefilled, prefilled
    asked = [m for c in code for m in ASK.findall(c)]
    assert sorted(name for name, _ in asked) == sorted(made), (made, asked)
    for _, label in asked:
        assert sum(f'guesses.measured("{label}", ' in c for c in code) == 1, label
    summary = next(i for i, c in enumerate(nb) if text(c).startswith("## Summary"))
    assert text(nb[summary + 1]).startswith("guesses.table()"), "the summary shows the guesses"
