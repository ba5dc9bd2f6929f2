"""labkit.worker under torchrun on this machine alone (--standalone), as a user types it."""

from __future__ import annotations

import subprocess
import sys


def torchrun_standalone(
    *worker_args: str, nproc: int = 2, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node <nproc> -m labkit.worker
    <worker_args>``, run to its end with its output captured as text (``env``: None inherits)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "labkit.worker", *worker_args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
