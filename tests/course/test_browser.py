"""The notebooks as a person uses them: JupyterLab in a real browser (headless Chromium driven by
Playwright), Run All, then change a control, click Run, watch, Stop, Interrupt.

nbval runs every cell, but it never clicks: a panel's Run button runs in a background thread,
where what draws and what does not differs from a cell (see labkit/widgets/base.py). Screenshots
land in out/ (browser-*.png) so a failure can be looked at.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "out"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# set by `make test-browser` where it can install Chromium (root, apt-get): there a missing
# browser fails the run instead of skipping it, so CI cannot pass without the browser test
REQUIRED = os.environ.get("LABKIT_REQUIRE_BROWSER") == "1"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None and not REQUIRED,
        reason="no Chromium: install it with `apt-get install "
        "-y chromium` (make test-browser does, as root on Debian)",
    ),
]
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on loopback over a copy of the notebooks, with this interpreter's kernel."""
    root = tmp_path_factory.mktemp("lab")
    for nb in sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb")):  # every notebook
        shutil.copy(nb, root / nb.name)
    home = tmp_path_factory.mktemp("jupyter")  # no user settings, kernels or news pop-ups
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "run"),
        "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
        "LABKIT_FILL_GUESSES": "1",  # Run All without a learner: the lessons' guesses filled in
    }
    # render every cell (JupyterLab 4 otherwise draws only those in view) and ask about no news
    settings = home / "settings"
    for plugin, value in (
        ("notebook-extension/tracker", '{"windowingMode": "none"}'),
        ("apputils-extension/notification", '{"fetchNews": "false"}'),
    ):
        path = settings / "@jupyterlab" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--ServerApp.token={token}",
            f"--ServerApp.root_dir={root}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(port, 60)
        yield {"url": f"http://127.0.0.1:{port}", "token": token, "server": server}
    finally:
        server.terminate()
        try:
            server.wait(15)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:  # only when REQUIRED: the skip above covers the rest
        pytest.fail(
            "LABKIT_REQUIRE_BROWSER=1 (make test-browser as root, where it installs Chromium) "
            "but no Chromium was found: `apt-get install -y chromium`, then run again"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(autouse=True)
def one_kernel_at_a_time(lab):
    """Shut down every kernel after each test: the next notebook gets the cores and memory
    (a kernel and its forkserver hold torch twice, ~1 GB)."""
    yield
    import json
    import urllib.request

    api = f"{lab['url']}/api/kernels?token={lab['token']}"
    try:
        kernels = json.load(urllib.request.urlopen(api, timeout=10))
        for k in kernels:
            req = urllib.request.Request(
                f"{lab['url']}/api/kernels/{k['id']}?token={lab['token']}", method="DELETE"
            )
            urllib.request.urlopen(req, timeout=30)
    except OSError as exc:  # the next test still runs; say why it may be slower
        print(f"could not shut down kernels: {exc}")


def _wait_for_port(port: int, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"JupyterLab did not listen on port {port} within {timeout} s")


def open_and_run_all(
    browser,
    lab,
    name: str,
    timeout_s: float = 360,
    upto: str | None = None,
    only: tuple[str, ...] = (),
):
    """Open a notebook at 1280 px with the file browser open, run its cells (all of them, those
    up to the panel, or only those named), wait for the last one.

    nbval already runs every cell of every notebook; the browser test must fit its budget, so
    for most labs it runs what the panel needs and checks what only a browser shows: the panel,
    driven by a person. ``upto``: text in the panel's cell; run the cells up to and including
    it. ``only``: texts, one per cell; run just those cells, in order (selected one by one and
    run, as a person can), e.g. the set-up cell and the panel's.
    """
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    # a workspace of its own: only this notebook open, so selectors cannot match another one
    page.goto(f"{lab['url']}/lab/workspaces/{name[:2]}/tree/{name}?reset&token={lab['token']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
    try:  # "Select Kernel" on first open: keep python3
        page.click(".jp-Dialog button:has-text('Select')", timeout=5_000)
    except Exception:
        pass
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=60_000)
    cells = page.locator(".jp-CodeCell")
    if only:
        sources = page.locator(".jp-CodeCell .jp-InputArea-editor").all_inner_texts()
        for text in only:
            target = next(i for i, src in enumerate(sources) if text in src)
            cells.nth(target).locator(".jp-InputPrompt").click()  # select it (command mode)
            page.keyboard.press("Control+Enter")  # run it; the kernel queues the next one
    elif upto is None:
        run_menu(page, "Run All Cells")
        target = cells.count() - 1
    else:
        sources = page.locator(".jp-CodeCell .jp-InputArea-editor").all_inner_texts()
        target = next(i for i, src in enumerate(sources) if upto in src)
        cells.nth(target).locator(".jp-InputPrompt").click()  # select it (command mode)
        run_menu(page, "Run All Above Selected Cell")
        wait_idle(page, cells, timeout_s)
        run_menu(page, "Run Selected Cell")
    prompts = wait_idle(page, cells, timeout_s)
    errors = page.locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
    ).all_inner_texts()
    tracebacks = [e for e in errors if "Traceback" in e or re.search(r"^\w+Error\b", e, re.M)]
    if prompts is None:
        page.screenshot(path=str(OUT / f"browser-{name[:2]}-timeout.png"), full_page=True)
        prompts = cells.locator(".jp-InputPrompt").all_inner_texts()
        raise AssertionError(
            f"{name}: running did not finish within {timeout_s} s; prompts "
            f"{[p.strip() for p in prompts]}; errors {tracebacks[:1]}"
        )
    page.screenshot(path=str(OUT / f"browser-{name[:2]}-run-all.png"), full_page=True)
    last = max(i for i, p in enumerate(prompts) if re.search(r"\[\d+\]", p))
    assert not tracebacks, f"cell {last + 1} of {len(prompts)} raised:\n{tracebacks[0][-3000:]}"
    assert last == target, f"running stopped after cell {last + 1} of {target + 1}"
    if not only:  # (a panel's own charts appear after its Run: the caller checks those)
        assert page.locator(".jp-OutputArea .js-plotly-plot").count() > 0, "no chart rendered"
    return page


