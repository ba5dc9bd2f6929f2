"""What every labkit panel shares: controls build a run, Run executes it in a background thread
(so Stop stays clickable), per-rank progress bars move live, and the results are drawn into the
panel's output when the run ends.

Three facts about Jupyter this file relies on (the versions they were checked with:
benchmarks/README.md, "Behind the code"):

* From a thread started by a button click, ``Output.clear_output()`` + ``with out: display()``
  renders nothing: the display messages carry the click's
  parent header, not the Output widget's, so the browser never routes them to it. Setting the
  widget's ``outputs`` trait instead is a plain state update, which the browser applies from any
  thread: labkit builds the mime bundles itself (plotly's ``application/vnd.plotly.v1+json``
  from ``fig.to_json()``, a DataFrame's HTML) and assigns them.
* The kernel's Interrupt is a SIGINT that an idle ipykernel ignores (it installs SIG_IGN and
  restores it after every cell and every click), so a run in a thread never hears it. The panel
  wraps the handler ipykernel restores (``kernel.saved_sigint_handler``): on SIGINT it stops
  every running panel, then does what ipykernel would have done.
* JupyterLab sends widget messages over kernel subshells (``commsOverSubshells``), and a
  button whose state a message changed (Run disabled by "cannot run", then enabled) delivers its
  clicks on a ``subshell-...`` thread. Python installs signal handlers only from the main thread,
  so the wrapper above is installed when the panel is built (in a cell, on the main thread),
  never lazily in a click.
"""

from __future__ import annotations

import functools
import html
import json
import os
import signal
import threading
import time
from typing import Any

import ipywidgets as W
import pandas as pd

from .. import report
from ..env import oversubscription, probe
from ..launch import LaunchCancelled
from ..records import LiveLoss

_RUNNING: set[BackgroundRun] = set()  # panels with a run under way (for the interrupt)
_LISTENING = False


def _listen_for_interrupt() -> None:
    """Make the kernel's Interrupt stop running panels (once per kernel; see the docstring)."""
    global _LISTENING
    try:
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
    except ImportError:
        kernel = None
    if _LISTENING or kernel is None or threading.current_thread() is not threading.main_thread():
        return
    idle = getattr(kernel, "saved_sigint_handler", None) or signal.getsignal(signal.SIGINT)

    def on_interrupt(signum, frame):
        for panel in list(_RUNNING):
            panel.interrupt()
        if callable(idle):
            idle(signum, frame)

    if hasattr(kernel, "saved_sigint_handler"):
        kernel.saved_sigint_handler = on_interrupt  # restored when this cell or click returns
    else:
        signal.signal(signal.SIGINT, on_interrupt)
    _LISTENING = True


@functools.cache
def _cpu_ranks() -> bool:
    """Whether ranks here are CPU processes (probed once: every control change asks)."""
    return probe().device == "cpu"


def mime_output(obj: Any) -> dict:
    """One display_data output for an Output widget's ``outputs`` trait."""
    if hasattr(obj, "to_plotly_json"):  # a plotly figure
        title = obj.layout.title.text if obj.layout.title else None
        data = {
            "application/vnd.plotly.v1+json": {
                **json.loads(obj.to_json()),
                "config": {"responsive": True},
            },
            "text/plain": f"<plotly figure: {title or 'untitled'}>",
        }
    elif isinstance(obj, pd.DataFrame):  # every panel's table reads the same way
        shown = report.readable(obj)
        table = shown.to_html(index=False, border=0, classes="labkit-table")
        data = {
            "text/html": f"<div style='overflow-x:auto; font-size:12px'>{table}</div>",
            "text/plain": shown.to_string(index=False),
        }
    else:
        data = {"text/html": str(obj), "text/plain": html.unescape(str(obj))}
    return {"output_type": "display_data", "data": data, "metadata": {}}


