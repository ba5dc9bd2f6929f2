"""Find labkit's rank processes from the outside, to prove none outlives a launch."""

from __future__ import annotations

import time

import psutil


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE  # a zombie has exited; only its entry remains
    except psutil.NoSuchProcess:
        return False


def forkservers(root: psutil.Process | None = None) -> list[psutil.Process]:
    """multiprocessing forkserver children of ``root`` (this process by default)."""
    root = root or psutil.Process()
    out = []
    for child in root.children():
        try:
            if any("multiprocessing.forkserver" in part for part in child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def live_ranks(root: psutil.Process | None = None) -> list[psutil.Process]:
    """Live (non-zombie) rank processes: the children of ``root``'s forkserver.

    The forkserver and multiprocessing's resource_tracker legitimately outlive a launch (they are
    reused by the next one); anything the forkserver forked is a rank and must be gone.
    """
    ranks = []
    for server in forkservers(root):
        try:
            ranks += [p for p in server.children() if _alive(p)]
        except psutil.NoSuchProcess:
            continue
    return ranks


def describe(procs: list[psutil.Process]) -> str:
    """pid, status and command line of each process, for an assertion message."""
    lines = []
    for p in procs:
        try:
            lines.append(f"{p.pid} {p.status()} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            lines.append(f"{p.pid} (gone)")
    return "; ".join(lines)


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as exited)."""
    try:
        return _alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids, timeout_s: float) -> list[int]:
    """Poll until none of ``pids`` runs or ``timeout_s`` passes; return those still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [pid for pid in pids if pid_alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def assert_no_ranks(grace_s: float = 1.0) -> None:
    """After a launch returns or raises, no rank may be running. A launch that returned has
    SIGKILLed its ranks and reaps them on a background thread, so give a dying rank
    ``grace_s`` to finish exiting (a rank that was never killed runs on, and fails this)."""
    wait_gone([p.pid for p in live_ranks()], grace_s)
    left = live_ranks()
    assert not left, f"rank processes outlived the launch: {describe(left)}"


def default_sigint() -> None:
    """``preexec_fn`` for a child that must hear Ctrl-C: a background job of a non-interactive
    shell starts with SIGINT ignored, and a Python child inherits SIG_IGN and never raises
    KeyboardInterrupt. Tests that send SIGINT set the disposition they rely on."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
