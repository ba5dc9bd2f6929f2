"""labkit.env: the machine probe, device resolution and the oversubscription warning.

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_env.py."""

from __future__ import annotations

import json
import subprocess
import sys

from labkit import env


def test_cli_env_json_matches_the_probe(repo_root):
    done = subprocess.run(
        [sys.executable, "-m", "labkit", "env", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo_root,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(json.dumps(env.probe().to_dict()))
