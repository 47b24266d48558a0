# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench torture completions clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,wandb,trackio]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# torch only for the 0-d tensor test, and only from a local wheel: never a multi-GB download
TORCH_STAMP := $(VENV)/.torch

$(TORCH_STAMP): $(STAMP)
	-$(PY) -m pip install -q --no-deps --no-index --find-links /opt/wheels 'torch==2.13.0' 2>/dev/null \
		|| echo "torch is not available offline here; its test will skip"
	touch $(TORCH_STAMP)

test: $(STAMP) $(TORCH_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m pip install -q duckdb
	$(PY) bench/log_overhead.py
	$(PY) bench/summary.py
	$(PY) bench/daemon.py

# minutes of kill -9, a full run root and a descriptor limit (needs root: it mounts a tmpfs)
torture: $(STAMP)
	$(PY) bench/torture.py

completions: $(STAMP)
	$(PY) -m expr_cli.completions completions

clean:
	rm -rf $(VENV) build *.egg-info
