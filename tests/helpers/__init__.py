"""Test-only helpers: rank functions importable by reference, process inspection, and what more
than one test file uses (models and data, configs, checkpoints, readers of traces and panels)."""
