"""Reading back what the GPU check (labkit.gpu_check) wrote into its --out folder."""

from __future__ import annotations

import json


def read_gpu_check(out) -> tuple[dict, list[str]]:
    """gpu.json's document and gpu.txt's lines, from the folder ``out``."""
    return json.loads((out / "gpu.json").read_text()), (out / "gpu.txt").read_text().splitlines()