def run_menu(page, item: str) -> None:
    page.click(".lm-MenuBar-itemLabel:text-is('Run')")
    page.click(f".lm-Menu-itemLabel:text-is('{item}')")


def wait_idle(page, cells, timeout_s: float) -> list[str] | None:
    """Wait until something has run, nothing is queued and the kernel has been idle 3 s; the
    input prompts then (the caller checks that the cell it wanted ran: a cell that raised stops
    the queue and the cells after it keep an empty prompt), or None on the timeout."""
    deadline, idle_since = time.time() + timeout_s, None
    while time.time() < deadline:
        prompts = cells.locator(".jp-InputPrompt").all_inner_texts()
        idle = page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
        ran = [i for i, p in enumerate(prompts) if re.search(r"\[\d+\]", p)]
        done = idle and bool(ran) and not any("[*]" in p for p in prompts)
        idle_since = (idle_since or time.time()) if done else None
        if idle_since and time.time() - idle_since > 3:
            return prompts
        time.sleep(0.5)
    return None


def panel_status(page) -> str:
    return " | ".join(page.locator(".widget-html-content").all_inner_texts())


def wait_status(page, pattern: str, timeout_s: float) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = panel_status(page)
        if re.search(pattern, text):
            return text
        time.sleep(0.2)
    raise AssertionError(f"status never matched {pattern!r}; it said: {panel_status(page)}")


def set_slider(page, label: str, value: str) -> None:
    """Type a value into the readout of the slider labelled ``label``, as a person can."""
    page.locator(f".widget-slider:has(label:text-is('{label}')) .widget-readout").click()
    page.keyboard.press("Control+A")
    page.keyboard.type(value)
    page.keyboard.press("Enter")


def bar_fractions(page) -> list[float]:
    """How full each progress bar in the page is (0..1)."""
    return page.evaluate("""() =>
        [...document.querySelectorAll('.widget-hprogress .progress-bar')].map(b =>
            b.getBoundingClientRect().width / b.parentElement.getBoundingClientRect().width)""")


def panel_output(page) -> str:
    """The text of the panel's Output widget: its table and its charts' titles and legends."""
    return " ".join(page.locator(".widget-output").all_inner_texts())


def output_table(page, column: str) -> list[dict]:
    """The rows of the panel's table that has ``column``, as {header: cell text}."""
    tables = page.evaluate("""() =>
        [...document.querySelectorAll('.widget-output table')].map(t =>
            [...t.querySelectorAll('tr')].map(r =>
                [...r.querySelectorAll('th, td')].map(c => c.innerText.trim())))""")
    for rows in tables:
        if rows and column in rows[0]:
            head = rows[0]
            return [dict(zip(head[-len(r) :], r[-len(head) :])) for r in rows[1:]]
    raise AssertionError(f"no table with a {column!r} column in the panel")


def run_and_watch_bars(page, button, stop) -> float:
    """Click Run on a long run; return the fullest partial bar seen, then stop it."""
    page.click(button)
    seen, deadline = 0.0, time.time() + 60
    while time.time() < deadline and not 0.02 < seen < 0.98:
        fractions = [f for f in bar_fractions(page) if 0.02 < f < 0.98]
        seen = max(fractions, default=seen)
        time.sleep(0.1)
    t0 = time.time()
    stop()
    return seen, t0


def interrupt_kernel(page) -> None:
    """The kernel's Interrupt, from JupyterLab's Kernel menu."""
    page.click(".lm-MenuBar-itemLabel:text-is('Kernel')")
    page.click(".lm-Menu-itemLabel:text-is('Interrupt Kernel')")


