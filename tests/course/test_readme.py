"""The README is a contract: every command and code block in it runs in a test.

Each fenced block of README.md and each command written inline (``python -m labkit ...``,
``python benchmarks/...``, ``torchrun ...``, ``make ...``) is found here and run, at small sizes:
a size is shrunk only by a replacement listed below, which must apply (so an edited README
fails here until its new text is run), or by a flag appended to a command (argparse keeps the
last value). A block or command that nothing runs fails ``test_every_block_and_command_is_run``.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
PY = sys.executable


@dataclass(frozen=True)
class Block:
    lang: str
    text: str
    line: int

    @property
    def key(self) -> str:
        """The block's first line that is not blank or a comment: how tests name it."""
        return next(s for s in map(str.strip, self.text.splitlines()) if s and s[0] != "#")


def blocks() -> list[Block]:
    found, lines, i = [], README.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang, start, i = lines[i][3:].strip(), i + 1, i + 1
            while not lines[i].startswith("```"):
                i += 1
            found.append(Block(lang, "\n".join(lines[start:i]) + "\n", start + 1))
        i += 1
    return found


def inline_commands() -> list[str]:
    """Commands written in the prose (not in a fenced block), as typed."""
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    starts = ("python -m labkit", "python benchmarks/", "torchrun ", "make ")
    return sorted({s for s in spans if s.startswith(starts)})


def commands(text: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def shrink(text: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert old in text, f"the README no longer says {old!r}: update tests/course/test_readme.py"
        text = text.replace(old, new)
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, cwd, timeout=300, env=None):
    r = subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    assert r.returncode == 0, (
        f"{argv}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    )
    return r


# ---- the Python blocks ----------------------------------------------------------------------

# Names a block leaves to the reader, defined before it runs.
PRELUDE = "import labkit\n"
OWN_MODEL = """
import torch
from torch import nn

cfg = labkit.RunConfig(strategy="ddp", world_size=2, steps=3)
MyModel = lambda: nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
class MyDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 512
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, x[:1] * 2
"""

# a line only one block holds -> (replacements that shrink it, code run before it)
PYTHON = {
    "labkit.env_probe()": ([("steps=50", "steps=5")], ""),
    "comm.benchmark(": ([('sizes="1KiB-16MiB"', 'sizes="1KiB-16KiB"')], ""),
    'rebalance="dynamic"': ([], ""),
    "memory.measure(": ([], ""),
    "sync_async.sweep(": ([("steps=60", "steps=16")], ""),
    "ElasticJob(": (
        [
            ("steps=100,", "steps=6,"),
            ('s["step"].max() >= 15', 's["step"].max() >= 3'),
            ('(s["world_size"] == 2).sum() >= 15', '(s["world_size"] == 2).sum() >= 3'),
        ],
        "",
    ),
    "from labkit.labs.sched import": (
        [
            ("generate(600,", "generate(60,"),
            ('replay.check(6, ["fifo", "las"])', 'replay.check(3, ["fifo"])'),
        ],
        "",
    ),
    "model_fn=lambda cfg": ([], OWN_MODEL),
}


def python_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang == "python"]


def runner(block: Block) -> tuple[list, str]:
    hits = [k for k in PYTHON if k in block.text]
    assert len(hits) == 1, (
        f"README line {block.line}: matched by {hits} in tests/course/test_readme.py"
    )
    return PYTHON[hits[0]]


@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: f"line{b.line}")
def test_python_block_runs(block, tmp_path):
    replacements, before = runner(block)
    code = PRELUDE + before + shrink(block.text, replacements)
    (tmp_path / "block.py").write_text(code)
    run([PY, "block.py"], tmp_path, timeout=420)


# ---- the bash blocks and the commands in the prose ------------------------------------------

