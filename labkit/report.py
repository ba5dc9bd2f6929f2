"""Tables and sentences for people: what ``summarize`` measured, formatted and read.

The CLI, the demo, the notebooks and the panels all print through here, so a number means the
same thing, with the same name, everywhere.
"""

from __future__ import annotations

import math
import os

import pandas as pd

from . import registry
from .records import BUSY_SHARE

_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: float) -> str:
    """A byte count with its binary unit, four significant digits (4,194,304 -> "4 MiB")."""
    for unit, size in _BYTE_UNITS:
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{int(n)} B"


# (column name ending, header unit, how a value reads): the quantity, not the dtype, decides the
# rounding. Checked in order: the first ending that matches wins.
_QUANTITIES = (
    ("_per_s", "/s", lambda v: f"{v:,.0f}"),
    ("_ms", " (ms)", lambda v: f"{v:,.1f}"),
    ("_s", " (s)", lambda v: f"{v:,.2f}"),
    ("_h", " (h)", lambda v: f"{v:,.2f}"),
    ("_bytes", "", human_bytes),
    ("_mib", " (MiB)", lambda v: f"{v:,.1f}"),
    ("_gb", " (GB)", lambda v: f"{v:,.1f}"),
    ("_gib", " (GiB)", lambda v: f"{v:,.1f}"),
    ("_share", "", lambda v: f"{100 * v:.0f}%"),
    ("_fraction", "", lambda v: f"{100 * v:.0f}%"),
    ("efficiency", "", lambda v: f"{100 * v:.0f}%"),
    ("utilisation", "", lambda v: f"{100 * v:.0f}%"),
    ("error", "", lambda v: f"{100 * v:+.0f}%"),
)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def readable(table: pd.DataFrame) -> pd.DataFrame:
    """Any table of measurements as people read it: every number rounded by the quantity its
    column holds (named by its ending: ``_ms``, ``_s``, ``_mib``, ``_share``, ...; any name with
    "bytes" in it is a byte count),
    the unit in the header ("step (ms)"), whole numbers as integers (a world size is 2, not
    2.0), missing values blank, and text left alone. Panels show every table through this."""
    out = {}
    for col in table.columns:
        values, name = table[col], str(col)
        if values.dtype == object or pd.api.types.is_string_dtype(values):
            out[name.replace("_", " ")] = values.map(lambda v: "" if _missing(v) else v)
            continue
        if pd.api.types.is_bool_dtype(values):
            out[name.replace("_", " ")] = values.map(lambda v: "yes" if v else "")
            continue
        header, fmt = _quantity(name)
        if fmt is None:
            whole = values.dropna().map(lambda v: float(v).is_integer()).all()
            fmt = (lambda v: f"{int(v):,}") if whole else _plain
        out[header] = values.map(lambda v, f=fmt: "" if _missing(v) else f(v))
    return pd.DataFrame(out, index=table.index)


