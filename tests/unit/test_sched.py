"""The scheduling lab: every policy on tiny hand-computed traces (exact JCTs), the trace format's
errors, determinism by seed, the CLI's argument checks and the real replay on a 3-job trace.

Here, what starts no process; the tests that run ranks or subprocesses:
tests/ranks/test_sched.py."""

from __future__ import annotations

import pytest

from labkit.labs.sched import sim, traces
from labkit.labs.sched.jobs import PRESETS, Curve, Job

LINEAR = PRESETS["linear"]  # throughput = workers (samples/s)


def job(jid, arrival, gpus, duration, priority=0, curve=LINEAR, **kw):
    return Job(jid, arrival, gpus, duration * curve(gpus), curve, priority, **kw)


def run(jobs, cluster, policy, **kw):
    res = sim.simulate(jobs, cluster, policy, **kw)
    return {j.job_id: round(j.jct_s, 6) for j in res.jobs}, res


def test_progress_is_reported_and_a_stop_request_abandons_the_simulation(monkeypatch):
    monkeypatch.setattr(sim, "REPORT_EVERY_S", 0.0)  # report at every event: no clock involved
    jobs = traces.generate(200, rate_per_hour=traces.rate_for_load(1.0, 8), seed=3)
    seen = []
    res = sim.simulate(jobs, "1x8", "las", on_progress=lambda done, total: seen.append(done))
    assert seen == sorted(seen) and seen[-1] == 200 and len(set(seen)) > 10
    assert all(j.finish_s is not None for j in res.jobs)

    asked = []

    def stop_on_the_tenth_report():
        asked.append(1)
        return len(asked) == 10

    with pytest.raises(sim.SimulationStopped, match=r"stopped after \d+ of 200 jobs"):
        sim.simulate(jobs, "1x8", "las", should_stop=stop_on_the_tenth_report)
    assert len(asked) == 10  # asked at every report until told to stop, never again after


# A needs both GPUs for 10 s; B and C one each, arriving while A runs.
ABC = [job(0, 0, 2, 10), job(1, 1, 1, 5), job(2, 2, 1, 3)]


def test_fifo_runs_in_arrival_order():
    got, res = run(ABC, "1x2", "fifo")
    assert got == {0: 10, 1: 14, 2: 11}  # B and C start when A frees its GPUs at 10
    assert res.metrics()["restarts_per_job"] == 0
    assert res.metrics()["mean_queue_s"] == pytest.approx((0 + 9 + 8) / 3)


def test_srtf_preempts_the_longer_job():
    got, res = run(ABC, "1x2", "srtf")
    # t=1: B (5 s left) evicts A (9 s left); t=2: C takes the idle GPU; A resumes at 6 (9 s)
    assert got == {0: 15, 1: 5, 2: 3}
    assert [j.restarts for j in res.jobs] == [1, 0, 0]


def test_srtf_with_two_running_jobs_preempts_the_one_with_most_left_now():
    # 2 GPUs. A (0 s, 10 s) and B (5 s, 8 s) run; C (6 s, 5 s) arrives: at 6, A has 4 s left
    # and B 7 s, so C evicts B. Exact preemptive SRPT: A 10, C 11, B 17 (JCTs 10, 12, 5).
    jobs = [job(0, 0, 1, 10), job(1, 5, 1, 8), job(2, 6, 1, 5)]
    got, res = run(jobs, "1x2", "srtf")
    assert {j.job_id: j.finish_s for j in res.jobs} == {0: 10, 1: 17, 2: 11}, got
    assert [j.restarts for j in res.jobs] == [0, 1, 0]


def srpt_reference(arrivals, sizes, servers: int) -> list[float]:
    """Exact preemptive shortest-remaining-processing-time on ``servers`` identical servers,
    stepped from event to event: at every moment the ``servers`` jobs with the least remaining
    work run (ties: arrival order). Written apart from labkit's simulator, as the reference."""
    n, t, left = len(sizes), 0.0, list(sizes)
    done, finish = [False] * n, [0.0] * n
    while not all(done):
        present = [i for i in range(n) if arrivals[i] <= t + 1e-12 and not done[i]]
        running = sorted(present, key=lambda i: (left[i], arrivals[i], i))[:servers]
        future = [a for a in arrivals if a > t + 1e-12]
        step = min([left[i] for i in running] + [min(future) - t] if future else
                   [left[i] for i in running])  # fmt: skip
        if not running:
            t = min(future)
            continue
        for i in running:
            left[i] -= step
        t += step
        for i in running:
            if left[i] <= 1e-9:
                done[i], finish[i] = True, t
    return finish