# appended to a labkit command (argparse keeps a flag's last value): small sizes, same command
SMALL = {
    "compare": ["--steps", "3", "--width", "64"],
    "check": ["--steps", "2", "--width", "64"],
    "memory": ["--steps", "2", "--width", "64"],
    "demo": ["--steps", "3", "--width", "64"],
    "comm": ["--sizes", "1KiB-16KiB"],
    # the same dry run of a 2-layer model on 16 ranks (the 7B one takes a minute of CPU)
    "dryrun": "--world-size 16 --layers 2 --hidden 64 --heads 4 --seq-len 32 --vocab 100".split(),
}
# what a command's output must say (beyond exiting 0 without a traceback)
EXPECT = {
    "env": ['"backends"', '"max_world_size"'],
    "compare": ["== what the table says", "ddp@2", "records: out/", "report: out/", "trace: out/"],
    "check": ["all strategies match single within 1e-05"],
    "comm": ["busbw"],
    "memory": ["calculator error per category"],
    "schedule": ["fifo", "elastic", "mean"],
    "layout": ["tp"],
    "dryrun": ["memory per rank", "collectives in one step", "all_gather"],
}
# what another test runs, named so the claim can fail: (file, test function)
ELSEWHERE = {
    "make test": (
        "tests/course/test_readme.py",
        "test_make_targets_are_the_commands_the_readme_names",
    ),
    "make test-py": (
        "tests/course/test_readme.py",
        "test_make_targets_are_the_commands_the_readme_names",
    ),
    "make test-unit": (
        "tests/course/test_readme.py",
        "test_make_targets_are_the_commands_the_readme_names",
    ),
    "make test-nb": (
        "tests/course/test_readme.py",
        "test_make_targets_are_the_commands_the_readme_names",
    ),
    "make test-browser": ("tests/course/test_browser.py", "test_communication_panels_in_a_browser"),
    "make docs": (
        "tests/course/test_docs.py",
        "test_docs_build_executes_a_notebook_into_a_page_with_its_charts",
    ),
    "make bench": ("tests/ranks/test_benchmarks.py", "test_elastic_quick"),
    "make gpu-check": (
        "tests/unit/test_gpu_check.py",
        "test_without_a_gpu_every_row_is_skipped_and_says_why",
    ),
    "make lab": ("tests/course/test_readme.py", "test_make_lab_serves_the_notebooks"),
    "make demo": (
        "tests/course/test_readme.py",
        "test_demo_runs_outside_the_checkout_from_an_installed_package",
    ),
    "python -m labkit demo": (
        "tests/course/test_readme.py",
        "test_demo_runs_outside_the_checkout_from_an_installed_package",
    ),
    "python benchmarks/elastic.py": ("tests/ranks/test_benchmarks.py", "test_elastic_quick"),
    "python -m labkit schedule --generate 6 --cluster 1x2 --policy fifo,las --replay": (
        "tests/ranks/test_sched.py",
        "test_cli_replay_recalibrates_before_each_policy",
    ),
}


def labkit_commands() -> list[str]:
    """Every ``python -m labkit`` command the README shows, in blocks and in the prose."""
    in_blocks = [c for b in blocks() if b.lang == "bash" for c in commands(b.text)]
    found = {c for c in in_blocks + inline_commands() if c.startswith("python -m labkit ")}
    return sorted(found - set(ELSEWHERE))


def small(command: str) -> list[str]:
    argv = shlex.split(command)
    return [PY, *argv[1:], *SMALL.get(argv[3], [])]


@pytest.mark.parametrize("command", labkit_commands(), ids=lambda c: " ".join(c.split()[3:6]))
def test_labkit_command_runs(command, tmp_path):
    (tmp_path / "out").mkdir()
    r = run(small(command), tmp_path, timeout=420)
    assert "Traceback" not in r.stderr, r.stderr
    for words in EXPECT[command.split()[3]]:
        assert words in r.stdout, f"{command}: no {words!r} in\n{r.stdout[-3000:]}"
    if "--world-size 4" in command and (os.cpu_count() or 1) < 4:
        assert "oversubscribed" in r.stdout, r.stdout  # more ranks than cores, said


def torchrun_commands() -> list[str]:
    bash = [b for b in blocks() if b.lang == "bash"]
    return [c for b in bash for c in commands(b.text) if c.split()[0] in ("torchrun",)] + [
        c for b in bash for c in commands(b.text) if "torchrun" in c and c.split()[0] != "torchrun"
    ]


