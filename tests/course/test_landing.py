"""notebooks/README.md, the learners' landing page, stays true to the notebooks.

The course map lists every notebook in order, under its own title, with earlier prerequisites
that the diagram draws too, and minutes that the notebook's size supports. Every glossary term
first appears in the notebook the page names, and in none before it. The notation and formula
tables are well formed and name labkit code that exists; every notebook has references; every
link is a file here or an https address; the README links the page; the site renders it.
Reads files only: no process, no network.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import pathlib
import re

import pytest

from tests.course.test_surface import unresolved

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PAGE = ROOT / "notebooks" / "README.md"
SECTIONS = ("Course map", "Glossary", "Notation", "Formula sheet", "References")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
NOTEBOOK_NUMBER = re.compile(r"(?<![\w.§])(\d\d)\b")  # "05 §3" cites 05, not 3
# the phrase a notebook uses where the glossary's term is not written as such
ALIASES = {
    "Amdahl's law": "Amdahl",
    "checkpoint": "checkpoint_dir",  # "checkpoint" alone first means activation checkpointing
    "elastic training": "elastic",
    "exposed communication": "exposed",
    "f and g": "`f` and `g`",
    "interleaved schedule": "interleaved pipeline",
    "Join": "`Join`",  # not the English verb
    "loss scaling": "loss scaler",
    "Nesterov momentum": "Nesterov",
    "oversubscription": "oversubscribed",
    "pipeline parallelism": "pipeline",
    "Poisson arrivals": "Poisson",
    "ZeRO": "ZeRO-1",  # not the English "zero"
}
# terms the course uses that a learner must find here
REQUIRED = """all-reduce, all-gather, reduce-scatter, broadcast, all-to-all, ring all-reduce,
bucket, exposed communication, overlap, DDP, DataParallel, ZeRO, FSDP, HSDP, tensor parallelism,
sequence parallelism, f and g, DTensor, DeviceMesh, pipeline parallelism, micro-batch, bubble,
GPipe, 1F1B, gradient accumulation, mixed precision, bf16, fp16, loss scaling, TF32,
activation checkpointing, SyncBatchNorm, straggler, load balancing, Join, local SGD, DiLoCo,
Nesterov momentum, parameter server, staleness, Hogwild, PowerSGD, gloo, NCCL, c10d, torchrun,
torchelastic, rendezvous, elastic training, checkpoint, JCT, goodput, makespan, FIFO, SRTF,
Tiresias, Gavel, Pollux, max-min fairness, oversubscription, CPU share, world size, rank,
local rank, process group, backend, Amdahl's law, spread factor, bcube"""
# the symbols the course fixes (COURSE.md, habit 5)
FIXED_SYMBOLS = ("N", "P", "M", "t", "d", "B", "b", "H", "φ")


@functools.cache
def page() -> str:
    return PAGE.read_text()


def section(name: str) -> str:
    """The text under ``## name``, up to the next ``## `` heading."""
    text = page().split(f"\n## {name}\n", 1)[1]
    return text.split("\n## ", 1)[0]