def test_srtf_equals_exact_srpt_on_several_servers():
    import random

    rng = random.Random(7)
    t, arrivals, sizes = 0.0, [], []
    for _ in range(300):  # M/M/4 at load 0.9: jobs queue and preempt each other often
        t += rng.expovariate(4 * 0.9)
        arrivals.append(round(t, 3))
        sizes.append(round(rng.expovariate(1.0), 3) + 0.001)
    want = srpt_reference(arrivals, sizes, servers=4)
    jobs = [job(i, a, 1, d) for i, (a, d) in enumerate(zip(arrivals, sizes))]
    res = sim.simulate(jobs, "1x4", "srtf")
    got = [j.finish_s for j in sorted(res.jobs, key=lambda j: j.job_id)]
    assert got == pytest.approx(want, abs=1e-6)


def test_priority_does_not_evict_its_own_priority():
    # all priority 0: job 1 (2 GPUs) waits for job 0 and job 2 as under FIFO; before, it
    # evicted job 2 (which had arrived after it) and finished at 15 instead of 107
    jobs = [job(0, 0, 1, 10), job(1, 1, 2, 5), job(2, 2, 1, 100)]
    fifo, _ = run(jobs, "1x2", "fifo")
    got, res = run(jobs, "1x2", "priority")
    assert {j.job_id: j.finish_s for j in res.jobs} == {0: 10, 1: 107, 2: 102}
    assert got == fifo and sum(j.restarts for j in res.jobs) == 0


def test_one_priority_level_is_fifo_on_a_loaded_trace():
    jobs = traces.generate(400, seed=3, rate_per_hour=60.0)  # priority 0 throughout
    assert {j.priority for j in jobs} == {0}
    fifo = sim.simulate(jobs, "2x8", "fifo").metrics()
    prio = sim.simulate(jobs, "2x8", "priority").metrics()
    assert fifo["mean_queue_s"] > 0  # loaded: jobs do wait
    assert prio["mean_jct_s"] == pytest.approx(fifo["mean_jct_s"])
    assert prio["restarts_per_job"] == 0


def test_priority_preempts_and_charges_the_restart():
    jobs = [job(0, 0, 2, 10, restart_s=1.0), job(1, 2, 1, 4, priority=1), job(2, 3, 1, 2)]
    got, res = run(jobs, "1x2", "priority")
    # t=2: B (high) evicts A (8 s left); C backfills 3-5; A restarts at 6: 1 s + 8 s
    assert got == {0: 15, 1: 4, 2: 2}
    m = res.metrics()
    assert m["mean_jct_high_s"] == 4 and m["mean_jct_low_s"] == pytest.approx(8.5)


def test_las_demotes_at_the_threshold():
    jobs = [job(0, 0, 1, 10), job(1, 1, 1, 3)]
    got, _ = run(jobs, "1x1", "las", thresholds=(4,))
    # A holds the GPU until its 4 GPU-seconds demote it; B runs 4-7; A finishes its 6 s at 13
    assert got == {0: 13, 1: 6}
    assert run(jobs, "1x1", "fifo")[0] == {0: 10, 1: 12}


def test_maxmin_and_ftf_time_share_by_rounds():
    jobs = [job(0, 0, 1, 10), job(1, 1, 1, 10)]
    # round 5: B has run 0 % of its time (A 100 %) -> B; round 10: A 50 % < B 56 % -> A to 15
    assert run(jobs, "1x1", "maxmin", round_s=5)[0] == {0: 15, 1: 19}
    # ftf: rho(A) = (5 + 5) / 10 = 1.0 < rho(B) = (4 + 10) / 10 = 1.4 -> B; at 10: 1.5 > 1.4 -> A
    assert run(jobs, "1x1", "ftf", round_s=5)[0] == {0: 15, 1: 19}