def torchrun_argv(command: str, port: int, home: Path) -> tuple[list[str], dict, int]:
    """The README's line on loopback at one process per node: argv, environment, node count."""
    env = {}
    words = shlex.split(command)
    while "=" in words[0]:  # VAR=value before the command
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    if words[0] == "srun":  # the SLURM template's line, one node
        words.pop(0)
    subst = {
        "$SLURM_NNODES": "1",
        "$HEAD": "127.0.0.1",
        "$SLURM_JOB_ID": "readme",
        "$HOME": str(home),
        "$SLURM_JOB_NAME": "labkit-elastic",
    }
    words = [re.sub(r"\$\w+", lambda m: subst.get(m.group(0), m.group(0)), w) for w in words]
    words = [
        w.replace("HOST:29400", f"127.0.0.1:{port}").replace(":29400", f":{port}") for w in words
    ]
    nnodes = words[words.index("--nnodes") + 1] if "--nnodes" in words else "1"
    nodes = int(nnodes.split(":")[0])
    words[words.index("--nproc-per-node") + 1] = "1"
    argv = [PY, "-m", "torch.distributed.run", *words[1:], "--steps", "6"]
    if ":" in nnodes and "--rdzv-conf" not in argv:  # a range of nodes: 1 s for more to join
        argv[3:3] = ["--rdzv-conf", "last_call_timeout=1"]  # (torchrun's default is 30 s)
    if "--checkpoint-every" in argv:
        argv += ["--checkpoint-every", "2"]
    if "--global-batch" in argv:
        argv += ["--global-batch", "32"]
    return argv, env, nodes


