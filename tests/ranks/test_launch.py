"""labkit.launch with real rank processes (world size 2, gloo on CPU).

Every test checks that no rank process outlives the call. Rank functions come both from
``tests.helpers.ranks`` (sent by reference) and from inside the tests (closures and lambdas,
which cloudpickle can only send by value, like a function defined in a notebook cell).

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_launch.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import labkit
from labkit import LaunchCancelled, LaunchTimeout, RankError, launch
from tests.helpers import ranks
from tests.helpers.procs import assert_no_ranks, default_sigint, live_ranks, pid_alive, wait_gone

pytestmark = pytest.mark.usefixtures("no_leftover_ranks")

# Generous bounds: they catch a launcher that waits for a collective timeout (minutes) or never
# returns, not a slow machine. This is not a benchmark.
ERROR_LATENCY_S = 15.0


# ---- the leftover check itself ------------------------------------------------------------------


def test_the_leftover_check_sees_ranks_while_they_run():
    # Without this, "no rank outlived the launch" could pass because the helper sees nothing.
    seen = {}

    def on_progress(rank, metrics):
        seen[rank] = (metrics["pid"], sorted(p.pid for p in live_ranks()))

    def report_pid(ctx):
        ctx.report(pid=os.getpid())
        import torch.distributed as dist

        dist.barrier()  # both ranks are alive until both reported
        time.sleep(0.5)
        return os.getpid()

    pids = launch(report_pid, 2, timeout_s=60, device="cpu", on_progress=on_progress)
    assert sorted(pids) == sorted(pid for pid, _ in seen.values())
    assert any(listed == sorted(pids) for _, listed in seen.values()), seen
    assert_no_ranks()


# ---- results ------------------------------------------------------------------------------------


def test_results_come_back_in_rank_order_with_a_working_group():
    out = launch(ranks.whoami, 2, timeout_s=60, device="cpu")
    assert [r["rank"] for r in out] == [0, 1]
    for rank, r in enumerate(out):
        assert r["group_rank"] == r["local_rank"] == rank
        assert r["world_size"] == r["group_size"] == 2
        assert (r["device"], r["backend"], r["distributed"]) == ("cpu", "gloo", True)
        assert r["is_main"] == (rank == 0)
        assert r["rank_sum"] == 1.0  # 0 + 1: the all_reduce crossed processes
    assert out[0]["pid"] != out[1]["pid"]
    assert_no_ranks()


def test_rank_order_holds_when_the_last_rank_finishes_first():
    def slow_low_ranks(ctx, base):
        time.sleep(0.4 * (ctx.world_size - 1 - ctx.rank))  # rank 0 finishes last
        return base + ctx.rank

    assert launch(slow_low_ranks, 3, args=(10,), timeout_s=60, device="cpu") == [10, 11, 12]


def test_args_kwargs_and_world_size_one():
    def combine(ctx, a, b=0, *, scale=1):
        return (ctx.rank, ctx.world_size, (a + b) * scale)

    assert launch(
        combine, 1, args=(2,), kwargs={"b": 3, "scale": 10}, timeout_s=60, device="cpu"
    ) == [(0, 1, 50)]


def test_threads_per_rank_default_and_explicit():
    cores = labkit.env.cpu_cores()
    default = launch(ranks.whoami, 2, timeout_s=60, device="cpu")
    assert {r["threads"] for r in default} == {max(1, cores // 2)}
    explicit = launch(ranks.whoami, 2, timeout_s=60, device="cpu", threads=1)
    assert {r["threads"] for r in explicit} == {1}


def test_ranks_whose_threads_fit_the_cores_each_get_cores_of_their_own(monkeypatch):
    """What the kernel reports for each rank process (``os.sched_getaffinity`` inside it),
    against the cores this process may use: disjoint sets of ``threads`` cores when they fit;
    the caller's whole set when they do not, or with ``LABKIT_PIN=0``."""
    mine = sorted(os.sched_getaffinity(0))
    where = lambda ctx: sorted(os.sched_getaffinity(0))  # noqa: E731 (sent by value)
    if len(mine) >= 2:
        got = launch(where, 2, timeout_s=60, device="cpu", threads=1)
        assert got == [[mine[0]], [mine[1]]], got
    over = len(mine) + 1  # more ranks than cores: the OS places them
    assert launch(where, over, timeout_s=120, device="cpu", threads=1) == [mine] * over
    monkeypatch.setenv("LABKIT_PIN", "0")
    assert launch(where, 2, timeout_s=60, device="cpu", threads=1) == [mine] * 2


