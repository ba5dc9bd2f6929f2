"""``make docs`` builds the course as a site; here on one notebook (all of them take long,
more than the test budget allows): the page is executed, its charts embedded and interactive,
the front page carries the README's overview and a table of contents."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOK = "01_data_parallel"


def test_docs_build_executes_a_notebook_into_a_page_with_its_charts(tmp_path):
    out = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "build.py"), "--only", NOTEBOOK, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    index = (out / "index.html").read_text()
    assert f'href="{NOTEBOOK}.html"' in index and "See distributed PyTorch training run" in index
    page = (out / f"{NOTEBOOK}.html").read_text()
    assert 'href="index.html"' in page  # the way back to the contents
    # every figure the notebook draws is a live plotly chart in the page (plotly.js included)
    nb = json.loads((ROOT / "notebooks" / f"{NOTEBOOK}.ipynb").read_text())
    assert not any(c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
    charts = page.count("Plotly.newPlot(")
    assert charts >= 3, charts
    assert "Traceback" not in page