@pytest.mark.parametrize("command", torchrun_commands(), ids=lambda c: c[:60])
def test_torchrun_line_runs_on_loopback(command, tmp_path):
    argv, env, nodes = torchrun_argv(command, free_port(), tmp_path)
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
    procs = [
        subprocess.Popen(
            argv,
            cwd=tmp_path,
            env=full,
            stdout=subprocess.PIPE,
            text=True,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for _ in range(nodes)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, f"{argv}\n{out[-3000:]}"
    if "--out" in argv:
        import labkit.records

        records = labkit.records.load_records(tmp_path / argv[argv.index("--out") + 1])
        assert records["step"].max() + 1 >= 6 and records["world_size"].max() == nodes


# ---- make, the demo and its printed output ----------------------------------------------------


def make_lines() -> list[str]:
    lines = [c for b in blocks() if b.lang == "bash" for c in commands(b.text)]
    return sorted({c for c in lines + inline_commands() if c.startswith("make ")})


def make_dry(*targets: str) -> subprocess.CompletedProcess:
    """``make -n``: the commands a target would run, as a person's shell prints them (under
    ``make test`` the outer make's flags would add "Entering directory" lines)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    return subprocess.run(["make", "--no-print-directory", "-n", *targets], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip


def test_make_targets_are_the_commands_the_readme_names():
    """Each ``make X`` the README names exists; test, test-py and test-nb run what CI runs."""
    for line in make_lines():
        r = make_dry(*line.split()[1:])
        assert r.returncode == 0, f"{line}: {r.stderr}"
    dry = make_dry("test").stdout
    for step in ("ruff check", "lint-imports", "pytest tests", "--nbval-lax", "test_browser.py"):
        assert step in dry, f"make test no longer runs {step}"
    for folder in ("tests/unit", "tests/ranks", "tests/course"):
        assert folder in dry, f"make test no longer runs {folder}"
    unit = make_dry("test-unit")  # the edit loop leaves the slow unit tests to test-py
    assert "-m pytest tests/unit -p no:nbval -n auto" in unit.stdout, unit.stdout
    assert unit.stdout.strip().endswith('-m "not slow"'), unit.stdout
    assert "not slow" not in make_dry("test-py").stdout
    assert (REPO / ".ci" / "run").read_text().strip().endswith("make test")


def test_make_lab_serves_the_notebooks(tmp_path):
    """``make lab``'s recipe: a kernel for this venv, then JupyterLab on notebooks/ (started
    here on a free port without a browser, and asked for the course's first notebook)."""
    import json
    import time
    import urllib.request

    recipe = make_dry("lab")
    lines = recipe.stdout.splitlines()
    assert any("ipykernel install" in ln for ln in lines), recipe.stdout
    lab = next(ln for ln in lines if "jupyter lab" in ln)
    assert "jupyter lab notebooks" in lab, lab
    port = free_port()
    flags = f"--no-browser --port={port} --IdentityProvider.token= --ServerApp.password="
    argv = ["bash", "-c", f"exec {lab} {flags}"]  # the recipe's line, as make runs it
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline, body = time.time() + 90, None
        while time.time() < deadline and body is None:
            try:
                url = f"http://127.0.0.1:{port}/api/contents/00_environment.ipynb?content=0"
                body = json.loads(urllib.request.urlopen(url, timeout=5).read())
            except OSError:
                time.sleep(0.5)
        assert body is not None, "JupyterLab did not answer within 90 s"
        assert body["type"] == "notebook"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def demo_output_block() -> Block:
    return next(b for b in blocks() if b.lang == "" and b.key == "== environment")


def test_demo_runs_outside_the_checkout_from_an_installed_package(tmp_path):
    """``make demo`` is ``python -m labkit demo``: run it from a non-editable install of the
    checkout, in a folder outside it, and read what the README says it prints."""
    make = make_dry("demo")
    assert make.stdout.strip().endswith("-m labkit demo"), make.stdout
    site = tmp_path / "site"
    run([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(REPO)], tmp_path, timeout=300)  # fmt: skip
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {"PYTHONPATH": str(site)}
    where = run([PY, "-c", "import labkit; print(labkit.__file__)"], work, env=env).stdout
    assert where.startswith(str(site)), where
    r = run([PY, "-m", "labkit", "demo", *SMALL["demo"]], work, env=env, timeout=420)
    out = r.stdout
    for section in ("== environment", "== compare", "== what the table says",
                    "== equivalence check"):  # fmt: skip
        assert section in out, out
    assert re.search(r"^all strategies match single within 1e-05 after 5 steps$", out, re.M), out
    assert (work / "out" / "demo.json").stat().st_size > 0
    assert (work / "out" / "demo.html").stat().st_size > 0
    # the README's printed output: its sections, lines and table columns are the demo's
    shown = demo_output_block().text
    for line in shown.splitlines():
        if line.startswith("==") or line.startswith(("CPU cores", "labkit uses", "running ")):
            label = re.split(r"\d", line)[0].strip()
            assert label in out, f"the README shows {line!r}; the demo printed:\n{out}"
    header = next(ln for ln in shown.splitlines() if ln.strip().startswith("run "))
    printed = next(ln for ln in out.splitlines() if ln.strip().startswith("run "))
    for column in re.split(r"\s{2,}|(?<=s) (?=[a-z])", header.strip()):
        assert column.split()[0] in printed, f"column {column!r} of the README is not printed"
    running = next(ln for ln in shown.splitlines() if ln.startswith("running "))
    for run_label in re.findall(r"\w+@\d+", running):
        assert run_label in out, f"the README's demo runs {run_label}; the demo printed:\n{out}"


# ---- nothing left unrun -----------------------------------------------------------------------


def test_every_block_and_command_is_run():
    """Every fenced block has a runner above, and every command in the prose is run by one."""
    unrun = []
    for b in blocks():
        if b.lang == "python":
            if sum(k in b.text for k in PYTHON) != 1:
                unrun.append(f"line {b.line}: python block {b.key!r}")
        elif b.lang == "bash":
            for c in commands(b.text):
                known = (
                    c.startswith("python -m labkit ")
                    or "torchrun" in c
                    or c.startswith("make ")
                    or c.split()[0] in ("HEAD=$(scontrol", "export")
                    or c.startswith(("HEAD=", "export "))
                )
                if not known:
                    unrun.append(f"line {b.line}: command {c!r}")
        elif b.key != "== environment":
            unrun.append(f"line {b.line}: a {b.lang or 'plain'} block {b.key!r}")
    for c in inline_commands():
        if c.startswith("python -m labkit ") and c not in ELSEWHERE:
            continue  # test_labkit_command_runs
        if c not in ELSEWHERE:
            unrun.append(f"prose: {c!r}")
    for c in make_lines():
        if c not in ELSEWHERE:
            unrun.append(f"make line: {c!r}")
    for c, (path, name) in ELSEWHERE.items():
        assert f"def {name}(" in (REPO / path).read_text(), f"{c}: {path} has no {name}"
    assert not unrun, "README blocks and commands no test runs:\n" + "\n".join(unrun)