# ---- spawn safety and functions sent by value ---------------------------------------------------


def test_ranks_come_from_a_forkserver_not_a_fork_of_the_caller(monkeypatch):
    monkeypatch.setattr(ranks, "MARK", "changed in the caller")
    monkeypatch.setenv("LABKIT_TEST_MARK", "caller environment")
    out = launch(ranks.whoami, 2, timeout_s=60, device="cpu")
    me = os.getpid()
    for r in out:
        assert r["ppid"] != me, "a rank is a direct fork of the caller"
        parent = " ".join(psutil.Process(r["ppid"]).cmdline())
        assert "multiprocessing.forkserver" in parent
        # A fresh interpreter imported the helper module itself: the caller's change is absent...
        assert r["mark"] == "module default"
        # ...but the launch-time environment still reaches the rank (not the forkserver's own).
        assert r["env_mark"] == "caller environment"


def _gc_state(ctx):
    import gc

    return {
        "enabled": gc.isenabled(),
        "frozen": gc.get_freeze_count(),
        "young_collections": gc.get_stats()[0]["collections"],
    }


def test_ranks_collect_garbage_over_the_frozen_preload_and_only_the_server_skipped_it():
    # the forkserver preloads with collection off and freezes what it imported; ranks get it on
    out = launch(_gc_state, 2, timeout_s=60, device="cpu")
    for r in out:
        assert r["enabled"], "a rank inherited the preload's disabled garbage collector"
        assert r["frozen"] > 100_000, r  # torch's objects, frozen before the fork
        # importing torch with collection on runs ~700 young collections (counted in the
        # server, inherited by the rank); with it off, only the interpreter's start-up and the
        # rank's own few
        assert r["young_collections"] < 200, r
    import gc

    assert gc.isenabled() and "LABKIT_FORKSERVER_PRELOADING" not in os.environ


def test_closure_and_lambda_are_sent_by_value():
    offset = 41  # captured: only by-value pickling carries it

    def cell_function(ctx):
        return ctx.rank + offset

    assert "<locals>" in cell_function.__qualname__  # not importable by name anywhere
    assert launch(cell_function, 2, timeout_s=60, device="cpu") == [41, 42]
    assert launch(lambda ctx, k: ctx.rank * k, 2, args=(3,), timeout_s=60, device="cpu") == [0, 3]


