"""Checkpoint and exact resume; torchrun multi-node on loopback, a killed rank, nodes joining and
leaving; the faults. The torchrun tests start real agents (seconds each: slow by nature).

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_elastic.py."""

import os
import resource
import signal

import pytest
import torch
from torch import nn

from labkit.config import RunConfig
from labkit.labs.elastic import check_nnodes
from labkit.rank import resume
from tests.helpers.checkpoints import save_checkpoint

# ---- the file ----------------------------------------------------------------------------------


def test_save_load_round_trip_and_rng(tmp_path):
    cfg = RunConfig(strategy="single", world_size=1)
    model = nn.Linear(4, 2)
    torch.manual_seed(7)
    save_checkpoint(tmp_path, cfg, 5, model)
    expected = torch.rand(3)
    torch.rand(10)  # move the stream on
    ck = resume.load(str(tmp_path), cfg)
    assert ck.step == 5 and ck.world_size == 1 and ck.fingerprint == resume.fingerprint(cfg)
    assert all(torch.equal(ck.model[k], v) for k, v in model.state_dict().items())
    resume.set_rng_state(ck.rng[0])
    assert torch.equal(torch.rand(3), expected)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temp file left


def test_truncated_foreign_and_other_run_are_refused(tmp_path):
    cfg = RunConfig(strategy="single", world_size=1)
    path = save_checkpoint(tmp_path, cfg)
    raw = open(path, "rb").read()
    open(path, "wb").write(raw[:-100])
    with pytest.raises(resume.CheckpointError, match="truncated"):
        resume.load(path)
    open(path, "wb").write(raw[:-1] + bytes([raw[-1] ^ 1]))
    with pytest.raises(resume.CheckpointError, match="SHA-256"):
        resume.load(path)
    torch.save({"model": {}}, path)  # a plain torch file
    with pytest.raises(resume.CheckpointError, match="not a labkit checkpoint"):
        resume.load(path)
    open(path, "wb").write(raw)
    with pytest.raises(resume.CheckpointError, match="different run.*fingerprint"):
        resume.load(path, cfg.replace(lr=0.01))
    assert resume.load(path, cfg.replace(steps=99)).step == 3  # steps may change


def test_a_full_disk_mid_write_keeps_the_previous_checkpoint(tmp_path):
    cfg = RunConfig(strategy="single", world_size=1)
    save_checkpoint(tmp_path, cfg, step=3)
    size = os.path.getsize(tmp_path / "checkpoint.pt")
    # files may not grow past 4 KiB for a moment: the write of a bigger model fails half-way
    # (EFBIG, as a full disk's ENOSPC would), after the temporary file was created
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(resume.CheckpointError, match="previous one.*intact"):
            save_checkpoint(tmp_path, cfg, step=9, model=nn.Linear(256, 256))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert resume.load(str(tmp_path), cfg).step == 3
    assert os.path.getsize(tmp_path / "checkpoint.pt") == size
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


@pytest.mark.parametrize(
    "changes_, words",
    [
        (dict(checkpoint_every=5), "needs a folder: set checkpoint_dir"),
        (dict(checkpoint_dir="x", checkpoint_every=-1), "checkpoint_every must be >= 0"),
        (dict(checkpoint_dir="x", strategy="pipeline_gpipe"), "saves the shared training loop"),
        (dict(checkpoint_dir="x", strategy="ddp_naive", slowdown="1:2"), "load-balancing"),
    ],
)
def test_config_checks(changes_, words):
    with pytest.raises(ValueError, match=words):
        RunConfig(**{"strategy": "ddp", "world_size": 2, **changes_})


@pytest.mark.parametrize("nnodes", ["0:2", "3:2", "x"])
def test_nnodes_that_can_never_be_met(nnodes):
    with pytest.raises(ValueError, match="can never be met|is not N or MIN:MAX"):
        check_nnodes(nnodes)
    with pytest.raises(ValueError, match="needs at least 2 agents"):
        check_nnodes("2:3", agents=1)


def test_several_nodes_with_restarts_on_a_shared_store_are_refused_naming_the_variable(
    monkeypatch,
):
    from labkit.dist import refuse_shared_store_restarts

    for name, value in (("TORCHELASTIC_USE_AGENT_STORE", "True"),
                        ("TORCHELASTIC_MAX_RESTARTS", "3"), ("GROUP_WORLD_SIZE", "2")):  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        refuse_shared_store_restarts()
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one node: its restart count keys the store
    refuse_shared_store_restarts()
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the variable was set
    refuse_shared_store_restarts()
