# Every target installs what it needs into .venv first (a fresh clone needs nothing else).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
NBVAL  := --nbval-lax --nbval-current-env --nbval-cell-timeout=600

.PHONY: install demo test test-py test-nb lab bench clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)          ## environment report, strategy comparison, equivalence check
	$(BIN)/python -m labkit demo

test: test-py test-nb   ## pytest, then every notebook under nbval

test-py: $(STAMP)
	$(BIN)/python -m pytest tests

test-nb: $(STAMP)
	$(BIN)/python -m pytest $(NBVAL) notebooks

lab: $(STAMP)           ## JupyterLab on notebooks/, with a "labkit" kernel for this venv
	$(BIN)/python -m ipykernel install --user --name labkit --display-name "labkit (.venv)"
	$(BIN)/jupyter lab notebooks

bench: $(STAMP)
	$(BIN)/python benchmarks/launch_overhead.py
	$(BIN)/python benchmarks/ddp_overhead.py

clean:
	rm -rf $(VENV) out .pytest_cache
