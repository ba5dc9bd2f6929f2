"""The sync/async lab with real ranks on gloo: local SGD with H=1 is DDP, every rank holds the
same parameters right after an averaging round (and not between rounds), DiLoCo's outer step on
a hand-computed example, the parameter server's staleness bookkeeping on a scripted schedule and
over real messages, Hogwild's updates landing in the one shared model, the straggler, and the
to-target reading on synthetic records. Speed claims live in benchmarks/sync_async.py.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_sync_async.py."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from labkit.labs import sync_async
from labkit.records import config_label
from labkit.strategies import diloco, hogwild
from labkit.strategies.async_ps import ParameterServer
from tests.helpers.configs import SYNC_ASYNC_BASE as BASE

# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(strategy="local_sgd", period=0), "period must be at least 1"),
        (dict(strategy="diloco", outer_lr=0), "outer_lr must be positive"),
        (dict(strategy="diloco", outer_momentum=1.0), r"outer_momentum must be in \[0, 1\)"),
        (dict(strategy="async_ps", world_size=1), "set world_size to 2 or more"),
        (dict(strategy="async_ps", world_size=3, slowdown="0:2"), "slow down a worker instead"),
        (dict(strategy="hogwild", accumulate=2, global_batch=32), "accumulate=1"),
        (dict(strategy="local_sgd", skew=0.5), "set strategy='ddp' or 'ddp_naive'"),
        (dict(strategy="async_ps", world_size=3, global_batch=33), "divisible by 2 workers"),
    ],
)
def test_config_errors_name_the_fix(changes, match):
    with pytest.raises(ValueError, match=match):
        BASE.replace(**changes)


def test_straggler_is_allowed_on_the_labs_modes_and_async_ps_batches_per_worker():
    for mode in ("ddp", "local_sgd", "diloco", "hogwild"):
        assert BASE.replace(strategy=mode, slowdown="1:3").slowdown == ((1, 3.0, None),)
    ps = BASE.replace(strategy="async_ps", world_size=3, global_batch=64)
    assert ps.data_ranks == 2 and ps.batch_per_rank == 32
    labels = [config_label(c) for c in sync_async.sweep(BASE, straggler=3)]
    assert labels == [
        "ddp@2 slow 1:3",
        "local_sgd@2 H=4, slow 1:3",
        "diloco@2 H=4, slow 1:3",
        "async_ps@3 slow 1:3",
        "hogwild@2 slow 1:3",
    ]


# ---- DiLoCo's outer step ---------------------------------------------------------------------


def test_diloco_outer_step_by_hand():
    theta = [torch.tensor([1.0, 2.0])]
    local = [torch.tensor([0.5, 2.5])]
    outer = diloco.outer_optimizer(theta, lr=0.7, momentum=0.9)
    diloco.outer_step(theta, local, outer)
    # delta = theta - local = [0.5, -0.5]; momentum buffer = delta; Nesterov: delta + 0.9 * buf
    # = 1.9 delta; theta -= 0.7 * 1.9 * delta
    assert torch.allclose(theta[0], torch.tensor([0.335, 2.665]))
    assert torch.equal(local[0], theta[0])  # every rank restarts from theta
    local[0].copy_(torch.tensor([0.235, 2.665]))  # delta = [0.1, 0]
    diloco.outer_step(theta, local, outer)
    # buf = 0.9 [0.5, -0.5] + [0.1, 0] = [0.55, -0.45]; step = [0.1, 0] + 0.9 buf = [0.595, -0.405]
    assert torch.allclose(theta[0], torch.tensor([0.335 - 0.7 * 0.595, 2.665 + 0.7 * 0.405]))


def test_diloco_outer_step_averages_the_delta_over_ranks():
    theta, local = [torch.zeros(2)], [torch.tensor([1.0, 1.0])]
    outer = diloco.outer_optimizer(theta, lr=1.0, momentum=0.0)
    seen = []

    def average(t):  # as if the other rank's delta were [-3, -3]
        seen.append(t.clone())
        t.copy_((t + torch.tensor([-3.0, -3.0])) / 2)

    diloco.outer_step(theta, local, outer, average)
    assert torch.equal(seen[0], torch.tensor([-1.0, -1.0]))
    assert torch.equal(theta[0], torch.tensor([2.0, 2.0]))  # outer lr 1, no momentum: the mean


# ---- the parameter server --------------------------------------------------------------------


def sgd(params, lr=0.1):
    return torch.optim.SGD(params, lr=lr)


@pytest.mark.parametrize("staleness_lr", [False, True])
def test_parameter_server_bookkeeping_on_a_scripted_schedule(staleness_lr):
    ps = ParameterServer(torch.zeros(2), sgd, staleness_lr=staleness_lr)
    g = torch.ones(2)
    _, va = ps.pull()  # worker A and B both pull version 0
    _, vb = ps.pull()
    _, vc = ps.pull()  # and C
    assert ps.push("A", g, va) == 0  # -> version 1
    assert ps.push("B", g, vb) == 1  # computed on 0, applied at 1 -> version 2
    _, va = ps.pull()  # A pulls version 2
    assert ps.push("C", g, vc) == 2  # -> version 3
    assert ps.push("A", g, va) == 1  # -> version 4
    assert [r["staleness"] for r in ps.log] == [0, 1, 2, 1]
    assert [r["worker"] for r in ps.log] == ["A", "B", "C", "A"] and ps.version == 4
    scales = [1, 1, 0.5, 1] if staleness_lr else [1, 1, 1, 1]
    assert [r["lr_scale"] for r in ps.log] == scales
    assert torch.allclose(ps.pull()[0], -0.1 * sum(scales) * g)
    with pytest.raises(ValueError, match="newer than the server's"):
        ps.push("B", g, 9)


# ---- Hogwild ---------------------------------------------------------------------------------


def test_hogwild_views_share_one_buffer(tmp_path):
    path = str(tmp_path / "flat.bin")
    open(path, "wb").truncate(4 * 10)
    a, b = hogwild.shared_buffer(path, 10), hogwild.shared_buffer(path, 10)
    model = torch.nn.Linear(2, 2)  # 6 parameters
    hogwild.share_parameters(model, a[:6])
    with torch.no_grad():
        model.weight.add_(1.0)  # an optimizer step, in place
    assert torch.equal(b[:4], model.weight.detach().reshape(-1))


# ---- to a target loss, on synthetic records --------------------------------------------------


def synthetic() -> pd.DataFrame:
    common = dict(world_size=2, global_batch=4, threads=1, compute_cpu_share=1.0, variant="")
    rows = []
    for step, loss in enumerate([2.0, 1.5, 1.0]):  # ddp: 2 ranks, 2 samples each
        for rank in (0, 1):
            rows.append(
                dict(
                    common,
                    strategy="ddp",
                    rank=rank,
                    step=step,
                    loss=loss,
                    shard_loss=loss,
                    samples=2,
                    start_s=step,
                    step_s=0.5 + rank * 0.25,
                    comm_bytes=100,
                )
            )
    for i, (rank, loss, stale) in enumerate([(0, 2.0, 0), (1, 1.8, 1), (0, 1.2, 1), (1, 0.9, 2)]):
        rows.append(
            dict(
                common,
                strategy="hogwild",
                rank=rank,
                step=i // 2,
                shard_loss=loss,
                loss=math.nan,
                samples=2,
                start_s=0.1 * i,
                step_s=0.1,
                comm_bytes=0,
                staleness=stale,
            )
        )
    return pd.DataFrame(rows)


def test_to_target_reads_updates_time_samples_and_bytes():
    table = sync_async.to_target(synthetic(), target=1.6, window=1).set_index("run")
    ddp, hog = table.loc["ddp@2"], table.loc["hogwild@2"]
    # ddp: step 2 (loss 1.5) ends when rank 1 does: 1 + 0.75 s; 8 samples; 2 ranks x 2 x 100 B
    assert (ddp["updates_to_target"], ddp["seconds_to_target"]) == (2, 1.75)
    assert (ddp["samples_to_target"], ddp["bytes_to_target"]) == (8, 400)
    # hogwild: updates in landing order, the third (loss 1.2) lands at 0.3 s
    assert (hog["updates_to_target"], hog["seconds_to_target"]) == (3, pytest.approx(0.3))
    assert (hog["samples_to_target"], hog["bytes_to_target"]) == (6, 0)
    assert hog["staleness_max"] == 2 and ddp["averaging_rounds"] == 3
    assert math.isnan(sync_async.to_target(synthetic(), 0.1, window=1)["updates_to_target"][0])
    st = sync_async.staleness(synthetic())
    assert st.set_index("staleness")["count"].to_dict() == {0: 1, 1: 2, 2: 1}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--strategies", "local_sgd", "--period", "0"], "--period: period must be at least 1"),
        (["--strategies", "diloco", "--outer-lr", "-1"], "--outer-lr: outer_lr must be positive"),
        (["--strategies", "local_sgd", "--skew", "0.5"], "a straggler alone (slowdown) also works"),
    ],
)
def test_cli_bad_lab_flags_exit_2_naming_the_flag(args, message, capsys):
    from labkit.cli import main  # in process: refused before anything runs

    assert main(["compare", "--world-sizes", "2", "--steps", "2", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_straggler_prediction_sync_at_the_slowest_pace_async_at_the_mean():
    from labkit.predict.step import straggler_throughput

    assert straggler_throughput([1, 3], "ddp") == pytest.approx(1 / 3)
    assert straggler_throughput([1, 3], "local_sgd") == pytest.approx(1 / 3)
    assert straggler_throughput([1, 3], "async_ps") == pytest.approx((1 + 1 / 3) / 2)
    assert straggler_throughput([1, 1], "hogwild") == 1.0
    with pytest.raises(ValueError, match="unknown mode"):
        straggler_throughput([1, 2], "zero3")
