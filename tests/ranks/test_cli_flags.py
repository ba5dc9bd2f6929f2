"""Every run-shaping flag of the command line, passed end to end: each test runs
``python -m labkit ...`` in this process (``labkit.cli.main``) and reads an effect from where it
happens, the records' bytes and calls counted on the process group or the memory counted in each
rank, against the same command without the flag. A flag the CLI dropped on its way to the ranks
would leave the two runs the same."""

from __future__ import annotations

import pytest

from labkit.cli import main
from labkit.records import load_records

SMALL = ["--width", "64", "--depth", "2", "--global-batch", "32", "--dataset-size", "512"]
SMALL += ["--steps", "3", "--warmup", "2"]


@pytest.fixture
def compare(tmp_path, capsys):
    """Run ``compare`` on 2 ranks with extra flags; return its records (measured steps)."""
    runs = iter(range(100))

    def run(strategy: str, *flags: str):
        out = tmp_path / f"run{next(runs)}.json"
        argv = ["compare", "--strategies", strategy, "--world-sizes", "2", *SMALL, *flags]
        assert main([*argv, "--json", str(out)]) == 0, capsys.readouterr()
        return load_records(str(out))

    return run


def per_step(records, column: str) -> float:
    values = records.groupby("step")[column].max()
    assert values.nunique() == 1, values  # every measured step the same
    return float(values.iloc[0])


def test_comm_hook_and_bucket_cap_reach_ddp(compare):
    plain = compare("ddp")
    fp16 = compare("ddp", "--comm-hook", "fp16")
    small = compare("ddp", "--bucket-cap-mb", "0.01")  # 10 kB buckets for a 27 kB model
    assert per_step(fp16, "comm_bytes") == per_step(plain, "comm_bytes") / 2
    assert per_step(plain, "comm_calls") == 1 and per_step(small, "comm_calls") >= 2
    assert per_step(small, "comm_bytes") == per_step(plain, "comm_bytes")
    # beside single, which takes no hook: single runs plain, ddp with the hook
    both = compare("single,ddp", "--comm-hook", "fp16")
    ddp = both[both["strategy"] == "ddp"]
    assert per_step(ddp, "comm_bytes") == per_step(fp16, "comm_bytes")
    assert (both.loc[both["strategy"] == "single", "comm_bytes"] == 0).all()


def test_powersgd_rank_sets_the_factors_sent(compare):
    # PowerSGD sends (m + n) x rank per matrix: rank 2 sends more than rank 1, both far less
    # than the full gradients
    full = per_step(compare("ddp"), "comm_bytes")
    r1, r2 = (
        per_step(compare("ddp", "--comm-hook", "powersgd", "--powersgd-rank", r), "comm_bytes")
        for r in ("1", "2")
    )
    assert r1 < r2 < full / 2


def test_sync_every_microstep_sends_once_per_micro_batch(compare):
    quiet = compare("ddp", "--accumulate", "2")
    every = compare("ddp", "--accumulate", "2", "--sync-every-microstep")
    assert per_step(every, "comm_bytes") == 2 * per_step(quiet, "comm_bytes")
    assert per_step(every, "comm_calls") == 2 * per_step(quiet, "comm_calls")


@pytest.mark.parametrize(
    "flag, a, b", [("--inner-lr", "1e-3", "1e-2"), ("--outer-momentum", "0.9", "0")]
)
def test_diloco_knobs_change_its_training(compare, flag, a, b):
    runs = [compare("diloco", "--period", "2", "--warmup", "0", flag, v) for v in (a, b)]
    losses = [r.groupby("step")["loss"].first().to_numpy() for r in runs]
    assert losses[0][0] == losses[1][0]  # the same start...
    assert abs(losses[0][-1] - losses[1][-1]) > 1e-6  # ...and a different path


def test_memory_optimizer_flag_counts_adams_two_moments(capsys):
    def optimizer_bytes(*flags: str) -> float:
        wide = ["--width", "256"]  # the table rounds to 1e-4 MiB: a model of 0.3 MiB
        argv = ["memory", "--strategies", "ddp", "--world-sizes", "2", *SMALL, *wide, *flags]
        assert main(argv) == 0
        text = capsys.readouterr().out
        header, row = (line.split() for line in text.splitlines()[:2] if line.strip())
        return float(row[header.index("optimizer_mib")])

    # SGD with momentum keeps 4 bytes per parameter, Adam 8 (and one step counter per tensor)
    sgd, adam = optimizer_bytes(), optimizer_bytes("--optimizer", "adam")
    assert adam == pytest.approx(2 * sgd, rel=1e-3), (sgd, adam)