def stoppers(page) -> dict:
    """The two ways a person ends a run, keyed by the name the panel's status gives each."""
    return {
        "the Stop button": lambda: page.click(".widget-button:has-text('Stop')"),
        "the kernel's Interrupt": lambda: interrupt_kernel(page),
    }


def kernel_ranks(lab) -> list[psutil.Process]:
    """Rank processes still alive under the kernel (children of its forkserver)."""
    ranks = []
    for p in psutil.Process(lab["server"].pid).children(recursive=True):
        try:
            parent = p.parent()
            if (
                parent
                and any("forkserver" in part for part in parent.cmdline())
                and p.status() != psutil.STATUS_ZOMBIE
            ):
                ranks.append(p)
        except psutil.NoSuchProcess:
            continue
    return ranks


def test_data_parallel_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser,
        lab,
        "01_data_parallel.ipynb",
        only=("env = labkit.env_probe()", "base = RunConfig(", "labkit.run_panel("),
    )
    assert page.locator(".widget-output .js-plotly-plot").count() >= 2  # the panel's charts
    assert "ddp@2" in panel_output(page)

    # as a person: pick one strategy, Run, and the panel redraws with that run
    page.select_option(".widget-select-multiple select", ["ddp_naive"])
    wait_status(page, r"ready: .*ddp_naive@2", 10)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"done: ", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-01-after-run.png"), full_page=True)
    assert "ddp_naive@2" in shown and "ddp@2" not in shown.replace("ddp_naive@2", ""), shown[:800]

    # a world size that does not divide the batch is refused before a run, not after
    world, steps = (page.locator(".widget-slider .noUi-handle").nth(i) for i in (0, 1))
    world.focus()
    page.keyboard.press("End")  # world sizes 1, 2, 4
    page.fill(".widget-text input", "30")
    page.keyboard.press("Enter")
    wait_status(page, r"cannot run: .*not divisible by world size 4", 10)
    assert page.locator(".widget-button:has-text('Run')").is_disabled()
    page.fill(".widget-text input", "128")
    page.keyboard.press("Enter")
    world.focus()
    page.keyboard.press("Home")
    page.keyboard.press("ArrowRight")  # back to 2
    wait_status(page, r"ready: ddp_naive@1, ddp_naive@2", 10)

    # a longer run: its bars move, and Stop stops it within a second or two
    steps.focus()
    page.keyboard.press("End")  # 200 steps
    seen, t0 = run_and_watch_bars(
        page,
        ".widget-button:has-text('Run')",
        lambda: page.click(".widget-button:has-text('Stop')"),
    )
    wait_status(page, r"stopped</?b?>? by the Stop button|stopped by the Stop button", 10)
    stop_s = time.time() - t0
    page.screenshot(path=str(OUT / "browser-01-stopped.png"), full_page=True)
    assert seen > 0.02, "no progress bar moved during the run"
    assert stop_s < 5, f"Stop took {stop_s:.1f} s"

    # the kernel's Interrupt (Kernel menu) stops a panel run too
    seen, t0 = run_and_watch_bars(
        page, ".widget-button:has-text('Run')", lambda: interrupt_kernel(page)
    )
    wait_status(page, r"by the kernel's Interrupt", 10)
    page.screenshot(path=str(OUT / "browser-01-interrupted.png"), full_page=True)
    assert time.time() - t0 < 5
    time.sleep(1)
    left = kernel_ranks(lab)
    assert not left, f"rank processes left behind: {[p.pid for p in left]}"
    page.close()


