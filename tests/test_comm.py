"""The communication lab: collective benchmark arithmetic, the alpha-beta fit, the step-time
predictor (exact on synthetic profiles, within a tolerance on real runs), and DDP's knobs
(accumulation, compression hooks, the PowerSGD guard) with real ranks on gloo."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from labkit import RunConfig, experiment
from labkit.labs import comm, compute_profile, equivalence
from labkit.launch import launch
from labkit.predict import collectives, step
from labkit.predict.collectives import AlphaBeta, CollectiveModel
from labkit.records import summarize

# ---- benchmark arithmetic -------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 2, 1.0),
        ("all_reduce", 4, 1.5),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 8, 0.875),
        ("broadcast", 4, 1.0),
    ],
)
def test_busbw_uses_the_nccl_tests_factor(op, n, factor):
    row = comm.row(op, 2**20, n, [0.002, 0.001, 0.003], "gloo", "cpu")
    assert row["time_s"] == 0.002
    assert row["algbw"] == pytest.approx(2**20 / 0.002 / 1e9)
    assert row["busbw"] == pytest.approx(row["algbw"] * factor)
    assert row["p10_s"] <= row["time_s"] <= row["p90_s"]


def test_sizes_parse_and_bad_ones_say_how():
    assert comm.size_range("1KiB-64KiB") == [1024, 4096, 16384, 65536]
    assert comm.size_range("4096,1MiB") == [4096, 2**20]
    for bad in ("64MiB-1KiB", "lots", "2"):
        with pytest.raises(ValueError, match="size"):
            comm.size_range(bad)


# ---- alpha-beta -----------------------------------------------------------------------------


@pytest.mark.parametrize("op", collectives.OPS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_alpha_beta_recovered_exactly_from_synthetic_times(op, n):
    truth = AlphaBeta(40e-6, 3e9)
    sizes = [2**k for k in range(10, 27, 2)]
    fitted = collectives.fit(op, n, sizes, [truth.time(op, s, n) for s in sizes])
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
    assert fitted.beta == pytest.approx(truth.beta, rel=1e-9)
    model, held = collectives.held_out_fit(op, n, sizes, [truth.time(op, s, n) for s in sizes])
    assert held and max(r["error"] for r in held) < 1e-9


def test_ring_all_reduce_formula():
    link = AlphaBeta(1e-3, 1e9)
    # 2(n-1) alpha + 2(n-1)/n S/beta at n=4, S=1e9: 6 ms + 1.5 s
    assert link.time("all_reduce", 1e9, 4) == pytest.approx(6e-3 + 1.5)
    assert link.time("all_reduce", 1e9, 1) == 0.0


# ---- the predictor on synthetic profiles (exact) --------------------------------------------


def synthetic_profile() -> step.Profile:
    """Three layers at 10 samples per rank, 1 MB of gradients each (bias 0)."""
    layer = lambda i: step.Layer(
        f"l{i}",
        forward_s=0.01,
        backward_s=0.02,  # noqa: E731
        grad_bytes=(10**6,),
        activation_bytes=1000.0,
        flops=1e6,
    )
    return step.Profile(
        batch=10, layers=tuple(layer(i) for i in range(3)), optimizer_s=0.005, data_s=0.001
    )


def test_ddp_prediction_overlaps_buckets_with_backward_exactly():
    net = CollectiveModel.uniform(AlphaBeta(0.0, 1e8))  # 1 MB all-reduce at n=2: 10 ms
    p = step.predict(synthetic_profile(), net, "ddp", 2, 20, bucket_cap_mb=0.9)
    # one bucket per layer, ready at 20, 40, 60 ms of backward; each takes 10 ms: the last
    # ends at 70 ms, backward at 60 ms -> 10 ms exposed, 20 ms hidden
    assert [b["ready_s"] for b in p.buckets] == pytest.approx([0.02, 0.04, 0.06])
    assert p.comm_total_s == pytest.approx(0.03)
    assert p.exposed_s == pytest.approx(0.01)
    assert p.hidden_s == pytest.approx(0.02)
    assert p.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.01 + 0.005)
    one = step.predict(synthetic_profile(), net, "ddp", 2, 20, bucket_cap_mb=100)
    assert one.exposed_s == pytest.approx(0.03) and len(one.buckets) == 1  # waits for all


def test_ddp_overlap_on_a_shared_core_hides_nothing():
    """gloo with no spare core: while a bucket reduces, it and backward each run at half speed."""
    net = CollectiveModel.uniform(AlphaBeta(0.0, 1e8))  # 1 MB all-reduce at n=2: 10 ms
    prof = replace(synthetic_profile(), comm_shares_core=True)
    p = step.predict(prof, net, "ddp", 2, 20, bucket_cap_mb=0.9)
    # bucket 0 ready at 20 ms, shares the core until 40 ms (10 ms of backward done, half of
    # layer 1's); layer 1 ends at 50 ms; bucket 1 shares from 50 to 70 ms; layer 0's last 10 ms
    # of backward alone to 80; bucket 2 alone from 80 to 90 ms
    times = [b[k] for b in p.buckets for k in ("ready_s", "start_s", "end_s")]
    assert times == pytest.approx([0.02, 0.02, 0.04, 0.05, 0.05, 0.07, 0.08, 0.08, 0.09])
    assert p.exposed_s == pytest.approx(0.03)  # all of the 30 ms of communication
    assert p.comm_total_s == pytest.approx(0.05)  # in flight longer, at half speed
    assert p.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.03 + 0.005)


def test_compute_after_a_wait_is_interpolated_and_added():
    prof = replace(
        synthetic_profile(), after_wait_s=((0.002, 0.004), (0.008, 0.003), (0.032, 0.010))
    )
    assert prof.after_wait(0.0) == 0.0
    assert prof.after_wait(0.001) == pytest.approx(0.002)  # on the line from (0, 0)
    assert prof.after_wait(0.008) == pytest.approx(0.004)  # never less after a longer wait
    assert prof.after_wait(0.020) == pytest.approx(0.007)
    assert prof.after_wait(1.0) == pytest.approx(0.010)  # held at the longest gap's
    net = CollectiveModel.uniform(AlphaBeta(1e-3, 1e8))  # 3 tensors x 12 ms = 36 ms
    naive = step.predict(prof, net, "ddp_naive", 2, 20)
    assert naive.after_wait_s == pytest.approx(prof.after_wait(0.036))
    assert naive.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.036 + 0.005 + naive.after_wait_s)
    assert step.predict(prof, net, "single", 1, 10).after_wait_s == 0.0  # nothing to wait for
    assert prof.on_device(1e12, "fast").after_wait(0.01) == 0.0  # not measured there


def test_naive_accumulation_and_compression_predictions():
    net = CollectiveModel.uniform(AlphaBeta(1e-3, 1e8))  # per tensor: 2 ms + 10 ms
    prof = synthetic_profile()
    naive = step.predict(prof, net, "ddp_naive", 2, 20)
    assert naive.exposed_s == pytest.approx(3 * 0.012) and naive.hidden_s == 0
    acc = step.predict(prof, net, "ddp_naive", 2, 80, accumulate=4)  # same micro-batch
    assert acc.forward_s == pytest.approx(4 * naive.forward_s)
    assert acc.comm_bytes == naive.comm_bytes  # one sync per step
    every = step.predict(prof, net, "ddp_naive", 2, 80, accumulate=4, no_sync=False)
    assert every.comm_bytes == 4 * acc.comm_bytes
    half = step.predict(prof, net, "ddp_naive", 2, 20, compression=0.5)
    assert half.exposed_s == pytest.approx(3 * (0.002 + 0.005))
    single = step.predict(prof, net, "single", 1, 10)
    assert single.exposed_s == 0 and single.step_s == pytest.approx(0.001 + 0.03 + 0.06 + 0.005)


def test_pipeline_prediction_uses_the_schedule_simulator():
    net = CollectiveModel.uniform(AlphaBeta(0.0, math.inf))
    prof = step.Profile(
        batch=4, layers=tuple(step.Layer(f"l{i}", 0.01, 0.02, ()) for i in range(2))
    )
    p = step.predict(prof, net, "pipeline_gpipe", 2, 16, microbatches=4)
    assert p.bubble == pytest.approx(1 / 5)  # (P-1)/(M+P-1) with free hand-offs
    assert p.step_s == pytest.approx(5 * 0.01 + 5 * 0.02)  # (M+P-1) forwards and backwards


def test_batch_scaling_and_device_rescaling():
    prof = synthetic_profile()
    assert prof.at_batch(20).layers[0].forward_s == pytest.approx(0.02)
    fixed = step.Profile(10, (step.Layer("l", 0.01, 0.02, (), forward_fixed_s=0.004),))
    assert fixed.at_batch(20).layers[0].forward_s == pytest.approx(0.016)
    fast = prof.on_device(1e12, "fast")
    assert fast.layers[0].forward_s == pytest.approx(1e6 * 10 / 1e12)
    with pytest.raises(ValueError, match="FLOP"):
        step.Profile(10, (step.Layer("l", 1, 1, ()),)).on_device(1e12, "x")


def test_bucket_layout_is_the_one_ddp_builds():
    def buckets(ctx, cap):
        from torch.nn.parallel import DistributedDataParallel as DDP

        m = nn.Sequential(
            nn.Linear(32, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        d = DDP(m, **({} if cap is None else {"bucket_cap_mb": cap}))
        for _ in range(12):  # buckets are rebuilt after the first step
            d(torch.randn(4, 32)).sum().backward()
        sizes = d._get_ddp_logging_data().get("rebuilt_bucket_sizes")
        return [int(s) for s in sizes.split(", ")], [p.numel() * 4 for p in m.parameters()]

    for cap in (None, 1.0, 0.05):
        got, grads = launch(buckets, 2, args=(cap,), timeout_s=120)[0]
        ready = grads[::-1]
        assert [sum(ready[i] for i in b) for b in step.bucket_layout(ready, cap)] == got, cap


# ---- real ranks -----------------------------------------------------------------------------


def test_benchmark_on_two_ranks_and_its_fit():
    table, ceilings = comm.benchmark(2, ["all_reduce", "broadcast"], "16KiB-1MiB", repeats=3)
    assert set(table["op"]) == {"all_reduce", "broadcast"} and len(table) == 8
    assert (table["time_s"] > 0).all() and (table["busbw"] > 0).all()
    assert ceilings["memcpy"] > 0 and ceilings["loopback TCP"] > 0
    fits, held = comm.fit_report(table)
    assert set(fits["op"]) == {"all_reduce", "broadcast"} and (fits["beta_GBps"] > 0).all()


@pytest.mark.flaky(reruns=2)  # timings on a shared machine; a wrong predictor misses every attempt
def test_predictor_against_a_real_world_size_2_run():
    """Tolerance, not the 15 % goal: a shared 2-core runner is noisier than a quiet machine.
    Width 1024, where compute dominates: at the default width 256 a step is a few ms of
    latency-bound all-reduces and the measured step itself varied 4-10 ms between quiet runs
    (the predictor was 30-59 % optimistic there; benchmarks/predictions.py reports both)."""
    table, _ = comm.benchmark(2, ["all_reduce"], "1KiB-16MiB", repeats=10)
    net = collectives.fit_table(table.to_dict("records"), 2)
    cfg = RunConfig(strategy="ddp", world_size=2, steps=8, global_batch=256, width=1024)
    prof = compute_profile.measure(cfg)
    assert prof.batch == 128 and len(prof.layers) == 5 and prof.grad_bytes > 0
    for strategy in ("ddp", "ddp_naive"):
        t = summarize(experiment.run(cfg.replace(strategy=strategy)).records).iloc[0]
        p = step.predict(prof, net, strategy, 2, cfg.global_batch)
        if t["busy"]:
            pytest.skip(f"the machine was busy during {strategy} (cpu share {t['cpu_share']:.2f})")
        assert abs(p.step_s * 1e3 - t["step_ms"]) / t["step_ms"] < 0.4, (
            strategy,
            p.step_s,
            t["step_ms"],
        )


def test_accumulation_matches_single_on_the_larger_batch_and_counts_bytes():
    same = equivalence.check(
        RunConfig(accumulate=4, global_batch=128), ["ddp", "ddp_naive"], steps=3
    )
    assert same["ok"].all() and (same["max_abs_diff"] <= 1e-5).all(), same
    base = RunConfig(strategy="ddp", steps=3, accumulate=4, global_batch=128)
    quiet = experiment.run(base).records
    every = experiment.run(base.replace(sync_every_microstep=True)).records
    assert (quiet["samples"] == 64).all()  # 4 micro-batches of 16 per rank
    assert (every["comm_bytes"] == 4 * quiet["comm_bytes"]).all()
    per_sample = summarize(quiet)["bytes_per_sample"].iloc[0]
    assert per_sample == pytest.approx(quiet["comm_bytes"].iloc[0] / 64)


def test_hooks_send_fewer_bytes_and_time_the_all_reduces():
    base = RunConfig(strategy="ddp", steps=3, width=128)
    plain = experiment.run(base).records
    assert (plain["comm_total_s"] > 0).all()  # timed by the hook
    assert (summarize(plain)["hidden_ms"] >= 0).all()
    for hook in ("fp16", "bf16"):
        assert (
            experiment.run(base.replace(comm_hook=hook)).records["comm_bytes"]
            == plain["comm_bytes"] // 2
        ).all()
    psgd = experiment.run(base.replace(comm_hook="powersgd", powersgd_rank=2)).records
    assert (psgd["comm_bytes"] < plain["comm_bytes"] / 4).all()


def test_powersgd_on_gloo_gets_one_bucket_instead_of_hanging():
    cfg = RunConfig(
        strategy="ddp", steps=2, width=512, comm_hook="powersgd", bucket_cap_mb=1, timeout_s=60
    )
    res = experiment.run(cfg)  # 3.2 MB of gradients in 1 MB buckets hung before
    assert any("one bucket" in n for n in res.notes), res.notes
    assert len(res.records) == 4


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(strategy="ddp_naive", comm_hook="fp16"), "DDP communication hook"),
        (dict(strategy="pipeline_1f1b", accumulate=2), "set microbatches instead"),
        (dict(accumulate=3, global_batch=64), "multiple of 6"),
        (dict(bucket_cap_mb=0), "bucket_cap_mb must be positive"),
        (dict(comm_hook="int8"), "unknown comm_hook .int8.: choose one of none, fp16"),
    ],
)
def test_bad_knobs_are_refused_with_the_fix(changes, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**changes)


def test_cli_comm_writes_json_and_refuses_bad_ops(tmp_path):
    out = tmp_path / "comm.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "labkit",
            "comm",
            "--ops",
            "all_reduce",
            "--sizes",
            "4KiB,256KiB",
            "--repeats",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "busbw" in done.stdout and "loopback TCP" in done.stdout
    data = json.loads(out.read_text())
    assert {"rows", "ceilings", "fits", "held_out"} <= set(data)
    assert {"algbw", "busbw", "p10_s", "p90_s"} <= set(data["rows"][0])
    bad = subprocess.run(
        [sys.executable, "-m", "labkit", "comm", "--ops", "all_to_all"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--ops" in bad.stderr and "all_reduce" in bad.stderr
    flag = subprocess.run(
        [sys.executable, "-m", "labkit", "compare", "--strategies", "ddp", "--accumulate", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert flag.returncode == 2 and "--accumulate" in flag.stderr


def test_the_table_reports_the_bytes_really_sent_not_the_request():
    # the message is a whole number of float32 elements per rank: at 3 ranks a 1 KiB request
    # sends 1,020 B and at 8 ranks a 16 B request 32 B; algbw is computed from what was sent
    assert comm.message_numel(3, 1024) * 4 == 1020 and comm.message_numel(8, 16) * 4 == 32
    table, _ = comm.benchmark(3, ["all_reduce"], [1024], repeats=2, ceilings=False)
    row = table.iloc[0]
    assert row["bytes"] == 1020
    assert row["algbw"] == pytest.approx(1020 / row["time_s"] / 1e9)
