"""A lesson's predictions: never skipped silently, filled only where nobody can guess, and shown
beside what was measured."""

from __future__ import annotations

import pytest

from labkit.report import FILL_GUESSES, Guesses, GuessMissing


def test_a_missing_guess_stops_the_lesson_with_the_fix(monkeypatch):
    monkeypatch.delenv(FILL_GUESSES, raising=False)
    g = Guesses()
    with pytest.raises(GuessMissing, match="my_guess_idle = ...` in the cell above"):
        g.ask("idle share", None, fill=0.25, variable="my_guess_idle")
    assert g.ask("idle share", 0.4, fill=0.25) == 0.4  # the learner's own, as written


def test_where_nobody_guesses_the_fill_is_used_and_the_table_says_so(monkeypatch):
    monkeypatch.setenv(FILL_GUESSES, "1")
    g = Guesses()
    assert g.ask("idle share", None, fill=0.25) == 0.25
    assert g.ask("held", {"gpipe": 4}, fill={"gpipe": 1}) == {"gpipe": 4}
    g.measured("idle share", 0.3333333)
    t = g.table().set_index("prediction")
    assert (
        t.loc["idle share", "your guess"] == "0.25" and t.loc["idle share", "measured"] == "0.333"
    )
    assert t.loc["idle share", "note"] == "filled in: nobody was asked"
    assert t.loc["held", "note"] == "" and t.loc["held", "measured"] == "not run"
    with pytest.raises(KeyError, match="never asked"):
        g.measured("bubble", 0.1)
