"""Checkpoint and exact resume; torchrun multi-node on loopback, a killed rank, nodes joining and
leaving; the faults. The torchrun tests start real agents (seconds each: slow by nature).

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_elastic.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import psutil
import pytest

from labkit import experiment
from labkit.config import RunConfig
from labkit.labs.elastic import ElasticError, ElasticJob, changes, free_port
from labkit.rank import resume
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.torchrun import torchrun_standalone

PY = sys.executable
TINY = dict(width=32, depth=2, global_batch=32, dataset_size=256, warmup=0, timeout_s=60)


@contextmanager
def refusing_writes(folder):
    """A folder nobody may write in (root ignores permissions: make it immutable instead)."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o500)
        yield
        os.chmod(folder, 0o700)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode:
        pytest.skip("running as root without chattr: cannot make a folder refuse writes")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_a_folder_refusing_writes_keeps_the_previous_checkpoint(tmp_path):
    cfg = RunConfig(strategy="single", world_size=1)
    save_checkpoint(tmp_path, cfg, step=3)
    with refusing_writes(tmp_path):
        with pytest.raises(resume.CheckpointError, match="previous one.*intact"):
            save_checkpoint(tmp_path, cfg, step=4)
    assert resume.load(str(tmp_path), cfg).step == 3
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_commands_running_several_configurations_refuse_a_checkpoint_folder(tmp_path):
    r = subprocess.run(
        [PY, "-m", "labkit", "compare", "--checkpoint-dir", str(tmp_path), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--checkpoint-dir" in r.stderr and "torchrun" in r.stderr
    assert not os.listdir(tmp_path)


# ---- exact resume (labkit.launch: no torchrun) ---------------------------------------------------


def test_ten_steps_equal_five_then_five_resumed_also_from_two_ranks_to_one(tmp_path):
    base = RunConfig(strategy="ddp", world_size=2, steps=10, deterministic=True, **TINY)
    straight = experiment.run(base).params
    folder = str(tmp_path / "a")
    first = experiment.run(base.replace(steps=5, checkpoint_dir=folder))
    assert sorted(first.records["step"].unique()) == [0, 1, 2, 3, 4]
    resumed = experiment.run(base.replace(checkpoint_dir=folder))
    assert sorted(resumed.records["step"].unique()) == [5, 6, 7, 8, 9]
    assert max((straight[k] - resumed.params[k]).abs().max().item() for k in straight) <= 1e-6
    # 2 ranks -> 1, the same global batch re-sharded: the same samples, the same update
    folder = str(tmp_path / "b")
    experiment.run(base.replace(steps=5, checkpoint_dir=folder, checkpoint_every=2))
    alone = experiment.run(base.replace(strategy="single", world_size=1, checkpoint_dir=folder))
    assert max((straight[k] - alone.params[k]).abs().max().item() for k in straight) <= 1e-5
    assert any("world size 2" in n for n in alone.notes)
    steps = [r for r in resume.read_timeline(folder) if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert [r["world_size"] for r in steps] == [2] * 5 + [1] * 5


# ---- torchrun ----------------------------------------------------------------------------------


def _no_leftovers(job):
    pids = [a.proc.pid for a in job.agents]
    job.close()
    left = [
        p
        for p in psutil.process_iter(["cmdline"])
        if job.run_id in " ".join(p.info["cmdline"] or [])
        and p.is_running()
        and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert not left and not any(
        psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids
    ), left


def test_two_agents_on_loopback_write_the_standalone_records(tmp_path):
    args = [
        "--strategy",
        "ddp",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--width",
        "32",
        "--depth",
        "2",
        "--global-batch",
        "32",
        "--dataset-size",
        "256",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    alone = tmp_path / "alone.json"
    r = torchrun_standalone(*args, "--out", str(alone), timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    port, two = free_port(), tmp_path / "two.json"
    cmd = [
        PY,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "t2",
        "--rdzv-conf",
        "join_timeout=30,last_call_timeout=1",
        "-m",
        "labkit.worker",
        *args,
        "--out",
        str(two),
    ]
    agents = [
        subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=120)[0].decode() for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    assert [a.returncode for a in agents] == [0, 0], outs
    a, b = (json.loads(p.read_text())["records"] for p in (alone, two))
    key = lambda x: (x["step"], x["rank"])  # noqa: E731
    a, b = sorted(a, key=key), sorted(b, key=key)
    assert [key(x) for x in a] == [key(x) for x in b] and set(a[0]) == set(b[0])
    assert all(x["world_size"] == 2 for x in b)
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b)) <= 1e-6


def test_a_killed_rank_is_restarted_and_resumes_from_the_checkpoint(tmp_path):
    cfg = RunConfig(strategy="ddp", steps=40, pace_s=0.05, **TINY)  # >= 2 s: time to kill
    with ElasticJob(
        cfg, nnodes="1", nproc_per_node=2, max_restarts=1, folder=str(tmp_path), checkpoint_every=5
    ) as job:
        job.add_agent()
        job.wait_for(lambda r: len(r) > 0 and r["step"].max() >= 7, timeout_s=120)
        job.kill_worker()
        job.wait(180)
        steps = job.steps()
        ch = changes(job.events, steps, job.t0)
        _no_leftovers(job)
    assert list(steps["attempt"].unique()) == [0, 1]
    first = steps[steps["attempt"] == 1]["step"].min()
    assert (first - 1) % 5 == 0  # resumed right after a checkpoint
    assert ch.iloc[0]["event"] == "kill" and ch.iloc[0]["steps_lost"] == steps[
        steps["attempt"] == 0
    ]["step"].max() - (first - 1)
    assert steps.groupby("attempt")["step"].max()[1] == 40
    starts = [r for r in resume.read_timeline(job.cfg.checkpoint_dir) if r["event"] == "start"]
    assert [s["resumed_from"] for s in starts] == [None, first - 1]
    recs = json.loads((tmp_path / "records.json").read_text())
    assert {x["attempt"] for x in recs["records"]} == {1} and recs["meta"]["timeline"]


def test_a_node_joins_and_leaves_and_the_global_batch_stays(tmp_path):
    # more steps than the test waits for (paced at >= 20 ms): the job is still running whenever
    # the next change comes, however slowly agents start; the test ends it by stopping node 0
    cfg = RunConfig(strategy="ddp", steps=100_000, pace_s=0.02, **TINY)
    with ElasticJob(cfg, nnodes="1:2", max_restarts=2, folder=str(tmp_path)) as job:
        job.add_agent()
        job.wait_for(lambda r: len(r) > 0 and r["step"].max() >= 5, timeout_s=120)
        job.add_agent()
        job.wait_for(lambda r: (r["world_size"] == 2).sum() >= 5, timeout_s=120)
        job.remove_agent(1)
        job.wait_for(
            lambda r: (
                r["attempt"].max() >= 2
                and r["world_size"].iloc[-1] == 1
                and (r["attempt"] == r["attempt"].max()).sum() >= 5
            ),
            timeout_s=120,
        )
        job.remove_agent(0)  # stop: SIGTERM, a checkpoint, exit
        job.wait(120)
        steps = job.steps()
        ch = changes(job.events, steps, job.t0)
        _no_leftovers(job)
    sizes = steps["world_size"][steps["world_size"].diff() != 0].tolist()
    assert sizes == [1, 2, 1], sizes
    assert list(ch["event"]) == ["join", "leave"] and list(ch["world_after"]) == [2, 1]
    assert list(ch["steps_lost"]) == [0, 0]  # SIGTERM: the step is finished and saved
    # every step 1..last was trained, each with the whole global batch
    last_step = int(steps["step"].max())
    assert sorted(steps["step"].drop_duplicates()) == list(range(1, last_step + 1))
    rows = [r for r in resume.read_timeline(job.cfg.checkpoint_dir) if r["event"] == "step"]
    assert {r["samples"] for r in rows} == {32}
    # the same samples, the same updates: the loss curve is the one-process curve
    ref = experiment.run(cfg.replace(strategy="single", world_size=1, steps=last_step, pace_s=0))
    last = steps.drop_duplicates("step", keep="last").set_index("step")["loss"]
    assert (last - ref.records.set_index(ref.records["step"] + 1)["loss"]).abs().max() < 1e-4
    assert resume.load(job.cfg.checkpoint_dir).step == last_step


def test_an_endpoint_nobody_serves_times_out_clearly(tmp_path):
    cfg = RunConfig(strategy="ddp", steps=2, **TINY)
    # 192.0.2.1 (TEST-NET-1) is never this machine, so the agent must connect as a client
    with ElasticJob(
        cfg,
        nnodes="1:2",
        endpoint=f"192.0.2.1:{free_port()}",
        folder=str(tmp_path),
        rdzv={"read_timeout": 3, "join_timeout": 5},
    ) as job:
        job.add_agent()
        with pytest.raises(ElasticError, match="nobody serves the rendezvous endpoint"):
            job.wait(60)
        _no_leftovers(job)


def test_a_minimum_never_reached_says_so(tmp_path):
    cfg = RunConfig(strategy="ddp", steps=2, **TINY)
    with ElasticJob(cfg, nnodes="2:2", folder=str(tmp_path), rdzv={"join_timeout": 3}) as job:
        job.add_agent()
        with pytest.raises(ElasticError, match="never reached its minimum of 2"):
            job.wait(60)
        _no_leftovers(job)


def test_plain_torchrun_survives_killed_workers_without_any_variable(tmp_path):
    """The README's command, as typed (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE): three workers
    SIGKILLed in turn, each after a checkpoint; every restart re-forms and the job ends with all
    steps. Before, a restarted group failed with gloo's connectFullMesh in 4 of 7 restarts (the
    new ranks read the dead ones' addresses from the store torchrun shares): three in a row
    passed by chance one time in eight."""
    folder = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", "-m", "labkit.worker", "--strategy", "ddp", "--steps", "90",
           "--pace-s", "0.03", "--width", "32", "--depth", "2", "--global-batch", "32",
           "--dataset-size", "256", "--checkpoint-dir", str(folder), "--checkpoint-every", "10",
           "--out", str(tmp_path / "run.json")]  # fmt: skip
    agent = subprocess.Popen(
        cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip

    def starts() -> list[dict]:
        if not folder.exists():
            return []
        return [r for r in resume.read_timeline(str(folder)) if r["event"] == "start"]

    def saved_since(n_starts: int) -> bool:
        timeline = resume.read_timeline(str(folder)) if folder.exists() else []
        after = [i for i, r in enumerate(timeline) if r["event"] == "start"][n_starts - 1 :]
        return bool(after) and any(r["event"] == "checkpoint" for r in timeline[after[0] :])

    try:
        for kill in range(1, 4):
            deadline = time.time() + 90
            while not (len(starts()) == kill and saved_since(kill)):
                assert agent.poll() is None and time.time() < deadline, (kill, starts())
                time.sleep(0.05)
            workers = [
                c for c in psutil.Process(agent.pid).children(recursive=True)
                if "labkit.worker" in " ".join(c.cmdline())
            ]  # fmt: skip
            workers[-1].kill()
        out, _ = agent.communicate(timeout=240)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, out[-3000:]
    assert "connectFullMesh" not in out
    assert [s["resumed_from"] is not None for s in starts()] == [False, True, True, True]
    recs = json.loads((tmp_path / "run.json").read_text())["records"]
    assert max(r["step"] for r in recs) == 89  # steps 0..89: every one done


def test_cleanup_counts_a_zombie_as_gone_instead_of_waiting_out_its_grace():
    # A worker killed while its parent (torchrun's agent, here a stand-in) does not reap it stays
    # a zombie: its pid exists until the parent goes. psutil.wait_procs waits out the whole
    # grace period on it (a Stop took 1.2 s with a 0.5 s grace); close() must not.
    from labkit.labs.elastic import _wait_gone

    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; w = subprocess.Popen(['sleep', '60']); "
            "print(w.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        worker = psutil.Process(int(agent.stdout.readline()))
        worker.kill()
        deadline = time.time() + 10
        while worker.status() != psutil.STATUS_ZOMBIE and time.time() < deadline:
            time.sleep(0.02)
        assert worker.status() == psutil.STATUS_ZOMBIE  # killed, not reaped by its parent
        t0 = time.monotonic()
        assert _wait_gone([worker], 5.0) == []
        assert time.monotonic() - t0 < 2.5  # half the grace: a wait for the zombie takes 5 s
    finally:
        agent.kill()
        agent.wait()