def test_works_from_a_script_with_a_main_guard(tmp_path, repo_root):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import labkit

        def square(ctx, x):
            return (ctx.rank, x * x)

        if __name__ == "__main__":
            print("RESULT", labkit.launch(square, 2, args=(7,), timeout_s=60, device="cpu"))
    """)
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "RESULT [(0, 49), (1, 49)]" in done.stdout


@pytest.mark.parametrize("how", ["script", "module"])
def test_script_without_a_main_guard_runs_its_launch_once(tmp_path, how):
    # The articles write top-level scripts. multiprocessing re-imports the main module in every
    # new process, so each rank would run the top-level launch again (and fail); the ranks must
    # not import it, whether it runs as a file or with python -m.
    script = tmp_path / "flat.py"
    script.write_text(
        "import labkit\n"
        "print('LAUNCHING')\n"
        "def f(ctx):\n    return ctx.rank\n"
        "print('RESULT', labkit.launch(f, 2, timeout_s=60, device='cpu'))\n"
    )
    cmd = [sys.executable, str(script)] if how == "script" else [sys.executable, "-m", "flat"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RESULT [0, 1]" in done.stdout
    assert done.stdout.count("LAUNCHING") == 1, done.stdout


# ---- errors, timeouts, cancel -------------------------------------------------------------------


def test_a_raising_rank_is_named_with_its_traceback_and_peers_are_stopped():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(ranks.raise_on, 2, args=(1, "boom from the bad rank"), timeout_s=120, device="cpu")
    elapsed = time.monotonic() - t0
    assert_no_ranks()
    err = info.value
    assert err.rank == 1 and err.world_size == 2
    assert "rank 1 of 2" in str(err)
    assert "ValueError: boom from the bad rank" in str(err)
    assert "ValueError: boom from the bad rank" in err.traceback
    assert "raise_on" in err.traceback  # the rank's own frames, not the launcher's
    # rank 0 was blocked in a barrier with a 120 s timeout: it had to be stopped, not awaited
    assert elapsed < ERROR_LATENCY_S, f"error took {elapsed:.1f} s to surface"


def test_a_notebook_function_raising_on_rank_0():
    def broken(ctx):
        if ctx.rank == 0:
            {}["missing key"]
        return ctx.rank

    with pytest.raises(RankError) as info:
        launch(broken, 2, timeout_s=60, device="cpu")
    assert info.value.rank == 0
    assert "KeyError: 'missing key'" in info.value.traceback
    assert "in broken" in info.value.traceback


@pytest.mark.parametrize(
    "how, expect",
    [
        ("exit", "exited with code 7"),
        ("kill", "SIGKILL"),
    ],
)
def test_a_rank_dying_outside_python_is_named(how, expect):
    def die(ctx, how):
        if ctx.rank == 1:
            if how == "exit":
                os.write(2, b"native last words\n")
                os._exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        import torch.distributed as dist

        dist.barrier()
        return ctx.rank

    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(die, 2, args=(how,), timeout_s=120, device="cpu")
    assert time.monotonic() - t0 < ERROR_LATENCY_S
    assert info.value.rank == 1
    assert expect in str(info.value)
    assert info.value.exitcode == (7 if how == "exit" else -signal.SIGKILL)
    if how == "exit":
        assert info.value.stderr_tail == "native last words"
        assert "native last words" in str(info.value)


def test_a_rank_dying_before_it_runs_the_function_shows_its_stderr(capfd):
    with pytest.raises(RankError) as info:
        launch(ranks.whoami, 2, args=(ranks.DiesWhenUnpickled("no tensors for you"),), timeout_s=60)
    assert info.value.exitcode == 9
    assert info.value.stderr_tail == "no tensors for you"
    assert "stderr ended with:\nno tensors for you" in str(info.value)
    # and every rank's stderr reaches the caller's, marked with the rank
    assert "[rank 0] no tensors for you" in capfd.readouterr().err


def test_a_result_that_cannot_be_sent_back_names_the_rank():
    def returns_a_lock(ctx):
        return threading.Lock() if ctx.rank == 1 else ctx.rank

    with pytest.raises(RankError) as info:
        launch(returns_a_lock, 2, timeout_s=60, device="cpu")
    assert info.value.rank == 1
    assert "cannot be sent back" in str(info.value)


def test_a_hang_is_bounded_by_timeout_s_and_says_where():
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(ranks.hang_forever, 2, timeout_s=3, device="cpu")
    elapsed = time.monotonic() - t0
    assert_no_ranks()
    assert 3 <= elapsed < 3 + ERROR_LATENCY_S
    err = info.value
    assert isinstance(err, TimeoutError)
    assert sorted(err.stacks) == [0, 1] and err.rank == 0
    assert "timeout_s" in str(err)
    for stack in err.stacks.values():  # faulthandler dumps where each rank was
        assert "hang_forever" in stack
    assert "hang_forever" in str(err)


def test_a_collective_that_a_peer_never_joins_times_out_cleanly():
    def one_rank_waits(ctx):
        import torch.distributed as dist

        if ctx.rank == 0:
            dist.barrier()
        time.sleep(600)

    with pytest.raises(LaunchTimeout) as info:
        launch(one_rank_waits, 2, timeout_s=3, device="cpu")
    assert sorted(info.value.stacks) == [0, 1]


def test_cancel_event_stops_every_rank():
    cancel = threading.Event()
    timer = threading.Timer(1.0, cancel.set)
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(LaunchCancelled):
            launch(ranks.hang_forever, 2, timeout_s=120, device="cpu", cancel=cancel)
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < ERROR_LATENCY_S
    assert_no_ranks()


# ---- progress and back-to-back launches ---------------------------------------------------------


def test_progress_streams_while_ranks_run(tmp_path):
    # Each rank reports, then waits for a file that only the caller's on_progress creates: if
    # reports were delivered at the end instead of live, the ranks would wait until timeout.
    flag = str(tmp_path / "heard")
    seen: list[tuple[int, dict]] = []

    def on_progress(rank, metrics):
        seen.append((rank, metrics))
        open(f"{flag}{rank}", "w").close()

    def reports_then_waits(ctx, flag):
        ctx.report(step=0, loss=1.5)
        deadline = time.monotonic() + 30
        while not os.path.exists(f"{flag}{ctx.rank}"):
            if time.monotonic() > deadline:
                raise RuntimeError("the caller never saw this rank's progress while it ran")
            time.sleep(0.02)
        ctx.report(step=1, loss=0.5)
        return "done"

    out = launch(
        reports_then_waits, 2, args=(flag,), timeout_s=60, device="cpu", on_progress=on_progress
    )
    assert out == ["done", "done"]
    for rank in (0, 1):
        assert [m for r, m in seen if r == rank] == [
            {"step": 0, "loss": 1.5},
            {"step": 1, "loss": 0.5},
        ]


@pytest.mark.slow
def test_twelve_back_to_back_launches_never_collide():
    for i in range(12):
        out = launch(ranks.whoami, 2, timeout_s=60, device="cpu")
        assert [r["rank_sum"] for r in out] == [1.0, 1.0], f"launch {i}"
        assert_no_ranks()
    # a failed launch in between must not poison the next one
    with pytest.raises(RankError):
        launch(ranks.raise_on, 2, args=(0, "x"), timeout_s=60, device="cpu")
    assert [r["rank"] for r in launch(ranks.whoami, 2, timeout_s=60, device="cpu")] == [0, 1]


@pytest.mark.slow
def test_ranks_that_never_communicate_start_and_stop_cleanly():
    # A rank that returns at once tears its group down while a slower peer may still be inside
    # init_process_group; without a barrier after init, the peer fails "Gloo connectFullMesh
    # failed ... Connection closed by peer" (here ~1 launch in 60). Many lessons' first cell is
    # exactly such a function, so 40 in a row must all succeed.
    def rank_only(ctx):
        return ctx.rank

    failures = []
    for i in range(40):
        try:
            assert launch(rank_only, 2, timeout_s=60, device="cpu") == [0, 1]
        except RankError as exc:
            failures.append(f"launch {i}: {str(exc).splitlines()[-1][:160]}")
    assert not failures, failures


def test_two_launches_at_once_from_threads():
    # A notebook's background Run thread and a cell may launch together: separate stores/ports.
    results, errors = {}, []

    def run(tag):
        try:
            results[tag] = launch(ranks.whoami, 2, timeout_s=60, device="cpu")
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert all([r["rank_sum"] for r in results[tag]] == [1.0, 1.0] for tag in ("a", "b"))


# ---- the caller interrupted or killed -----------------------------------------------------------


def _start_driver(repo_root) -> tuple[subprocess.Popen, list[int]]:
    """Start tests.helpers.driver in its own session; return it and its 2 rank pids."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.driver"],
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=default_sigint,
    )
    pids = []
    deadline = time.monotonic() + 60
    while len(pids) < 2:
        line = proc.stdout.readline()  # blocks; the driver flushes every line
        if not line:
            proc.kill()
            raise AssertionError(f"driver ended before its ranks started: {proc.stderr.read()}")
        if line.startswith("PID "):
            pids.append(int(line.split()[1]))
        assert time.monotonic() < deadline, "ranks did not report their pids within 60 s"
    return proc, pids


