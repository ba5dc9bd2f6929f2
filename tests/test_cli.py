"""The command line and torchrun, as a user types them."""
import json
import os
import subprocess
import sys

import pytest

PY = sys.executable
SMALL = ["--width", "64", "--depth", "2", "--global-batch", "32", "--dataset-size", "512",
         "--warmup", "1"]


def labkit(*args, timeout=300):
    return subprocess.run([PY, "-m", "labkit", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_env_text_and_json():
    text = labkit("env")
    assert text.returncode == 0, text.stderr
    assert "labkit uses: device=" in text.stdout and "largest honest world size" in text.stdout
    data = json.loads(labkit("env", "--json").stdout)
    assert data["backends"]["gloo"] is True
    assert data["max_world_size"] >= 1 and data["cpu_cores"] >= 1


def test_compare_prints_table_and_writes_records_and_report(tmp_path):
    out, html = tmp_path / "out.json", tmp_path / "out.html"
    r = labkit("compare", "--strategies", "single,dp,ddp", "--world-sizes", "1,2", "--steps", "3",
               *SMALL, "--json", str(out), "--html", str(html))
    assert r.returncode == 0, r.stderr
    for header in ("run", "samples/s", "step ms (median, slowest rank)", "exposed comm",
                   "vs single, all cores", "vs single, same cores", "efficiency",
                   "loss (global batch)", "== what the table says"):
        assert header in r.stdout
    payload = json.loads(out.read_text())
    recs = payload["records"]
    assert {(x["strategy"], x["world_size"]) for x in recs} == {
        ("single", 1), ("dp", 1), ("dp", 2), ("ddp", 1), ("ddp", 2)}
    for x in recs:
        for key in ("strategy", "world_size", "rank", "step", "data_s", "forward_s", "backward_s",
                    "comm_s", "optimizer_s", "step_s"):
            assert key in x
    assert len([x for x in recs if x["strategy"] == "ddp" and x["world_size"] == 2]) == 2 * 3
    assert "plotly" in html.read_text()[:5_000_000]


def test_check_passes_for_data_parallel_strategies():
    r = labkit("check", "--strategies", "single,dp,ddp,ddp_naive", "--world-size", "2", *SMALL)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all strategies match single" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["compare", "--strategies", "ddp", "--world-sizes", "3"], "not divisible by world size 3"),
    (["compare", "--strategies", "zero3"], "unknown strategy 'zero3'"),
    (["compare", "--strategies", "ddp", "--device", "cuda"], "cuda"),
])
def test_bad_input_exits_2_with_the_fix(args, message):
    r = labkit(*args, *SMALL, "--steps", "2")
    if "cuda" in args and r.returncode == 0:
        pytest.skip("this machine has GPUs")
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_torchrun_standalone_runs_the_same_strategy(tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "labkit.worker", "--strategy", "ddp", "--steps", "4", *SMALL,
                        "--out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    recs = json.loads(out.read_text())["records"]
    assert sorted({x["rank"] for x in recs}) == [0, 1]
    assert sorted({x["step"] for x in recs}) == [0, 1, 2, 3]
    assert all(x["strategy"] == "ddp" and x["world_size"] == 2 for x in recs)


def test_worker_without_torchrun_says_how_to_start_it():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    r = subprocess.run([PY, "-m", "labkit.worker", "--strategy", "ddp"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and "torchrun" in r.stderr
