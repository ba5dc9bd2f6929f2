"""Large-transformer memory under any layout (labkit.predict.memory) and the layout advisor
(labkit.predict.layout): the ZeRO paper's Figure 1, Korthikanti's activation formulas and the
tensor/pipeline splits on hand-computed cases; the advisor's choices on cases whose answer is
known; Megatron-LM's published weak-scaling table (SC'21) against the advisor's predictions;
the ``layout`` command. Pure arithmetic: no rank process is started (one CLI subprocess).

Here, the tests that run ranks or subprocesses; the rest: tests/unit/test_layout.py."""

from __future__ import annotations

import json
import subprocess
import sys

# ---- the command --------------------------------------------------------------------------------


def test_layout_command_prints_and_writes_the_ranked_layouts(tmp_path):
    out = tmp_path / "layouts.json"
    args = ["--layers", "24", "--hidden", "2304", "--heads", "24", "--seq", "2048"]
    args += ["--vocab", "51200", "--gpus", "16", "--gpus-per-node", "8"]
    args += ["--device", "A100 80GB", "--global-batch", "128", "--top", "5", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "labkit", "layout", *args], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "tp" in lines[0] and "TFLOP/s/GPU" in lines[0] and len(lines) >= 6
    assert "published" in done.stdout and "assumption" in done.stdout and "6 x" in done.stdout
    rows = json.loads(out.read_text())
    keys = {"tp", "pp", "dp", "zero", "microbatch", "mem_per_gpu_bytes", "fits", "step_s"}
    assert keys | {"tflops_per_gpu"} <= set(rows[0])
    assert rows[0]["fits"] and all(r["tp"] * r["pp"] * r["dp"] == 16 for r in rows)
    fitting = [r["step_s"] for r in rows if r["fits"]]
    assert fitting == sorted(fitting)