def test_sigint_to_the_process_group_stops_every_rank(repo_root):
    # What a Jupyter interrupt or Ctrl-C in a terminal does: SIGINT to the whole group.
    proc, pids = _start_driver(repo_root)
    try:
        time.sleep(0.3)  # rank 0 is now inside its barrier
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        _kill_group(proc.pid)
    assert proc.returncode == 0, f"driver exit {proc.returncode}:\n{out}\n{err}"
    assert "INTERRUPTED" in out
    left_line = [ln for ln in out.splitlines() if ln.startswith("LEFT")][0]
    assert left_line.strip() == "LEFT", f"ranks still running inside the caller: {left_line}"
    assert elapsed < ERROR_LATENCY_S
    assert wait_gone(pids, 5) == []


def test_ranks_exit_by_themselves_when_the_caller_is_killed(repo_root):
    proc, pids = _start_driver(repo_root)
    try:
        proc.kill()  # SIGKILL: no finally, no cleanup code runs
        proc.wait(10)
        left = wait_gone(pids, 10)
    finally:
        for pid in pids:  # never leave strays behind a failed test
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        _kill_group(proc.pid)
    assert left == [], f"ranks {left} outlived their killed caller (lifeline pipe)"


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a driver's process group (its forkserver, resource tracker)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---- from a Jupyter kernel ----------------------------------------------------------------------


