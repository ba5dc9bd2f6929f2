"""Test-only helpers: rank functions importable by reference, and process inspection."""