def test_pipeline_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(browser, lab, "03_model_parallel.ipynb", upto="pipeline_panel(base)")
    assert "measured, one step (1f1b, P=2, M=4)" in panel_output(page)

    # as a person: GPipe with 8 micro-batches, Run, and the Gantt names the new run
    selects = page.locator(".widget-dropdown select")
    selects.nth(1).select_option("pipeline_gpipe")  # schedule
    selects.nth(0).select_option("8")  # micro-batches
    wait_status(page, r"ready: pipeline_gpipe P=2 M=8", 10)
    page.click(".widget-button:has-text('Run')")
    status = wait_status(page, r"done: pipeline_gpipe P=2 M=8", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-03-after-run.png"), full_page=True)
    assert "measured, one step (gpipe, P=2, M=8)" in shown and "replayed" in shown, shown[:800]
    assert "closed form" in status

    # model_parallel runs one micro-batch: the panel says so instead of promising M=8
    selects.nth(1).select_option("model_parallel")
    wait_status(page, r"ready: model_parallel P=2 M=1", 10)
    assert selects.nth(0).is_disabled()
    time.sleep(1)
    assert not kernel_ranks(lab)
    page.close()


def test_communication_panels_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(browser, lab, "06_communication.ipynb")
    assert "ddp@2" in panel_output(page)

    # as a person: the fp16 hook, Run, and the knobs table gains that run beside the first
    knobs = page.locator(".widget-dropdown select")
    knobs.nth(1).select_option("fp16")  # comm hook
    wait_status(page, r"ready: ddp@2, fp16", 10)
    page.click(".widget-button:has-text('Run')")
    status = wait_status(page, r"done: ddp@2, fp16", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-06-after-run.png"), full_page=True)
    assert "ddp@2, fp16" in shown and "predicted" in status, (status, shown[:800])

    # PowerSGD's rank picker is live only for PowerSGD
    assert knobs.nth(2).is_disabled()
    knobs.nth(1).select_option("powersgd")
    wait_status(page, r"ready: ddp@2, powersgd r=1", 10)
    assert not knobs.nth(2).is_disabled()

    # the what-if panel redraws on a change, with no run: step time instead of efficiency
    assert "scaling efficiency" in panel_output(page)
    knobs.nth(3).select_option(label="step time (ms)")  # what-if: show
    deadline = time.time() + 20
    while "predicted step time" not in panel_output(page) and time.time() < deadline:
        time.sleep(0.2)
    page.screenshot(path=str(OUT / "browser-06-whatif.png"), full_page=True)
    assert "predicted step time" in panel_output(page)

    # Run was disabled and enabled again by the kernel (the fp16 run): the kernel's Interrupt
    # still stops a long run (this panel has no "cannot run" state: the batch grows with the
    # world size). A long run, set with the panel's own controls: 100 steps alone ended in 1.3 s
    # on a quiet 2-core host, before the Interrupt's two menu clicks landed; 8 micro-batches a
    # step, each synchronised, take about 9 s there
    knobs.nth(1).select_option("none")
    set_slider(page, "steps", "100")
    set_slider(page, "accumulate", "8")
    page.check(".widget-checkbox:has-text('sync every micro-batch') input[type=checkbox]")
    wait_status(page, r"ready: ddp@2, accumulate 8 \(sync every\)", 10)
    seen, t0 = run_and_watch_bars(
        page, ".widget-button:has-text('Run') >> nth=0", lambda: interrupt_kernel(page)
    )
    wait_status(page, r"by the kernel's Interrupt", 10)
    assert time.time() - t0 < 5, f"Interrupt took {time.time() - t0:.1f} s"
    time.sleep(1)
    assert not kernel_ranks(lab)
    page.close()


def test_load_balancing_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser,
        lab,
        "07_load_balancing.ipynb",
        only=("labkit.env_probe()", "base = RunConfig(", "labkit.balance_panel("),
    )
    wait_status(page, r"ready: ddp_naive@2 static, slow 1:2", 10)

    # as a person: rank 1's slider to 3 (typed into its readout), the dynamic policy, Run
    set_slider(page, "rank 1 slowdown", "3")
    page.click(".widget-toggle-button:has-text('dynamic')")
    wait_status(page, r"ready: ddp_naive@2 dynamic, slow 1:3", 10)
    page.click(".widget-button:has-text('Run')")
    status = wait_status(page, r"done: ddp_naive@2 dynamic, slow 1:3", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-07-dynamic.png"), full_page=True)
    assert "of the ideal" in status, status
    assert "dynamic, slow 1:3" in shown and "Throughput as the shares adapt" in shown, shown[:800]

    # a second run, static: the table keeps the first and gains this one, the charts redraw
    page.click(".widget-toggle-button:has-text('static')")
    wait_status(page, r"ready: ddp_naive@2 static, slow 1:3", 10)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"done: ddp_naive@2 static, slow 1:3.*2 run\(s\)", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-07-static.png"), full_page=True)
    assert "static, slow 1:3" in shown and "dynamic, slow 1:3" in shown, shown[:800]

    # Run was disabled and enabled by the kernel twice: the kernel's Interrupt still stops a run
    set_slider(page, "steps", "60")
    wait_status(page, r"ready: ddp_naive@2 static, slow 1:3", 10)
    seen, t0 = run_and_watch_bars(
        page, ".widget-button:has-text('Run')", lambda: interrupt_kernel(page)
    )
    wait_status(page, r"by the kernel's Interrupt", 10)
    assert time.time() - t0 < 5, f"Interrupt took {time.time() - t0:.1f} s"
    time.sleep(1)
    assert not kernel_ranks(lab)
    page.close()


def test_elastic_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser, lab, "10_elastic.ipynb", only=("TINY = dict(", "labkit.elastic_panel(")
    )
    wait_status(page, r"ready: ddp on torchrun, nnodes 1:2, 2000 steps", 10)

    # as a person: more steps (typed into the readout), Run, then a node joins with a click
    set_slider(page, "steps", "4000")
    wait_status(page, r"ready: ddp on torchrun, nnodes 1:2, 4000 steps", 10)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"step \d+, world size 1", 120)
    page.click(".widget-button:has-text('Add a node')")
    wait_status(page, r"step \d+, world size 2", 180)
    t0 = time.time()
    page.click(".widget-button:has-text('Stop')")
    status = wait_status(page, r"stopped by the Stop button", 60)
    stop_s = time.time() - t0
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-10-join.png"), full_page=True)
    assert "join" in shown and "an elastic job over time" in shown, (status, shown[:800])
    assert stop_s < 5, f"Stop took {stop_s:.1f} s"

    # Run again; the kernel's Interrupt stops the torchrun job as fast as Stop does
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"step \d+, world size 1", 120)
    t0 = time.time()
    interrupt_kernel(page)
    wait_status(page, r"stopped by the kernel's Interrupt", 60)
    assert time.time() - t0 < 5, f"Interrupt took {time.time() - t0:.1f} s"
    # every agent and worker the panel started is gone
    left = [
        p
        for p in psutil.Process(lab["server"].pid).children(recursive=True)
        if any(k in " ".join(p.cmdline()) for k in ("torch.distributed.run", "labkit.worker"))
        and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert not left, left
    page.close()


def test_memory_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser,
        lab,
        "08_memory_precision.ipynb",
        only=("base = RunConfig(", "labkit.memory_panel("),
    )
    wait_status(page, r"done: fsdp@2, mlp 256x4", 10)

    # as a person: pick ZeRO-1 (the calculated bar redraws at once), then Run to measure it
    page.click(".widget-toggle-button:has-text('zero1')")
    wait_status(page, r"ready: zero1@2, mlp 256x4.*MiB per rank \(calculated\)", 10)
    assert "Calculated: zero1@2" in panel_output(page)
    page.click(".widget-button:has-text('Run')")
    status = wait_status(page, r"done: zero1@2, mlp 256x4.*2 run\(s\)", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-08-zero1.png"), full_page=True)
    assert "calculator within" in status, status
    assert "zero1@2" in shown and "fsdp@2" in shown and "Counted: zero1@2" in shown, shown[:800]

    # a large model: the panel says before Run how long it takes at least; Stop ends it. The
    # largest the sliders allow, under FSDP with activation checkpointing: sharded states keep it
    # within a laptop's memory (the panel refuses a run that may not fit) and recomputation
    # lengthens its floor. At this machine's matmul rate and free memory (read here as the panel
    # reads them) it is announced, or the test says why it cannot be
    import psutil

    from labkit import RunConfig
    from labkit.env import matmul_flops_per_s
    from labkit.labs.memory import CATEGORIES, predict
    from labkit.widgets.memory_panel import LONG_S, MemoryPanel

    page.click(".widget-toggle-button:has-text('fsdp')")
    page.check(".widget-checkbox:has-text('activation checkpointing') input[type=checkbox]")
    set_slider(page, "width", "4096")
    set_slider(page, "depth", "16")
    set_slider(page, "global batch", "1024")
    big = RunConfig(
        strategy="fsdp",
        world_size=2,
        steps=3,
        warmup=1,
        global_batch=1024,
        width=4096,
        depth=16,
        dataset_size=1024,
        activation_checkpointing=True,
    )  # notebook 08's base at the sliders' largest
    floor = MemoryPanel.floor_s(big)
    # the panel's rule: 4x the calculated bytes per rank, on every rank, within free memory
    need = 4 * predict(big, "sgd_momentum")[list(CATEGORIES)].sum(axis=1).max() * big.ranks
    free = psutil.virtual_memory().available
    if floor < 1.5 * LONG_S or need > 0.8 * free:
        pytest.skip(
            f"this machine multiplies at {matmul_flops_per_s('cpu') / 1e9:.0f} GFLOP/s and has "
            f"{free / 2**30:.1f} GiB free: the largest model's floor is {floor:.1f} s (the panel "
            f"announces from {LONG_S:.0f} s) and it needs {need / 2**30:.1f} GiB"
        )
    wait_status(page, r"ready: fsdp@2, mlp 4096x16.*checkpointed.*takes at least \d+ s", 20)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"running", 20)
    time.sleep(2)
    t0 = time.time()
    page.click(".widget-button:has-text('Stop')")
    status = wait_status(page, r"stopped.{0,8}by the Stop button", 10)
    assert time.time() - t0 < 5, f"Stop took {time.time() - t0:.1f} s"
    assert "below: an earlier run" in status, status
    time.sleep(1)
    assert not kernel_ranks(lab)
    page.close()


