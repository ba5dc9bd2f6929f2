# Every target installs what it needs into .venv first (a fresh clone needs nothing else).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=600
# tests/unit on every core (pytest-xdist); without nbval's plugin, whose import (jsonschema's
# URI grammar) costs each process 3 s and which no unit test uses
UNIT   := -p no:nbval -n auto --dist worksteal

.PHONY: install demo test lint test-unit test-py test-nb test-browser chromium lab docs bench \
	gpu-check clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)          ## environment report, strategy comparison, equivalence check
	$(BIN)/python -m labkit demo

test: lint test-py test-nb test-browser   ## lint, pytest, every notebook under nbval, the browser test

lint: $(STAMP)          ## ruff (lint and format check), import-linter (the layers in pyproject.toml)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

test-unit: $(STAMP)     ## the fast suite, to run after every edit: no test starts a process (slow: test-py)
	$(BIN)/python -m pytest tests/unit $(UNIT) -m "not slow"

test-py: $(STAMP)       ## tests/unit, tests/ranks (ranks, subprocesses), tests/course but the browser
	$(BIN)/python -m pytest tests/unit $(UNIT) --durations=10
	$(BIN)/python -m pytest tests/ranks tests/course --durations=40 \
		--ignore=tests/course/test_browser.py

test-nb: $(STAMP)       ## every notebook under nbval; nobody is there to guess: stand-ins fill in
	LABKIT_FILL_GUESSES=1 $(BIN)/python -m pytest $(NBVAL) --durations=0 notebooks

test-browser: $(STAMP) chromium   ## JupyterLab in headless Chromium: Run All, then click
	LABKIT_REQUIRE_BROWSER=$$(test "$$(id -u)" = 0 && command -v apt-get >/dev/null && echo 1) \
	$(BIN)/python -m pytest -ra --durations=0 tests/course/test_browser.py

chromium:               ## Debian's Chromium (Playwright cannot download its own browser here)
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; \
	else \
		echo "no Chromium: the browser test will be skipped; install it: sudo apt-get install -y chromium"; \
	fi

docs: $(STAMP)          ## the course as a static site in site/ (every notebook executed, ~15 min)
	$(BIN)/python docs/build.py --out site

lab: $(STAMP)           ## JupyterLab on notebooks/, with a "labkit" kernel for this venv
	$(BIN)/python -m ipykernel install --user --name labkit --display-name "labkit (.venv)"
	$(BIN)/jupyter lab notebooks $$(test "$$(id -u)" = 0 && echo --allow-root)

bench: $(STAMP)          ## Accelerate is installed for the side-by-side only (not a dependency)
	$(BIN)/python -m pip install -q accelerate
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/ddp_overhead.py
	$(BIN)/python benchmarks/comm_overhead.py
	$(BIN)/python benchmarks/comm_drift.py
	$(BIN)/python benchmarks/load_balance.py
	$(BIN)/python benchmarks/predictions.py
	$(BIN)/python benchmarks/torchrun_exit.py
	$(BIN)/python benchmarks/elastic.py
	$(BIN)/python benchmarks/memory_precision.py
	$(BIN)/python benchmarks/sync_async.py
	$(BIN)/python benchmarks/sched_speed.py
	$(BIN)/python benchmarks/dryrun_speed.py

gpu-check: $(STAMP)     ## every strategy, check, hook, precision on CUDA/NCCL: out/gpu.{json,txt}
	$(BIN)/python -m labkit.gpu_check --out out

clean:
	rm -rf $(VENV) out site .pytest_cache