@pytest.fixture
def kernel(repo_root):
    """A fresh ipykernel in this venv (cwd: the repo), and a client to run cells in it."""
    jupyter_client = pytest.importorskip(
        "jupyter_client", reason="jupyter_client is not installed here"
    )
    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(repo_root))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run_cell(kc, code: str, timeout: float = 120) -> tuple[dict, str]:
    """Execute ``code``; return the reply content and everything the cell printed."""
    out: list[str] = []

    def collect(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    for _ in range(3):
        reply = kc.execute_interactive(code, timeout=timeout, output_hook=collect)
        # right after an interrupted cell, ipykernel aborts a request that reaches it while it
        # still clears its queue (stop_on_error): never run, so sending it again is the same cell
        if reply["content"]["status"] != "aborted":
            break
    return reply["content"], "".join(out)


def test_from_a_jupyter_kernel_launch_and_interrupt(kernel, tmp_path):
    km, kc = kernel
    # A function defined in a cell lives in the kernel's __main__: it can only go by value.
    reply, out = _run_cell(
        kc,
        textwrap.dedent("""
        import os, labkit
        def cell_fn(ctx, k):
            return (ctx.rank, ctx.world_size, k * (ctx.rank + 1), os.getppid() != KERNEL_PID)
        KERNEL_PID = os.getpid()
        print("RESULT", labkit.launch(cell_fn, 2, args=(5,), timeout_s=60, device="cpu"))
    """),
    )
    assert reply["status"] == "ok", out
    assert "RESULT [(0, 2, 5, True), (1, 2, 10, True)]" in out

    # Interrupt a running launch the way the Jupyter UI does (SIGINT to the kernel's group).
    pid_file = tmp_path / "pids"
    msg_id = kc.execute(
        textwrap.dedent(f"""
        from tests.helpers.ranks import report_pid_then_block
        def write_pid(rank, metrics):
            with open({str(pid_file)!r}, "a") as f:
                f.write(f"{{metrics['pid']}}\\n")
        labkit.launch(report_pid_then_block, 2, timeout_s=120, device="cpu",
                      on_progress=write_pid)
    """)
    )
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and len(pid_file.read_text().split()) == 2):
        assert time.monotonic() < deadline, "ranks in the kernel never reported their pids"
        time.sleep(0.05)
    pids = [int(p) for p in pid_file.read_text().split()]
    time.sleep(0.3)
    t0 = time.monotonic()
    km.interrupt_kernel()
    while True:
        msg = kc.get_shell_msg(timeout=30)
        if msg["parent_header"].get("msg_id") == msg_id:
            break
    assert time.monotonic() - t0 < ERROR_LATENCY_S
    assert msg["content"]["status"] == "error"
    assert msg["content"]["ename"] == "KeyboardInterrupt"
    assert wait_gone(pids, 5) == [], "ranks outlived the interrupted cell"

    # The kernel is still usable and holds no rank process; the next launch works.
    reply, out = _run_cell(
        kc,
        textwrap.dedent("""
        from tests.helpers.procs import live_ranks
        print("LEFT", len(live_ranks()))
        print("AGAIN", labkit.launch(cell_fn, 2, args=(1,), timeout_s=60, device="cpu"))
    """),
    )
    assert reply["status"] == "ok", out
    assert "LEFT 0" in out
    assert "AGAIN [(0, 2, 1, True), (1, 2, 2, True)]" in out