def test_sync_async_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(browser, lab, "09_sync_async.ipynb", upto="labkit.sync_panel(")
    wait_status(page, r"ready: ddp@2, async_ps@3", 10)

    # as a person: rank 1's slowdown typed into its slider's readout, then Run
    set_slider(page, "rank 1 slowdown", "2.5")
    wait_status(page, r"ready: ddp@2 slow 1:2\.5, async_ps@3 slow 1:2\.5", 10)
    page.click(".widget-button:has-text('Run')")
    status = wait_status(page, r"done: ddp@2 slow 1:2\.5, async_ps@3 slow 1:2\.5; 2 run\(s\)", 180)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-09-straggler.png"), full_page=True)
    assert "fastest to" in status or "run(s) in the table" in status, status
    assert "ddp@2 slow 1:2.5" in shown and "async_ps@3 slow 1:2.5" in shown, shown[:800]
    assert "Staleness" in shown, shown[:800]

    # the same settings again: a row of its own beside the first, nothing pooled
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"done: ddp@2 slow 1:2\.5, async_ps@3 slow 1:2\.5; 4 run\(s\)", 180)
    shown = panel_output(page)
    assert "ddp@2 slow 1:2.5, repeat 2" in shown and "async_ps@3 slow 1:2.5, repeat 2" in shown, (
        shown[:1200]
    )

    # a third time: three ddp rows, each with the same bytes to the target (DDP's bytes do not
    # depend on timing; runs pooled into one row added them up: 18.4 -> 36.9 -> 53.5 MB)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"done: ddp@2 slow 1:2\.5, async_ps@3 slow 1:2\.5; 6 run\(s\)", 180)
    rows = output_table(page, "MB to target")
    ddp = [r["MB to target"] for r in rows if r["run"].startswith("ddp@2 slow 1:2.5")]
    page.screenshot(path=str(OUT / "browser-09-three-runs.png"), full_page=True)
    assert len(ddp) == 3 and len(set(ddp)) == 1 and float(ddp[0]) > 0, rows
    assert not kernel_ranks(lab)
    page.close()