def test_elastic_gives_spare_gpus_to_the_largest_gain():
    curve = Curve("sub", ((1, 1.0), (2, 1.5), (4, 2.0)))  # gains 0.5, 0.25, 0.25
    jobs = [job(0, 0, 1, 10, curve=curve), job(1, 0, 1, 10, curve=curve)]
    got, res = run(jobs, "1x4", "elastic", round_s=5)
    # 0-5 one worker each (5 of 10 done); round 5: the two spare GPUs, one each -> 1.5/s
    assert got == {0: pytest.approx(5 + 5 / 1.5), 1: pytest.approx(5 + 5 / 1.5)}
    assert [j.restarts for j in res.jobs] == [1, 1]  # a resize is a restart
    alone, _ = run(jobs[:1], "1x4", "elastic", round_s=5)
    assert alone == {0: 7.5}  # grows to 4 workers: 2/s


def test_spread_placement_pays_the_interconnect_penalty():
    curve = Curve("half", ((1, 1.0), (2, 2.0)), spread_factor=0.5)
    jobs = [job(0, 0, 2, 10, curve=curve)]
    assert run(jobs, sim.Cluster(2, 2, "consolidated"), "fifo")[0] == {0: 10}
    got, res = run(jobs, sim.Cluster(2, 2, "spread"), "fifo")
    assert got == {0: 20} and res.gantt[0]["spread"]


def test_startup_cost_and_gantt():
    jobs = [job(0, 0, 1, 4, startup_s=1.0), job(1, 0, 1, 2)]
    got, res = run(jobs, "1x1", "fifo")
    assert got == {0: 5, 1: 7}
    assert [(g["job_id"], g["start_s"], g["end_s"], g["ready_s"]) for g in res.gantt] == [
        (0, 0, 5, 1.0),
        (1, 5, 7, 5),
    ]
    m = res.metrics()
    assert m["makespan_s"] == 7 and m["utilisation"] == 1.0 and m["gpu_hours"] == 7 / 3600


def test_every_policy_finishes_every_job_and_is_deterministic():
    jobs = traces.generate(
        200,
        rate_per_hour=traces.rate_for_load(1.0, 32),
        seed=3,
        high_priority=0.2,
        curves=("good", "poor"),
    )
    from labkit.labs.sched.policies import POLICIES

    for p in POLICIES:
        first, again = sim.simulate(jobs, "4x8", p), sim.simulate(jobs, "4x8", p)
        a = first.metrics()
        assert a == again.metrics() and a["jobs"] == 200, p
        # held GPUs never exceed the cluster, nor a node its GPUs, at any moment (a sweep over
        # the Gantt's segment ends: what the simulator allocated, not what it summed up)
        edges = sorted(
            [(g["start_s"], 1, g) for g in first.gantt] + [(g["end_s"], 0, g) for g in first.gantt],
            key=lambda e: (e[0], e[1]),
        )
        per_node = [0] * 4
        for _, starts, g in edges:
            for node, count in g["nodes"]:
                per_node[node] += count if starts else -count
            assert max(per_node) <= 8 and sum(per_node) <= 32, (p, per_node)
        for j in first.jobs:  # and each job ran exactly its work: segments x speed
            done = sum(
                j.curve(g["gpus"], g["spread"]) * (g["end_s"] - g["ready_s"])
                for g in first.gantt if g["job_id"] == j.job_id
            )  # fmt: skip
            assert done == pytest.approx(j.work, rel=1e-6), (p, j.job_id)