def _plain(v: float) -> str:
    """A number with no named quantity: four significant digits below 1,000, whole numbers with
    thousands separators from there (12,093 GPU-hours, not 1.209e+04)."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _quantity(name: str):
    """(header, format) for a column of numbers named ``name``; format None: a plain number."""
    for ending, unit, fmt in _QUANTITIES:
        if name.endswith(ending) or (ending == "_bytes" and "bytes" in name):
            stem = (name[: -len(ending)] if unit else name) or name
            return stem.replace("_", " ").strip() + unit, fmt
    return name.replace("_", " "), None


def _num(v, fmt: str) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _times(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}x"


def _pct(v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.0f}%"


def people_table(table: pd.DataFrame) -> pd.DataFrame:
    """``summarize``'s table with named units and sensible precision (strings, for display)."""
    if table.empty:
        return table
    out = pd.DataFrame({"run": table["run"]})
    out["samples/s"] = [_num(v, ",.0f") for v in table["samples_per_s"]]
    out["step ms (median, slowest rank)"] = [_num(v, ".1f") for v in table["step_ms"]]
    out["exposed comm"] = [
        f"{_num(ms, '.1f')} ms ({_pct(sh)})"
        for ms, sh in zip(table["comm_ms"], table["comm_share"])
    ]
    out["vs single, all cores"] = [_times(v) for v in table["speedup_all_cores"]]
    out["vs single, same cores"] = [_times(v) for v in table["speedup_same_cores"]]
    out["efficiency"] = [_pct(v) for v in table["efficiency"]]
    if "bubble_fraction" in table:
        for col, name in (
            ("bubble_fraction", "bubble"),
            ("bubble_replay", "replayed"),
            ("bubble_theory", "(P-1)/(M+P-1)"),
        ):
            out[name] = [_num(v, ".2f") for v in table[col]]
    if "throughput_fraction" in table:  # load balancing: whole-run figures
        out["of ideal (sum of solo)"] = [_pct(v) for v in table["throughput_fraction"]]
        out["waiting"] = [_pct(v) for v in table["wait_share"]]
    out["loss (global batch)"] = [_num(v, ".4f") for v in table["loss"]]
    if "cpu_share" in table:
        out["CPU share"] = [_pct(v) for v in table["cpu_share"]]
    out["flag"] = [
        ", ".join(
            f
            for f, on in (
                ("busy", row.get("busy", False)),
                ("oversubscribed", row.get("oversubscribed", False)),
            )
            if on
        )
        for _, row in table.iterrows()
    ]
    # a column with nothing in it (speed-ups without a single run beside, the flag when no row
    # is flagged) only takes room
    return out[[c for c in out if out[c].astype(str).str.strip().ne("").any()]]


def format_table(table: pd.DataFrame) -> str:
    """``people_table`` as text for a terminal."""
    return people_table(table).to_string(index=False)


def busy_note(table: pd.DataFrame) -> str | None:
    """A sentence naming the rows whose ranks did not get their cores, or None."""
    if "busy" not in table or not table["busy"].any():
        return None
    rows = table[table["busy"]]
    worst = rows["cpu_share"].min()
    return (
        f"! the machine was busy during {', '.join(rows['run'])}: a rank got only "
        f"{_pct(worst)} of a core while it wanted one (labkit flags below "
        f"{_pct(BUSY_SHARE)}). Another program was using the cores, so these rows' times and "
        f"speed-ups measure that program, not the strategy, and are not comparable: close it "
        f"and run again."
    )


def explain(table: pd.DataFrame) -> str:
    """A plain-language reading of a comparison: what is parallelism, what is exposed
    communication, what the CPU does to it, and what would change it."""
    lines = []
    note = busy_note(table)
    if note:
        lines.append(note)
    clean = table[~table.get("busy", pd.Series(False, index=table.index))]
    slower = []
    for _, row in clean[clean["world_size"] > 1].iterrows():
        if not math.isnan(row.get("bubble_fraction", math.nan)):
            lines.append(
                f"{row['run']}: each stage idled {_pct(row['bubble_fraction'])} of the step; the "
                f"schedule replayed on each step's own measured stage times, hand-offs and "
                f"dispatch gives {_pct(row['bubble_replay'])} (a replay, not a prediction: "
                f"labkit.labs.pipeline_bubble.bubble_table predicts from other runs), "
                f"the closed form "
                f"(P-1)/(M+P-1) {_pct(row['bubble_theory'])} (it counts hand-offs as free)."
            )
            continue
        if not math.isnan(row.get("throughput_fraction", math.nan)):
            lines.append(
                f"{row['run']}: {row['samples_per_s_run']:,.0f} samples/s over the run, "
                f"{_pct(row['throughput_fraction'])} of the {row['ideal_samples_per_s']:,.0f} its "
                f"ranks would train alone (the sum of each rank's samples over its own compute "
                f"time); the ranks spent {_pct(row['wait_share'])} of their time waiting at the "
                f"sync for the slowest one. Each step ends when the slowest rank does, so a static "
                f"split runs at the straggler's pace; shares that follow throughput give the "
                f"slow rank less work until every rank computes equally long."
            )
            continue
        if registry.get(row["strategy"]).one_process and str(row["device"]).startswith("cpu"):
            lines.append(
                f"{row['run']} is one process: DataParallel splits a batch over GPUs "
                f"only, so on CPU it is single, and its speed-up is noise."
            )
            continue
        if math.isnan(row["speedup_same_cores"]):
            continue
        threads = int(row["threads"])
        lines.append(
            f"{row['run']}: {_times(row['speedup_same_cores'])} the throughput of single on one "
            f"rank's share of the cores ({threads} thread{'s' if threads > 1 else ''}), a "
            f"parallel efficiency of {_pct(row['efficiency'])}. Of its {row['step_ms']:.1f} ms "
            f"median step, {row['comm_ms']:.1f} ms ({_pct(row['comm_share'])}) was exposed "
            f"communication: gradient all-reduce that backward could not hide."
        )
        if row["speedup_all_cores"] < 1:
            slower.append(f"{row['run']} {_times(row['speedup_all_cores'])}")
    if slower:
        lines.append(
            f"Against single on all cores: {', '.join(slower)}. CPU ranks split the cores and "
            f"memory bandwidth that one process would use whole, then pay to synchronise a full "
            f"copy of the model every step. Distributing pays off with more hardware per rank "
            f"(GPUs, more machines), more compute per byte exchanged (a larger global batch or "
            f"model), or fewer all-reduces per sample (gradient accumulation)."
        )
    if (table["world_size"] == 1).any() and (table["strategy"] != registry.REFERENCE).any():
        lines.append(
            "World-size-1 rows talk to no one: the time DDP's reducer or a one-rank "
            "all-reduce took is shown as sync overhead, not communication."
        )
    return "\n".join(lines)


