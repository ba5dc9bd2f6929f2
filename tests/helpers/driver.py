"""A caller in its own process, for the tests that interrupt or kill it.

``python -m tests.helpers.driver`` launches 2 ranks that report their pid and then block
(rank 0 in a barrier, rank 1 asleep), printing ``PID <pid>`` as each report arrives. On
KeyboardInterrupt it prints ``INTERRUPTED`` and, measured before exiting (so the lifeline pipe
cannot be what stopped them), ``LEFT <pids>`` for rank processes still running.
"""

from __future__ import annotations

import sys

from labkit import launch

from .procs import live_ranks
from .ranks import report_pid_then_block


def _show(rank: int, metrics: dict) -> None:
    print(f"PID {metrics['pid']}", flush=True)


def main() -> int:
    try:
        launch(report_pid_then_block, 2, timeout_s=120, device="cpu", on_progress=_show)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        print("LEFT " + " ".join(str(p.pid) for p in live_ranks()), flush=True)
        return 0
    print("RETURNED without an interrupt", flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
