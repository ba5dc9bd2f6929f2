"""What the sub-commands share: parsing lists, refusing bad paths before anything runs, and
writing an HTML report."""

from __future__ import annotations

import os


def one_run_only(args) -> None:
    """compare, check and demo run several configurations: one checkpoint folder would make each
    run resume from the one before it."""
    if getattr(args, "checkpoint_dir", None):
        raise ValueError(
            "--checkpoint-dir: this command runs several configurations, which would "
            "resume from each other's checkpoints: checkpoint one run with torchrun "
            "-m labkit.worker --checkpoint-dir DIR (or labkit.run in Python)"
        )


def csv(text: str, cast=str, flag: str = "") -> list:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(
            f"{flag} is empty: give at least one value, e.g. {flag} "
            f"{'1,2' if cast is int else 'single,ddp'}"
        )
    try:
        return [cast(t) for t in items]
    except ValueError:
        bad = next(t for t in items if not t.lstrip("-").isdigit())
        raise ValueError(f"{flag} {text!r}: {bad!r} is not a whole number") from None


def writable(flag: str, path: str | None) -> None:
    """Refuse an output path before anything runs (not after the run, losing it)."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(
            f"{flag} {path}: the folder {folder} does not exist: create it or choose another path"
        )
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable")


def write_html(path: str, title: str, table, figs) -> None:
    parts = [f"<h1>{title}</h1>", table.to_html(index=False, float_format=lambda v: f"{v:.3g}")]
    for i, fig in enumerate(figs):  # plotly.js inline once: the report works offline
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
    with open(path, "w") as f:
        f.write(
            "<html><head><meta charset='utf-8'></head><body>" + "".join(parts) + "</body></html>"
        )


def pd_options():
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_columns", 30)