def test_generator_is_seeded_and_follows_the_mix():
    a = traces.to_csv(traces.generate(2000, seed=7))
    assert a == traces.to_csv(traces.generate(2000, seed=7))
    assert a != traces.to_csv(traces.generate(2000, seed=8))
    jobs = traces.generate(4000, seed=1)
    share = {g: sum(j.gpus == g for j in jobs) / len(jobs) for g in (1, 2, 4, 8)}
    assert share[1] == pytest.approx(0.70, abs=0.03) and share[8] == pytest.approx(0.05, abs=0.02)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(jobs, jobs[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(3600 / 30, rel=0.08)  # 30 per hour
    d = sorted(j.duration_alone_s for j in jobs)
    assert d[-1] / d[len(d) // 2] > 20  # a heavy tail


def test_csv_round_trip():
    jobs = traces.generate(20, seed=2, high_priority=0.5, curves=("good", "poor"))
    back = traces.parse_csv(traces.to_csv(jobs))
    assert [(j.job_id, j.gpus, j.priority, j.curve.name) for j in back] == [
        (j.job_id, j.gpus, j.priority, j.curve.name) for j in jobs
    ]
    assert [j.work for j in back] == pytest.approx([j.work for j in jobs], rel=1e-6)


HEADER = "job_id,arrival_s,gpus,priority,duration_s,curve\n"


@pytest.mark.parametrize(
    "body, message",
    [
        (
            "0,0,1,0,10,good\n1,5,two,0,10,good\n",
            "line 3, column gpus: 'two' is not a whole number",
        ),
        ("0,0,1,0,10,good\n1,5,1,0,-3,good\n", "line 3, column duration_s: '-3' must be > 0"),
        (
            "0,0,1,0,10,good\n0,5,1,0,3,good\n",
            "line 3, column job_id: '0' repeats the id of line 2",
        ),
        ("0,0,1,0,10,nope\n", "line 2, column curve: 'nope' is not a known curve"),
        ("0,0,0,0,10,good\n", "line 2, column gpus: '0' must be >= 1"),
        ("0,x,1,0,10,good\n", "line 2, column arrival_s: 'x' is not a number"),
        ("0,0,1,0\n", "line 2: 4 values for 6 columns"),
    ],
)
def test_csv_errors_name_row_and_column(body, message):
    with pytest.raises(ValueError) as err:
        traces.parse_csv(HEADER + body)
    assert message in str(err.value)


def test_csv_header_and_cluster_errors():
    with pytest.raises(ValueError, match="line 1: the header lacks column.*curve"):
        traces.parse_csv("job_id,arrival_s,gpus,priority,duration_s\n0,0,1,0,1\n")
    with pytest.raises(ValueError, match="asks for 8 GPUs but the cluster has 4"):
        sim.simulate([job(0, 0, 8, 1)], "1x4", "fifo")
    with pytest.raises(ValueError, match="NODESxGPUS"):
        sim.Cluster.parse("4by8")
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        sim.simulate([job(0, 0, 1, 1)], "1x4", "lifo")


class Out:
    def __init__(self, code, captured):
        self.returncode, self.stdout, self.stderr = code, captured.out, captured.err


@pytest.fixture
def cli(capsys):
    """``python -m labkit schedule ...`` in this process (a subprocess per case costs seconds of
    imports); one subprocess test below checks the real entry point."""
    from labkit.__main__ import main

    def call(*args):
        capsys.readouterr()
        code = main(["schedule", *args])
        return Out(code, capsys.readouterr())

    return call


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--generate", "50", "--cluster", "4y8"], "--cluster"),
        (["--generate", "0"], "--generate"),
        (["--generate", "50", "--policy", "fifo,lifo"], "--policy"),
        (["--generate", "50", "--policy", ""], "--policy"),
        (["--generate", "50", "--load", "-1"], "--load"),
        (["--trace", "/nonexistent/t.csv"], "--trace"),
        (["--generate", "50", "--json", "/nonexistent/x.json"], "--json"),
        (["--generate", "50", "--cluster", "1x4"], "--cluster"),  # 8-GPU jobs cannot fit
        (["--generate", "5", "--replay", "--cluster", "4x8"], "--replay"),
    ],
)
def test_cli_errors_name_the_flag(cli, args, flag):
    out = cli(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert flag in out.stderr


def test_replay_checks_its_input_before_running():
    from labkit.labs.sched import replay

    with pytest.raises(ValueError, match="3 to 12 jobs"):
        replay.small_trace(2)
    with pytest.raises(ValueError, match="unknown policy"):
        replay.check(
            3,
            ["fifo", "nope"],
            calibration=replay.Calibration({1: 1.0, 2: 1.5}, {1: 0.1, 2: 0.1}, 0.0),
        )


@pytest.mark.parametrize("name", ["maxmin", "ftf"])
def test_round_policies_rank_in_numpy_exactly_as_their_keys_sort(name):
    """maxmin and ftf rank a loaded cluster's jobs in numpy (the simulator's hot spot at 120 %
    load); the same trace ranked by sorting ``key`` must give every job the same finish time."""
    from labkit.labs.sched.policies import Policy, make_policy

    fast = make_policy(name)
    plain = make_policy(name)
    plain.rank = lambda states, now: Policy.rank(plain, states, now)  # sorted by key
    cluster = sim.Cluster.parse("16x8")
    jobs = traces.generate(800, rate_per_hour=traces.rate_for_load(1.5, 128), seed=4)
    # up to 175 jobs at once here: numpy's path (from 64) is the one taken
    a, b = ([j.finish_s for j in sim.simulate(jobs, cluster, p).jobs] for p in (fast, plain))
    assert a == b and len(a) == 800


@pytest.mark.parametrize("name", ["maxmin", "ftf", "elastic"])
def test_round_policies_push_a_finish_only_for_the_coming_round(name):
    """On a loaded cluster maxmin and ftf stop most jobs before they finish; the simulator
    pushes a job's FINISH event only at the last round before it. Against a FINISH pushed at
    every start: every job's finish time, restarts and Gantt the same, and far fewer events."""
    cluster = sim.Cluster.parse("4x8")
    jobs = traces.generate(400, rate_per_hour=traces.rate_for_load(1.5, 32), seed=2)
    runs = []
    for defer in (True, False):
        s = sim.Simulator(jobs, cluster, name)
        s.defer_finishes = defer
        runs.append(s.run())
    deferred, eager = runs
    assert [(j.finish_s, j.restarts) for j in deferred.jobs] == [
        (j.finish_s, j.restarts) for j in eager.jobs
    ]
    assert deferred.gantt == eager.gantt and deferred.events <= eager.events
    if name != "elastic":  # they rotate GPUs among the queued jobs every round
        assert sum(j.restarts for j in eager.jobs) > 400
        assert deferred.events < eager.events / 2, (deferred.events, eager.events)


def test_generated_jobs_pay_the_measured_start_and_the_metrics_show_it():
    """Generated traces charge this machine's measured start and restart (not zero); the
    share of GPU time spent starting is read from the simulation, against a hand count: one
    GPU, job A (0 s, 100 s of work, restarts cost 5 s) evicted at 10 s by B (priority 1, 20 s):
    A holds the GPU 10 + 5 + 90 s, B 20 s; 5 of the 125 GPU-seconds are a restart."""
    jobs = traces.generate(3, seed=0)
    assert {(j.startup_s, j.restart_s) for j in jobs} == {(traces.STARTUP_S, traces.RESTART_S)}
    assert traces.STARTUP_S > 0 and traces.RESTART_S > 0
    unit = Curve("unit", ((1, 1.0),))
    a = Job(0, 0.0, 1, 100.0, unit, priority=0, restart_s=5.0)
    b = Job(1, 10.0, 1, 20.0, unit, priority=1)
    res = sim.simulate([a, b], sim.Cluster.parse("1x1"), "priority")
    finish = {j.job_id: j.finish_s for j in res.jobs}
    assert finish == {0: 125.0, 1: 30.0}
    m = res.metrics()
    assert m["gpu_hours"] * 3600 == 125.0 and m["start_share"] == 5.0 / 125.0


def test_a_replay_is_busy_when_its_calibration_or_a_replayed_run_was():
    """The notebook's bound on the replay's error widens only on a busy machine: one whose
    calibration, or one of whose replayed runs, finished with the ranks' CPU share below the
    busy mark; a quiet one keeps the tight bound."""
    import pandas as pd

    from labkit.labs.sched import replay
    from labkit.records import BUSY_SHARE

    def report(cal_busy: bool, segments: list[dict]) -> replay.ReplayReport:
        cal = replay.Calibration({1: 1.0, 2: 1.5}, {1: 0.1, 2: 0.1}, 0.0, busy=cal_busy)
        return replay.ReplayReport(
            cal, [], pd.DataFrame(), pd.DataFrame(), real={"fifo": ([], segments)}
        )

    quiet, loaded = {"job_id": 0, "busy": False}, {"job_id": 1, "busy": True}
    assert not report(False, [quiet, quiet]).busy
    assert report(False, [quiet, loaded]).busy
    assert report(True, [quiet]).busy
    assert replay._busy(pd.DataFrame({"compute_cpu_share": [BUSY_SHARE / 2] * 3}))
    assert not replay._busy(pd.DataFrame({"compute_cpu_share": [0.95] * 3}))
