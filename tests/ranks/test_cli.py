"""The command line and torchrun, as a user types them."""

import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.torchrun import torchrun_standalone

PY = sys.executable
SMALL = [
    "--width",
    "64",
    "--depth",
    "2",
    "--global-batch",
    "32",
    "--dataset-size",
    "512",
    "--warmup",
    "1",
]


def labkit(*args, timeout=300):
    return subprocess.run(
        [PY, "-m", "labkit", *args], capture_output=True, text=True, timeout=timeout
    )


def test_env_text_and_json():
    text = labkit("env")
    assert text.returncode == 0, text.stderr
    assert "labkit uses: device=" in text.stdout and "largest honest world size" in text.stdout
    data = json.loads(labkit("env", "--json").stdout)
    assert data["backends"]["gloo"] is True
    assert data["max_world_size"] >= 1 and data["cpu_cores"] >= 1


def test_compare_prints_table_and_writes_records_and_report(tmp_path):
    out, html = tmp_path / "out.json", tmp_path / "out.html"
    r = labkit(
        "compare",
        "--strategies",
        "single,dataparallel,ddp",
        "--world-sizes",
        "1,2",
        "--steps",
        "3",
        *SMALL,
        "--json",
        str(out),
        "--html",
        str(html),
    )
    assert r.returncode == 0, r.stderr
    for header in (
        "run",
        "samples/s",
        "step ms (median, slowest rank)",
        "exposed comm",
        "vs single, all cores",
        "vs single, same cores",
        "efficiency",
        "loss (global batch)",
        "== what the table says",
    ):
        assert header in r.stdout
    payload = json.loads(out.read_text())
    recs = payload["records"]
    assert {(x["strategy"], x["world_size"]) for x in recs} == {
        ("single", 1),
        ("dataparallel", 1),
        ("dataparallel", 2),
        ("ddp", 1),
        ("ddp", 2),
    }
    for x in recs:
        for key in (
            "strategy",
            "world_size",
            "rank",
            "step",
            "data_s",
            "forward_s",
            "backward_s",
            "comm_s",
            "optimizer_s",
            "step_s",
        ):
            assert key in x
    assert len([x for x in recs if x["strategy"] == "ddp" and x["world_size"] == 2]) == 2 * 3
    assert "plotly" in html.read_text()[:5_000_000]


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "--strategies", "ddp", "--world-sizes", "3"], "not divisible by world size 3"),
        (["compare", "--strategies", "zero3"], "unknown strategy 'zero3'"),
        (["compare", "--strategies", "ddp", "--device", "cuda"], "cuda"),
    ],
)
def test_bad_input_exits_2_with_the_fix(args, message):
    r = labkit(*args, *SMALL, "--steps", "2")
    if "cuda" in args and r.returncode == 0:
        pytest.skip("this machine has GPUs")
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_torchrun_standalone_runs_the_same_strategy(tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = torchrun_standalone("--strategy", "ddp", "--steps", "4", *SMALL, "--out", str(out), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = json.loads(out.read_text())["records"]
    assert sorted({x["rank"] for x in recs}) == [0, 1]
    assert sorted({x["step"] for x in recs}) == [0, 1, 2, 3]
    assert all(x["strategy"] == "ddp" and x["world_size"] == 2 for x in recs)


def test_worker_without_torchrun_says_how_to_start_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run(
        [PY, "-m", "labkit.worker", "--strategy", "ddp"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "torchrun" in r.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["compare", "--json", "/nonexistent/dir/x.json"], ["--json", "does not exist"]),
        (["compare", "--html", "/nonexistent/dir/x.html"], ["--html", "does not exist"]),
        (["compare", "--world-sizes", ""], ["--world-sizes is empty"]),
        (["compare", "--world-sizes", "2,x"], ["--world-sizes", "'x' is not a whole number"]),
        (["compare", "--strategies", ""], ["--strategies is empty"]),
        (["compare", "--lr", "-1"], ["--lr", "lr must be positive"]),
        (["compare", "--global-batch", "0"], ["--global-batch", "global_batch must be at least 1"]),
        (["check", "--strategies", "ddp,foo"], ["unknown strategy 'foo'"]),
        (["check", "--tol", "0"], ["--tol must be positive"]),
        (["check", "--strategies", "ddp", "--tp", "2"], ["--tp", "knob of tp, tp_dtensor"]),
        (
            ["check", "--strategies", "dp_tp", "--world-size", "4", "--tp", "3"],
            ["--tp", "divisor of world size 4"],
        ),
        (
            ["compare", "--strategies", "local_sgd", "--world-sizes", "2", "--skew", "0.5"],
            ["skew and rebalance", "not of local_sgd", "set strategy='ddp' or 'ddp_naive'"],
        ),
        (
            ["compare", "--strategies", "ddp_naive", "--world-sizes", "2", "--slowdown", "2:2"],
            ["--slowdown", "ranks 0..1"],
        ),
        (
            ["compare", "--strategies", "ddp_naive", "--world-sizes", "2", "--slowdown", "1:0.5"],
            ["--slowdown", "below 1"],
        ),
        (
            ["compare", "--strategies", "ddp_naive", "--world-sizes", "2", "--rebalance", "often"],
            ["--rebalance", "unknown rebalance 'often'"],
        ),
    ],
)
def test_every_argument_is_checked_before_anything_runs(args, words):
    r = labkit(args[0], *SMALL, "--steps", "2", *args[1:], timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "running" not in r.stdout  # nothing was launched
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    for w in words:
        assert w in r.stderr, r.stderr


def test_ctrl_c_stops_every_rank_and_keeps_what_finished(tmp_path):
    import signal

    import psutil

    from tests.helpers.procs import default_sigint, wait_gone

    out, html = tmp_path / "out.json", tmp_path / "out.html"
    proc = subprocess.Popen(
        [
            PY,
            "-m",
            "labkit",
            "compare",
            "--strategies",
            "single,ddp",
            "--world-sizes",
            "2",
            "--steps",
            "6000",
            *SMALL[:-2],
            "--warmup",
            "0",
            "--json",
            str(out),
            "--html",
            str(html),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    seen = []
    for line in proc.stdout:  # wait until single has finished (ddp is running)
        seen.append(line)
        if line.startswith("finished single (1 thread)"):
            break
    time.sleep(0.5)  # ddp@2 has started (it takes seconds)
    children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == [
        "labkit: interrupted: every rank stopped; 2 of 3 configurations had finished, written below"
    ], stderr
    payload = json.loads(out.read_text())
    assert {r["strategy"] for r in payload["records"]} == {"single"}  # the finished runs
    assert "plotly" in html.read_text()[:5_000_000]
    assert not wait_gone(children, 10), "processes outlived the interrupted compare"


def test_torchrun_pipeline_progress_comes_from_the_last_stage_in_measured_steps(tmp_path):
    out = tmp_path / "run.json"
    r = torchrun_standalone(
        "--strategy",
        "pipeline_gpipe",
        "--stages",
        "2",
        "--steps",
        "5",
        *SMALL,
        "--out",
        str(out),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pipeline_gpipe: step 5/5 loss " in r.stdout and "nan" not in r.stdout, r.stdout
    payload = json.loads(out.read_text())
    assert {"oversubscribed", "loss", "bubble_replay"} <= set(payload["records"][0])
    assert payload["meta"]["notes"], payload["meta"]  # the stage layout, at least


def test_torchrun_config_errors_are_said_once_with_a_fix_that_applies():
    r = torchrun_standalone("--strategy", "single", *SMALL)
    assert r.returncode != 0
    said = (r.stdout + r.stderr).count("labkit.worker: error:")
    assert said == 1 and "--nproc-per-node 1" in r.stderr, r.stderr
    assert "[rank0]: Traceback" not in r.stderr and "[rank1]: Traceback" not in r.stderr


def test_compare_balances_a_straggler_and_reads_the_table():
    r = labkit(
        "compare",
        "--strategies",
        "single,ddp_naive",
        "--world-sizes",
        "2",
        "--slowdown",
        "1:2",
        "--rebalance",
        "dynamic",
        "--rebalance-every",
        "1",
        *SMALL,
        "--steps",
        "4",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ddp_naive@2 dynamic, slow 1:2" in r.stdout and "single (" in r.stdout
    assert "of ideal (sum of solo)" in r.stdout and "waiting" in r.stdout
    if "! the machine was busy" in r.stdout:  # a busy row is flagged, not read as speed
        assert "not comparable" in r.stdout
    else:
        assert "would train alone" in r.stdout  # the plain-language reading