def test_scheduling_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(browser, lab, "11_scheduling.ipynb", upto="labkit.sched_panel(")
    wait_status(page, r"done: 3 policies on 4x8", 10)

    # as a person: 8 nodes (typed into the slider's readout), Run; the panel names the new cluster
    set_slider(page, "nodes", "8")
    wait_status(page, r"ready: 300 jobs .* on 8x8 \(64 GPUs\)", 10)
    page.click(".widget-button:has-text('Run')")
    status = wait_status(page, r"done: 3 policies on 8x8", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-11-after-run.png"), full_page=True)
    assert "lowest mean JCT" in status, status
    assert "on 8x8 (64 GPUs)" in shown and "Allocations under fifo" in shown, shown[:800]

    # a long simulation (3,000 jobs at 160 % load on one node under max-min fairness, ~15 s):
    # its bar counts the jobs finished, and the kernel's Interrupt, then Stop, abandon it within
    # a few seconds; the 8x8 run's results stay below, said to be an earlier run's
    set_slider(page, "jobs", "3000")
    set_slider(page, "arrival rate (offered load)", "1.6")
    set_slider(page, "nodes", "1")
    page.select_option(".widget-select-multiple select", ["maxmin"])
    wait_status(page, r"ready: 3000 jobs at 160% .* on 1x8 \(8 GPUs\): maxmin", 10)
    for said, stop in reversed(stoppers(page).items()):  # the Interrupt first, then Stop
        seen, t0 = run_and_watch_bars(page, ".widget-button:has-text('Run')", stop)
        status = wait_status(page, rf"stopped by {said}", 10)
        assert seen > 0.02 and time.time() - t0 < 5, (seen, time.time() - t0)
        assert "the simulation was abandoned" in status, status
        assert "below: an earlier run (300 jobs" in status and "8x8" in status, status
    assert "Allocations under fifo" in panel_output(page)  # the earlier run, still shown
    page.screenshot(path=str(OUT / "browser-11-stopped.png"), full_page=True)
    assert not kernel_ranks(lab)
    page.close()


def test_long_sequences_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser, lab, "14_long_sequences.ipynb", only=("from labkit.labs import long_", "cp_panel(")
    )
    wait_status(page, r"done: ring zigzag s=1024 N=2", 10)
    assert "ring zigzag s=1024 N=2" in panel_output(page)

    # as a person: zig-zag off, Run: contiguous beside zig-zag, each rank's tiles as scheduled
    page.click(".widget-checkbox input")
    wait_status(page, r"ready: ring attention, contiguous, s = 1024 over N = 2", 10)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"done: ring contiguous s=1024 N=2.*2 run\(s\)", 120)
    rows = output_table(page, "full")
    page.screenshot(path=str(OUT / "browser-14-contiguous.png"), full_page=True)
    full = {(r["run"].split()[1], r["rank"]): r["full"] for r in rows}  # layout, rank
    assert [full[("zigzag", r)] for r in "01"] == ["3", "3"], rows  # even
    assert [full[("contiguous", r)] for r in "01"] == ["0", "1"], rows  # rank 1's tile on top

    # Ulysses on 4 ranks (oversubscribed here, and the ready line says so), then Stop a long
    # ring: every rank ends with it
    page.click(".widget-toggle-button:text-is('ulysses')")
    page.click(".widget-toggle-button:text-is('4')")
    wait_status(page, r"ready: ulysses attention, contiguous, s = 1024 over N = 4", 10)
    page.click(".widget-toggle-button:text-is('ring')")
    page.locator(".widget-dropdown select").first.select_option("4096")
    page.click(".widget-button:has-text('Run')")
    deadline = time.time() + 60
    while not kernel_ranks(lab) and time.time() < deadline:
        time.sleep(0.1)
    t0 = time.time()
    page.click(".widget-button:has-text('Stop')")
    wait_status(page, r"by the Stop button", 10)
    assert time.time() - t0 < 5, f"Stop took {time.time() - t0:.1f} s"
    time.sleep(1)
    assert not kernel_ranks(lab)
    page.close()