def table(text: str) -> list[list[str]]:
    """The rows of the first markdown table in ``text``, header and rule left out."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines[2:]]


@functools.cache
def cells(path: pathlib.Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def normalise(text: str) -> str:
    return re.sub(r"[-_]", " ", text.lower())


@functools.cache
def notebook_texts() -> dict[str, str]:
    """Number ("03") to the notebook's whole text (prose and code), lower case, '-' and '_' as
    spaces (so "all-reduce" finds ``all_reduce``)."""
    return {p.name[:2]: normalise("\n".join(map(source, cells(p)))) for p in NOTEBOOKS}


def used_in(key: str) -> list[str]:
    """The notebooks (numbers, in order) that use ``key`` as a word (a plural too)."""
    word = re.compile(rf"(?<![a-z0-9]){re.escape(normalise(key))}(?:s|es)?(?![a-z0-9])")
    return [n for n, text in notebook_texts().items() if word.search(text)]


def glossary() -> list[tuple[str, str, str]]:
    """(term, meaning, first-use cell) per row; the term without its bold and parenthesis."""
    rows = []
    for term, meaning, first in table(section("Glossary")):
        assert term.startswith("**") and term.endswith("**"), term
        rows.append((term.strip("*").split(" (")[0], meaning, first))
    return rows


def first_use_error(term: str, first: str) -> str | None:
    """Why the cell ``first`` ("[03](03_x.ipynb)" or "—") is not where ``term`` first appears."""
    found = used_in(ALIASES.get(term, term))
    if first == "—":
        return f"{term!r} is used in {found}, the page says in none" if found else None
    named = re.fullmatch(r"\[(\d\d)\]\((\d\d)_\w+\.ipynb\)", first)
    if not named or named[1] != named[2]:
        return f"{term!r}: the first-use cell {first!r} is not a link to one notebook"
    if named[1] not in found:
        return f"{term!r} does not appear in notebook {named[1]} (it does in {found})"
    if found[0] != named[1]:
        return f"{term!r} appears in notebook {found[0]}, before {named[1]}"
    return None


def estimated_minutes(path: pathlib.Path) -> float:
    """The page's rule: prose words at 150 a minute, non-blank code lines at 15 a minute, a
    minute per prediction, and the run time (a cell's "takes about N s", else 3 s a cell)."""
    stated = re.compile(r"#\s*takes (?:about )?(\d+)(?:-(\d+))? s\b")
    nb = cells(path)
    words = sum(len(source(c).split()) for c in nb if c["cell_type"] == "markdown")
    code = [source(c) for c in nb if c["cell_type"] == "code"]
    lines = sum(1 for s in code for line in s.splitlines() if line.strip())
    guesses = sum(1 for s in code if re.match(r"my_guess\w*\s*=", s.strip()))
    run_s = 0
    for s in code:
        m = stated.search(s)
        run_s += int(m[2] or m[1]) if m else 3
    return words / 150 + lines / 15 + guesses + run_s / 60


def title(path: pathlib.Path) -> str:
    return source(cells(path)[0]).splitlines()[0].lstrip("#").strip()


# ---- the course map ---------------------------------------------------------------------------


def test_the_sections_come_in_order():
    headings = re.findall(r"^## (.+)$", page(), re.M)
    assert tuple(headings) == SECTIONS, headings


def test_the_map_lists_every_notebook_in_order_under_its_title():
    rows = table(section("Course map"))
    links = [LINK.fullmatch(row[0]) for row in rows]
    assert all(links), [row[0] for row in rows]
    assert [m[2] for m in links] == [p.name for p in NOTEBOOKS]
    assert [m[1] for m in links] == [title(p) for p in NOTEBOOKS]
    assert all(len(row) == 4 and row[1] for row in rows), rows


def prerequisites() -> dict[str, set[str]]:
    out = {}
    for row in table(section("Course map")):
        number = LINK.fullmatch(row[0])[2][:2]
        out[number] = {m[2][:2] for m in LINK.finditer(row[2])}
        assert out[number] or row[2] == "—", row
    return out


def test_each_notebook_builds_on_earlier_ones_and_the_diagram_draws_the_same():
    needs = prerequisites()
    later = {n: sorted(p for p in before if p >= n) for n, before in needs.items()}
    assert not any(later.values()), later
    assert all(needs[n] for n in needs if n != "00"), "every lesson after 00 builds on one"
    edges = set(re.findall(r"\bn(\d\d)\b[^\n]*?-->\s*n(\d\d)\b", section("Course map")))
    assert edges == {(p, n) for n, before in needs.items() for p in before}, edges


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_minutes_follow_the_rule_the_page_states(path):
    row = next(r for r in table(section("Course map")) if path.name in r[0])
    minutes, estimate = int(row[3]), estimated_minutes(path)
    assert minutes % 5 == 0 and abs(minutes - estimate) <= 5, (minutes, round(estimate, 1))


# ---- the glossary -----------------------------------------------------------------------------


def test_the_glossary_is_alphabetical_and_covers_the_course_vocabulary():
    terms = [term for term, _, _ in glossary()]
    assert terms == sorted(terms, key=str.casefold)
    assert len(set(terms)) == len(terms)
    missing = {t.strip() for t in REQUIRED.split(",")} - set(terms)
    assert not missing, missing
    assert set(ALIASES) <= set(terms), set(ALIASES) - set(terms)


@pytest.mark.parametrize("row", glossary(), ids=lambda row: row[0])
def test_each_term_first_appears_where_the_glossary_says(row):
    term, meaning, first = row
    assert 5 <= len(meaning.split()) <= 60, meaning
    assert first_use_error(term, first) is None, first_use_error(term, first)


def test_the_first_use_check_finds_a_planted_error():
    assert first_use_error("bubble", "[03](03_model_parallel.ipynb)") is None
    assert "before 06" in first_use_error("all-reduce", "[06](06_communication.ipynb)")
    assert "does not appear" in first_use_error("GPipe", "[01](01_data_parallel.ipynb)")
    assert "in none" in first_use_error("bubble", "—")
    assert first_use_error("no such term anywhere", "—") is None


# ---- notation, formulas, references, links ----------------------------------------------------


def test_the_notation_table_is_one_symbol_per_row_and_fixes_the_course_symbols():
    rows = table(section("Notation"))
    assert all(len(row) == 4 for row in rows), [row for row in rows if len(row) != 4]
    symbols = []
    for symbol, meaning, _labkit, _other in rows:
        names = re.findall(r"`([^`]+)`", symbol)
        assert names and symbol == ", ".join(f"`{n}`" for n in names), symbol
        assert meaning, symbol
        symbols += names
    assert len(symbols) == len(set(symbols)), sorted(s for s in symbols if symbols.count(s) > 1)
    assert set(FIXED_SYMBOLS) <= set(symbols), set(FIXED_SYMBOLS) - set(symbols)


def cited_notebooks(text: str) -> set[str]:
    return set(NOTEBOOK_NUMBER.findall(text))


def test_every_formula_row_is_complete_and_cites_real_notebooks():
    rows = table(section("Formula sheet"))
    numbers = {p.name[:2] for p in NOTEBOOKS}
    assert len(rows) >= 20
    for quantity, formula, notebook, _labkit in rows:
        assert quantity and "`" in formula, (quantity, formula)
        assert cited_notebooks(notebook) and cited_notebooks(notebook) <= numbers, notebook
    other = " ".join(row[3] for row in table(section("Notation")))
    assert cited_notebooks(other) <= numbers


def test_every_labkit_name_on_the_page_exists():
    assert unresolved(page()) == []


def test_every_notebook_has_references():
    parts = re.split(r"^### ", section("References"), flags=re.M)[1:]
    headed = {part.splitlines()[0]: part for part in parts}
    assert list(headed) == [title(p) for p in NOTEBOOKS]
    for name, part in headed.items():
        entries = [ln for ln in part.splitlines() if ln.startswith("- ")]
        assert entries, name
        assert len(LINK.findall(part)) >= len(entries), name  # each entry carries its link


def link_errors(text: str, base: pathlib.Path) -> list[str]:
    """Links that are neither an https address nor a relative path that exists under ``base``."""
    bad = []
    for _, target in LINK.findall(text):
        if target.startswith("https://"):
            continue
        path = target.split("#", 1)[0]
        if not path or "://" in target or path.startswith("/") or not (base / path).exists():
            bad.append(target)
    return bad


def test_every_link_is_https_or_a_file_next_to_the_page():
    assert len(LINK.findall(page())) > 100
    assert link_errors(page(), PAGE.parent) == []
    planted = "[a](00_environment.ipynb) [b](http://x.org) [c](../nope.md) [d](/etc) [e](#top)"
    assert link_errors(planted, PAGE.parent) == ["http://x.org", "../nope.md", "/etc", "#top"]


def test_the_readme_links_the_page():
    assert "](notebooks/README.md)" in (ROOT / "README.md").read_text()


def test_the_site_renders_the_page_with_links_to_the_notebook_pages():
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    html = build.landing_page()
    assert html.count("<table>") == 4 and "<h2>Glossary</h2>" in html
    local = [
        h.split("#")[0] for h in re.findall(r'href="([^"]+)"', html) if not h.startswith("https://")
    ]
    assert "index.html" in local and not [h for h in local if h.endswith(".ipynb")]
    pages = {f"{p.stem}.html" for p in NOTEBOOKS}
    assert set(local) - {"index.html"} == pages, set(local) ^ pages
    assert f'href="{build.LANDING_PAGE}"' in build.front_page([])