FILL_GUESSES = "LABKIT_FILL_GUESSES"  # "1" where nobody is there to guess: make test, CI, the site


class GuessMissing(ValueError):
    """A lesson asked for the learner's prediction and found none."""


class Guesses:
    """A lesson's predictions: what the learner guessed before a run, beside what it measured.

    The cell before a measurement holds ``my_guess_x = None``: the learner writes a guess there.
    The cell after reads it with ``ask``, which refuses None with the fix, so a prediction is
    never skipped without a word; ``measured`` records what the run gave; the summary shows
    ``table()``. Where nobody is there to guess (``LABKIT_FILL_GUESSES=1``: ``make test``, CI,
    the course site's build) ``ask`` uses ``fill`` instead, and the table says it did."""

    def __init__(self):
        self.rows: dict[str, dict] = {}

    def ask(self, name: str, value, *, fill, variable: str = "my_guess"):
        """The learner's guess for ``name`` (``value``); ``fill`` where none is needed."""
        filled = value is None
        if filled:
            if os.environ.get(FILL_GUESSES) != "1":
                raise GuessMissing(
                    f"no prediction for '{name}': write your guess in `{variable} = ...` in the "
                    f"cell above, run that cell, then run this one again (running unattended? "
                    f"set {FILL_GUESSES}=1)"
                )
            value = fill
        self.rows[name] = {"prediction": name, "your guess": value, "measured": None,
                           "filled": filled}  # fmt: skip
        return value

    def measured(self, name: str, value) -> None:
        """What the run measured for ``name`` (asked for before)."""
        if name not in self.rows:
            raise KeyError(f"'{name}' was never asked for: call ask('{name}', ...) first")
        self.rows[name]["measured"] = value

    def table(self) -> pd.DataFrame:
        """Every prediction of the lesson: your guess and what was measured; the note says
        where a guess was filled in because nobody was there to make one."""
        rows = [
            {
                "prediction": r["prediction"],
                "your guess": _shown(r["your guess"]),
                "measured": "not run" if r["measured"] is None else _shown(r["measured"]),
                "note": "filled in: nobody was asked" if r["filled"] else "",
            }
            for r in self.rows.values()
        ]
        return pd.DataFrame(rows, columns=["prediction", "your guess", "measured", "note"])


def _shown(v) -> str:
    """A guess or a measurement as text: floats to 3 significant digits, inside dicts too."""
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_shown(x)}" for k, x in v.items())
    if isinstance(v, list | tuple):
        return ", ".join(_shown(x) for x in v)
    return str(v)