def test_tensor_parallel_panels_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser,
        lab,
        "13_layouts.ipynb",
        only=(
            "env = labkit.env_probe()",
            "panel = layout_panel()",
            "assert panel.run()",
            "advisor = advisor_panel(",
        ),
    )
    wait_status(page, r"done: run 1, tp: dp 1 x tp 2 x stages 1 = 2 rank", 10)

    # as a person: data-parallel degree 2 (4 ranks on this machine's cores, said before Run),
    # Run; the table keeps the first run and adds this one as its own row
    set_slider(page, "data dp", "2")
    status = wait_status(page, r"ready: dp_tp: dp 2 x tp 2 x stages 1 = 4 rank", 10)
    if (psutil.cpu_count() or 1) < 4:
        assert "time-share the cores" in status, status
    page.click(".widget-button:has-text('Run')")
    status = wait_status(page, r"done: run 2, dp_tp", 120)
    assert "2 run(s) in the table, one row each" in status, status
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-13-after-run.png"), full_page=True)
    assert "dp1 tp2 pp1" in shown and "dp2 tp2 pp1" in shown, shown[:800]

    # tensor and pipeline together is not a strategy: said before anything runs, Run disabled
    set_slider(page, "pipeline stages", "2")
    wait_status(page, r"cannot run: tensor and pipeline parallelism together", 10)
    assert page.locator(".widget-button:has-text('Run')").first.is_disabled()

    # after that "cannot run", Run's clicks come on a kernel subshell thread (JupyterLab 4.6):
    # the kernel's Interrupt still stops a long run, every rank with it
    set_slider(page, "pipeline stages", "1")
    set_slider(page, "steps", "200")
    wait_status(page, r"ready: dp_tp: dp 2 x tp 2", 10)

    seen, t0 = run_and_watch_bars(
        page, ".widget-button:has-text('Run')", lambda: interrupt_kernel(page)
    )
    wait_status(page, r"by the kernel's Interrupt", 10)
    assert seen > 0.02 and time.time() - t0 < 5, (seen, time.time() - t0)
    time.sleep(1)
    assert not kernel_ranks(lab)

    # the advisor redraws on a change, with no run: another device, another best layout line
    selects = page.locator(".widget-dropdown select")
    before = panel_status(page)
    selects.nth(1).select_option(label="H100 SXM 80GB")  # device
    deadline = time.time() + 20
    while panel_status(page) == before and time.time() < deadline:
        time.sleep(0.2)
    page.screenshot(path=str(OUT / "browser-13-advisor.png"), full_page=True)
    assert panel_status(page) != before and "best: tp" in panel_status(page)
    assert not kernel_ranks(lab)
    page.close()


def test_moe_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser, lab, "15_mixture_of_experts.ipynb", only=("env = labkit.env_probe()", "moe_panel(")
    )
    wait_status(page, r"done: E=4 top-1 cf=1.25 skew=0 aux=0.01", 10)

    def choose(label: str, option: str) -> None:
        page.locator(f".widget-dropdown:has(label:text-is('{label}')) select").select_option(
            label=option
        )

    # as a person: skew the router hard, switch the aux loss off, Run: one expert takes ~all
    set_slider(page, "router skew (expert 0)", "6")
    choose("aux loss coefficient", "0.0")
    wait_status(page, r"ready: E=4 top-1 cf=1.25 skew=6 aux=0", 10)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"done: E=4 top-1 cf=1.25 skew=6 aux=0.*2 run\(s\)", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-15-skewed.png"), full_page=True)
    assert "skew=0 aux=0.01" in shown and "Load per expert" in shown, shown[:800]
    rows = output_table(page, "busiest vs even")
    assert len(rows) == 2 and float(rows[1]["busiest vs even"]) > 3.5, rows  # one takes ~all

    # two experts, each token to both: allowed, said before Run
    choose("experts E", "2")
    page.click(".widget-toggle-button:text-is('2')")
    wait_status(page, r"ready: E=2 top-2", 10)

    # Stop, then the kernel's Interrupt, end a long run within seconds, every rank with it
    # (the preset's 12 steps end in about a second)
    set_slider(page, "steps", "400")
    wait_status(page, r"ready: E=2 top-2 .* 400 steps", 10)
    for by, stop in stoppers(page).items():
        page.click(".widget-button:has-text('Run')")
        deadline = time.time() + 60
        while not kernel_ranks(lab) and time.time() < deadline:
            time.sleep(0.1)
        t0 = time.time()
        stop()
        wait_status(page, rf"by {by}", 10)
        assert time.time() - t0 < 5, f"{by} took {time.time() - t0:.1f} s"
        time.sleep(1)
        assert not kernel_ranks(lab), by
    page.close()