def test_a_script_read_from_standard_input_launches_ranks():
    # python - <<EOF: the main module's __file__ is '<stdin>', which every rank tried to import
    # (FileNotFoundError in every rank, and advice about a __main__ guard that did not apply)
    script = (
        "import torch, torch.distributed as dist, labkit\n"
        "def f(ctx):\n"
        "    t = torch.ones(1) * (ctx.rank + 1)\n"
        "    dist.all_reduce(t)\n"
        "    return t.item()\n"
        "print(labkit.launch(f, world_size=2))\n"
    )
    r = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[3.0, 3.0]"


def test_the_kernel_interrupt_stops_a_panel_run_whose_click_came_on_another_thread(kernel):
    """JupyterLab 4.6 delivers a widget's clicks on a kernel subshell thread once a message
    changed the button (a 'cannot run' state). Python installs signal handlers only from the
    main thread, so a handler set up lazily inside the click never existed and Interrupt did not
    stop the run. Here the panel is built in a cell (main thread) and Run is clicked from
    another thread; a real SIGINT to the kernel must stop the run and every rank."""
    km, kc = kernel
    reply, out = _run_cell(
        kc,
        textwrap.dedent("""
        import threading
        from labkit import RunConfig
        from labkit.widgets import pipeline_panel
        panel = pipeline_panel(RunConfig(strategy="pipeline_1f1b", width=64, depth=3,
                                         global_batch=32, dataset_size=512, steps=1000,
                                         pace_s=0.02, warmup=1))
        panel.stages.value = 2
        threading.Thread(target=panel.run_button.click, name="subshell-1").start()
    """),
    )
    assert reply["status"] == "ok", out
    deadline = time.monotonic() + 60
    while True:  # until the ranks report steps
        reply, out = _run_cell(
            kc, "print('STEP', max([b.children[0].value for b in panel.bars.children] or [0]))"
        )
        if int(out.split()[-1]) >= 3:
            break
        assert time.monotonic() < deadline, out
        time.sleep(0.3)
    t0 = time.monotonic()
    km.interrupt_kernel()
    reply, out = _run_cell(
        kc,
        "panel.wait(10); print('ALIVE', panel._thread.is_alive(), '|', panel.stopped_by)",
    )
    assert "ALIVE False | the kernel's Interrupt" in out, out
    assert time.monotonic() - t0 < 5
    reply, out = _run_cell(
        kc, "from tests.helpers.procs import live_ranks; print('LEFT', len(live_ranks()))"
    )
    assert "LEFT 0" in out
