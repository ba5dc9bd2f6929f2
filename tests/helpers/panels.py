"""What a labkit panel (labkit.widgets) shows, read from code as a learner reads it on screen."""

from __future__ import annotations


def progress_texts(panel) -> dict:
    """Per progress bar, its label and the text beside it."""
    return {row.children[0].description: row.children[1].value for row in panel.bars.children}