class BackgroundRun:
    """The shared panel mechanism; a panel subclass provides ``controls`` (a widget),
    ``plan()`` (check the controls; return a one-line description or raise ValueError with the
    fix), ``execute(cancel)`` (run, return results) and ``render(results)`` (what to draw)."""

    controls: W.Widget
    stopped_what = "every rank was terminated"  # what a Stop ended, said in the status line
    warns_oversubscription = True  # the ready line warns when config().ranks exceeds the cores

    def __init__(self):
        self.error: BaseException | None = None
        self.stopped_by: str | None = None
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", icon="stop", disabled=True)
        self.status, self.bars, self.out = W.HTML(), W.VBox(), W.Output()
        self.clock = W.HTML()  # seconds since Run, each second: work that reports rarely moves
        self.running: str | None = None  # the plan of the run in progress or last started
        self.shown: str | None = None  # the plan of the run whose results the output shows
        self.shown_now = False  # whether the output is the current run's
        self.trace_button = W.Button(
            description="Save trace",
            icon="download",
            disabled=True,
            tooltip="the last run as a Chrome trace (Perfetto, chrome://tracing)",
        )
        if type(self).last_records is BackgroundRun.last_records:  # nothing a trace could show
            self.trace_button.layout.display = "none"
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop("the Stop button"))
        self.trace_button.on_click(lambda _: self.save_trace())
        # now, while a cell runs on the kernel's main thread: a click may arrive on a subshell
        # thread, where Python cannot install a signal handler (see the module docstring)
        _listen_for_interrupt()

    def layout(self) -> W.Widget:
        buttons = W.VBox([self.run_button, self.stop_button, self.trace_button, self.clock])
        return W.VBox([W.HBox([self.controls, buttons]), self.status, self.bars, self.out])

    def _ipython_display_(self):  # a panel as a cell's last line shows the widget
        from IPython.display import display

        display(self.widget)

    # ---- what a click does ------------------------------------------------------------------

    def start(self) -> threading.Thread | None:
        """Run in a background thread (what the Run button does)."""
        if self._thread is not None and self._thread.is_alive():
            return self._thread
        _listen_for_interrupt()
        self._thread = threading.Thread(target=self.run, daemon=True)
        self._thread.start()
        return self._thread

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, by: str = "Stop") -> None:
        self.stopped_by = by
        self._cancel.set()

    def interrupt(self) -> None:
        self.stop("the kernel's Interrupt")

    def run_or_raise(self):
        """``run()``, raising what it raised instead of only showing it (a panel factory's
        ``run_now=True``: the notebook cell fails where the run did)."""
        results = self.run()
        if self.error is not None:
            raise self.error
        return results

    def run(self):
        """Run the current settings in this thread; the results, or None if stopped or failed."""
        self._cancel.clear()
        self.error, self.stopped_by = None, None
        try:
            description = self.plan()
        except ValueError as exc:  # bad input: said before anything runs
            self._fail(exc)
            return None
        self.bars.children = []
        self.running, self.shown_now = description, False  # below: an earlier run's, so far
        self.status.value = f"running {description}"
        self.run_button.disabled, self.stop_button.disabled = True, False
        _RUNNING.add(self)
        stop_clock = self._tick()
        try:
            results = self.execute(self._cancel)
            self.show(*self.render(results))
            self.status.value = self.done_message(results)
            self.trace_button.disabled = self.last_records() is None
            return results
        except LaunchCancelled:
            kept = self.partial()
            if kept is not None:  # runs that finished are never thrown away
                self.show(*self.render(kept))
            self.status.value = (
                f"<b>stopped</b> by {self.stopped_by or 'Stop'}: {self.stopped_what}"
                f"{'; showing the runs that had finished' if kept is not None else ''}"
                f"{self._older()}"
            )
        except Exception as exc:  # shown in the panel; kept for the caller
            self._fail(exc)
            self.status.value += self._older()
        finally:
            stop_clock()
            _RUNNING.discard(self)
            self.run_button.disabled, self.stop_button.disabled = False, True
        return None

    def _tick(self):
        """Show the seconds since Run once a second until the returned ``stop()`` is called,
        which says how long the run took: a step may take minutes (a large model on a CPU), the
        clock moves anyway."""
        done, lock, t0 = threading.Event(), threading.Lock(), time.perf_counter()

        def show(word: str, fmt: str) -> None:
            self.clock.value = f"<small>{word} {time.perf_counter() - t0:{fmt}} s</small>"

        def tick() -> None:
            while not done.wait(1.0):
                with lock:
                    if not done.is_set():
                        show("running", ".0f")

        def stop() -> None:
            with lock:
                done.set()
                show("took", ".1f")

        show("running", ".0f")
        threading.Thread(target=tick, daemon=True).start()
        return stop

    def check_controls(self, note: str = "") -> None:
        """Say what Run will do, or why it cannot, before anything runs (on every change)."""
        try:
            plan = self.plan()
        except ValueError as exc:
            self.run_button.disabled = True
            self.bars.children = []
            self.status.value = (
                f"<span style='color:#b00'>cannot run: {html.escape(str(exc))}</span>"
            )
            return
        self.run_button.disabled = bool(self._thread and self._thread.is_alive())
        ranks = self.planned_ranks()
        warn = oversubscription(ranks) if ranks and not note and _cpu_ranks() else None
        note = note or (f"<br><span style='color:#b00'>{warn}</span>" if warn else "")
        self.status.value = f"ready: {plan}" + note

    def planned_ranks(self) -> int | None:
        """Processes the next Run starts at once: above the cores, the ready line says that
        timings will not be real parallelism (None: the panel says it itself, or cannot)."""
        config = getattr(self, "config", None)
        return config().ranks if callable(config) and self.warns_oversubscription else None

    def save_trace(self, path: str | None = None) -> str | None:
        """Write the last run's records as a Chrome trace (``labkit.trace``; the Save trace
        button, into ``traces/`` beside the notebook); say where in the status line."""
        from ..trace import to_chrome_trace

        records = self.last_records()
        if records is None or records.empty:
            self.status.value = "no finished run to save: press Run first"
            return None
        if path is None:
            os.makedirs("traces", exist_ok=True)
            path = os.path.join("traces", f"labkit-{time.strftime('%Y%m%d-%H%M%S')}.json")
        trace = to_chrome_trace(records, path)
        self.status.value = (
            f"saved the last run's trace ({len(trace['traceEvents'])} events) to "
            f"<code>{html.escape(path)}</code>: open it in https://ui.perfetto.dev or "
            f"chrome://tracing"
        )
        return path

    def _older(self) -> str:
        """Under a stop or an error, what the output below still shows, if anything (a learner
        must not read an earlier run's numbers as this one's)."""
        if not self.out.outputs or self.shown is None or self.shown_now:
            return ""
        return f"<br>below: an earlier run ({html.escape(self.shown)}), not this one"

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.bars.children = []  # no stale progress under an error
        self.status.value = f"<b style='color:#b00'>error</b>: {html.escape(str(exc))}"

    # ---- drawing ------------------------------------------------------------------------------

    def show(self, *objs) -> None:
        """Replace what the panel shows (works from any thread: see the module docstring)."""
        self.out.outputs = tuple(mime_output(o) for o in objs)
        self.shown, self.shown_now = (self.running, True) if objs else (None, False)

    def progress_bars(self, labels: list[str], total: int) -> list[tuple[W.IntProgress, W.HTML]]:
        rows = [
            (
                W.IntProgress(
                    value=0,
                    max=total,
                    description=label,
                    style={"description_width": "initial"},
                    layout={"width": "420px"},
                ),
                W.HTML(),
            )
            for label in labels
        ]
        self.bars.children = [W.HBox(list(r)) for r in rows]
        return rows

    def rank_progress(self, ranks: int, steps: int, label: str):
        """A bar per rank and, once every rank reported a step, the global batch's loss in the
        status line: the ``on_progress`` callback for one run of ``ranks`` ranks."""
        bars, live = self.progress_bars([f"rank {r}" for r in range(ranks)], steps), LiveLoss(ranks)

        def progress(rank: int, metrics: dict) -> None:
            bar, text = bars[rank]
            bar.value = metrics["step"]
            text.value = f"step {metrics['step']}/{metrics['total']}"
            latest = live.update(rank, metrics)
            if latest is not None:
                self.status.value = (
                    f"running <b>{label}</b>: step {latest[0]}, loss {latest[1]:.4f} (global batch)"
                )

        return progress

    # ---- what a panel provides ----------------------------------------------------------------

    def plan(self) -> str:
        raise NotImplementedError

    def execute(self, cancel: threading.Event):
        raise NotImplementedError

    def render(self, results) -> list:
        raise NotImplementedError

    def partial(self):
        """What finished before a Stop (None: nothing)."""
        return None

    def last_records(self) -> pd.DataFrame | None:
        """The per-rank records of the last run, for Save trace (panels that train override
        this; the button is hidden on the others)."""
        return None

    def done_message(self, results) -> str:
        return "done"