def test_pipeline_schedules_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser, lab, "05_pipeline_schedules.ipynb",
        only=("env = labkit.env_probe()", "pipeline_panel(base)"),
    )  # fmt: skip
    wait_status(page, r"done: pipeline_interleaved P=2 M=4 v=2 \(scratch\)", 10)
    assert "measured, one step (interleaved, P=2, M=4, v=2)" in panel_output(page)

    # as a person: pick DualPipeV (v fixed at 2), try labkit's executor (refused, with the
    # fix), go back to auto (torch's), Run: the Gantt draws its split backward
    selects = page.locator(".widget-dropdown select")
    selects.nth(1).select_option("pipeline_dualpipev")  # schedule
    wait_status(page, r"ready: pipeline_dualpipev P=2 M=4 v=2 \(torch\)", 10)
    page.click(".widget-toggle-button:text-is('scratch')")
    wait_status(page, r"cannot run: .*set pipeline_impl='torch'", 10)
    page.click(".widget-toggle-button:text-is('auto')")
    wait_status(page, r"ready: pipeline_dualpipev", 10)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"done: pipeline_dualpipev P=2 M=4 v=2 \(torch\)", 120)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-05-dualpipev.png"), full_page=True)
    assert "measured, one step (dualpipev, P=2, M=4, v=2)" in shown, shown[:800]
    assert "input (I)" in shown and "weights (W)" in shown, shown[:800]

    # interleaving sends micro-batches round in groups of P: M=1 is refused before anything runs
    selects.nth(1).select_option("pipeline_interleaved")
    set_slider(page, "virtual stages v", "3")
    wait_status(page, r"ready: pipeline_interleaved P=2 M=4 v=3", 10)
    selects.nth(0).select_option("1")  # micro-batches
    wait_status(page, r"cannot run: .*set microbatches to a multiple of 2", 10)
    time.sleep(1)
    assert not kernel_ranks(lab)
    page.close()


def test_fit_panel_in_a_browser(lab, browser):
    OUT.mkdir(exist_ok=True)
    page = open_and_run_all(
        browser, lab, "16_will_it_fit.ipynb", only=("guesses = Guesses()", "panel = fit_panel()")
    )
    wait_status(page, r"fits.*of 11 GB usable", 10)  # the default layout, run by the cell

    # as a person: ZeRO-0 (DDP, everything on every GPU) does not fit; said before and after Run
    page.click(".widget-toggle-button:text-is('0')")
    wait_status(page, r"ready: ddp: t 1 x P 1 x d 8 = 8 GPUs", 10)
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"does not fit.*of 11 GB usable", 180)
    shown = panel_output(page)
    page.screenshot(path=str(OUT / "browser-16-ddp.png"), full_page=True)
    assert "will it fit?" in shown and "activations" in shown, shown[:800]
    rows = output_table(page, "dry run GB")
    total = next(r for r in rows if r["category"] == "total")
    assert float(total["dry run GB"]) > 10.8, rows  # the bar's total, above the line

    # a layout that cannot exist is refused before anything runs, with the fix
    tensor = page.locator(".widget-dropdown:has(label:text-is('tensor t')) select")
    tensor.select_option("16")
    wait_status(page, r"cannot run: t 16 x P 1 = 16 does not divide 8 GPUs", 10)
    assert page.locator(".widget-button:has-text('Run')").is_disabled()
    tensor.select_option("1")

    # 4 pipeline stages: 4 ranks differ, dry-run one after another (a bar each). After that
    # "cannot run", Stop, then the kernel's Interrupt, end a run between ranks once one has
    # finished; then one runs through
    page.locator(".widget-dropdown:has(label:text-is('pipeline P')) select").select_option("4")
    wait_status(page, r"ready: dp_pp: t 1 x P 4 x d 2 = 8 GPUs", 10)
    for by, stop in stoppers(page).items():
        page.click(".widget-button:has-text('Run')")
        wait_status(page, r"running dp_pp", 10)
        deadline = time.time() + 120
        while time.time() < deadline:
            bars = bar_fractions(page)
            if len(bars) == 4 and 1 <= sum(f > 0.98 for f in bars) < 4:
                break
            time.sleep(0.1)
        stop()
        wait_status(page, rf"stopped.{{0,8}} by {by}: the ranks not yet run were skipped", 60)
        assert sum(f > 0.98 for f in bar_fractions(page)) < 4, by  # not every rank ran
    page.click(".widget-button:has-text('Run')")
    wait_status(page, r"fits.*dry run of 4 rank\(s\)", 180)
    page.screenshot(path=str(OUT / "browser-16-pipeline.png"), full_page=True)
    assert len(output_table(page, "dry run GB")) > 1
    page.close()
