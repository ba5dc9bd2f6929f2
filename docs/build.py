"""The course as a static site: every notebook executed and rendered to HTML, in order.

    python docs/build.py [--out site] [--only 01_data_parallel,...]

Each notebook runs top to bottom in a fresh kernel (nbconvert's ExecutePreprocessor, the same
execution nbval does), with plotly's ``notebook`` renderer, so every chart is embedded with
plotly.js and stays interactive offline; widget state is saved with the outputs (a panel shows
its last state where the page can load Jupyter's widget manager). The front page is the
README's overview with a table of contents in notebook order; each page links back to it and
to the chapters before and after. ``notebooks/README.md`` (the course map, glossary, notation,
formulas and references) becomes the page ``course.html``, linked from the front page.
``make docs`` runs it.
"""

from __future__ import annotations

import argparse
import html
import os
import pathlib
import re
import sys
import time

import mistune
import nbformat
from nbconvert import HTMLExporter
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
LANDING = NOTEBOOKS / "README.md"  # the course map, glossary, notation, formulas, references
LANDING_PAGE = "course.html"
STYLE = (
    "<style>nav.labkit{font:14px sans-serif;padding:8px 16px;background:#f4f4f4;"
    "border-bottom:1px solid #ddd}nav.labkit a{margin-right:16px}</style>"
)
PAGE_STYLE = (
    "<style>body{font:16px/1.5 sans-serif;max-width:900px;margin:2em auto;padding:0 1em}"
    "pre{background:#f6f6f6;padding:8px;overflow-x:auto}table{border-collapse:collapse}"
    "th,td{border:1px solid #ddd;padding:4px 8px;vertical-align:top}</style>"
)


def title(nb) -> str:
    """A notebook's first heading, without its '#'."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("#"):
            return cell.source.lstrip().splitlines()[0].lstrip("#").strip()
    return "untitled"


def render(path: pathlib.Path, timeout_s: int = 600) -> tuple[str, str]:
    """(title, HTML) of one notebook, executed in the notebooks folder."""
    nb = nbformat.read(path, as_version=4)
    os.environ["PLOTLY_RENDERER"] = "notebook"  # plotly.js inside the page: works offline
    os.environ["LABKIT_FILL_GUESSES"] = "1"  # a page has no learner: guesses filled in, and said
    ExecutePreprocessor(timeout=timeout_s, kernel_name="python3").preprocess(
        nb, {"metadata": {"path": str(path.parent)}}
    )
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    return title(nb), body


def nav(pages: list[tuple[str, str]], at: int) -> str:
    links = ['<a href="index.html">labkit: contents</a>']
    if at > 0:
        links.append(f'<a href="{pages[at - 1][0]}">&larr; {html.escape(pages[at - 1][1])}</a>')
    if at + 1 < len(pages):
        links.append(f'<a href="{pages[at + 1][0]}">{html.escape(pages[at + 1][1])} &rarr;</a>')
    return STYLE + '<nav class="labkit">' + "".join(links) + "</nav>"


def document(name: str, body: str) -> str:
    """A standalone page of the site (the front page, the course map)."""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(name)}</title>"
        f"{PAGE_STYLE}</head><body>{body}</body></html>"
    )


def front_page(pages: list[tuple[str, str]]) -> str:
    """The README up to its notebook index, then a table of contents of the built pages."""
    readme = (ROOT / "README.md").read_text()
    overview = readme.split("\n## Notebooks", 1)[0]
    toc = "".join(f'<li><a href="{href}">{html.escape(name)}</a></li>' for href, name in pages)
    course = (
        f'<p><a href="{LANDING_PAGE}">The course map, glossary, notation, formulas and '
        "references</a></p>"
    )
    return document("labkit", f"<h2>The course</h2><ol>{toc}</ol>{course}{mistune.html(overview)}")


def to_pages(body: str) -> str:
    """Links to notebooks (``02_x.ipynb``, ``00_x.ipynb#anchor``) pointed at their pages."""
    return re.sub(r'href="(\d\d_[\w-]+)\.ipynb(#[\w-]+)?"', r'href="\1.html\2"', body)


def landing_page() -> str:
    """``notebooks/README.md`` as a page: its links to notebooks point at their pages."""
    body = to_pages(mistune.html(LANDING.read_text()))
    back = '<p><a href="index.html">labkit: contents</a></p>'
    return document("labkit: the course at a glance", back + body)


def build(out: pathlib.Path, only: list[str] | None = None) -> list[pathlib.Path]:
    """Execute and render the notebooks (all, or the ``only`` names) into ``out``; return the
    pages written: the front page, the course map, then the notebooks."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if only:
        missing = set(only) - {p.stem for p in paths}
        if missing:
            raise SystemExit(f"no notebook named {', '.join(sorted(missing))} in {NOTEBOOKS}")
        paths = [p for p in paths if p.stem in only]
    out.mkdir(parents=True, exist_ok=True)
    rendered = []
    for path in paths:
        t0 = time.perf_counter()
        name, body = render(path)
        rendered.append((f"{path.stem}.html", name, to_pages(body)))
        print(f"{path.name}: executed and rendered in {time.perf_counter() - t0:.0f} s", flush=True)
    pages = [(href, name) for href, name, _ in rendered]
    written = [out / "index.html", out / LANDING_PAGE]
    written[0].write_text(front_page(pages))
    written[1].write_text(landing_page())
    for i, (href, _, body) in enumerate(rendered):
        at = body.find(">", body.find("<body")) + 1  # right after the opening body tag
        (out / href).write_text(body[:at] + nav(pages, i) + body[at:])
        written.append(out / href)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "site"), help="folder for the site")
    p.add_argument("--only", help="comma-separated notebook names (default: all)")
    args = p.parse_args(argv)
    only = [n.strip() for n in args.only.split(",")] if args.only else None
    written = build(pathlib.Path(args.out), only)
    print(f"site: {written[0]} (the course map and {len(written) - 2} notebook page(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
