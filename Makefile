# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := constraints.txt
PIP := $(PY) -m pip install -q -c $(CONSTRAINTS)

.PHONY: demo test lint docs bench bench-scale torture completions clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e '.[dev,wandb,trackio,plot,export,query,gpu,serve,docs,mcp]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# torch comes only from the local CPU wheel, with its dependencies from PyPI (DDP needs
# sympy and networkx): never a multi-GB CUDA download. constraints.txt pins that build for
# every later install, so the extras below can never swap in another torch.
TORCH_WHEEL := /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
TORCH_STAMP := $(VENV)/.torch
EXTRAS_STAMP := $(VENV)/.extras
# why an optional install failed, one file per extra: tests/extras.py prints it when skipping
MISSING := $(VENV)/missing
INTEGRATIONS := transformers lightning accelerate
# expr import's readers (wandb's and pyarrow come with the base install): they need no torch,
# but its tests write TensorBoard logs with torch's SummaryWriter, so they come after it
IMPORTS := import-tensorboard import-mlflow

$(TORCH_STAMP): $(STAMP) $(CONSTRAINTS)
	@mkdir -p $(MISSING) && rm -f $(MISSING)/torch
	@if [ ! -f $(TORCH_WHEEL) ]; then \
		echo "no local wheel $(TORCH_WHEEL)" > $(MISSING)/torch; \
	elif ! $(PIP) $(TORCH_WHEEL) > $(MISSING)/torch.log 2>&1; then \
		echo "pip install $(TORCH_WHEEL) failed (see $(MISSING)/torch.log)" > $(MISSING)/torch; \
	fi
	@if [ -f $(MISSING)/torch ]; then echo "torch not installed: $$(cat $(MISSING)/torch); its tests will skip"; fi
	touch $(TORCH_STAMP)

# each integration extra on its own: one that cannot be installed skips only its own tests
$(EXTRAS_STAMP): $(TORCH_STAMP)
	@for extra in $(INTEGRATIONS); do \
		rm -f $(MISSING)/$$extra; \
		if [ -f $(MISSING)/torch ]; then \
			echo "needs torch: $$(cat $(MISSING)/torch)" > $(MISSING)/$$extra; \
		elif ! $(PIP) -e ".[$$extra]" > $(MISSING)/$$extra.log 2>&1; then \
			echo "pip install -e '.[$$extra]' failed (see $(MISSING)/$$extra.log)" > $(MISSING)/$$extra; \
		fi; \
		if [ -f $(MISSING)/$$extra ]; then echo "extra $$extra not installed: $$(cat $(MISSING)/$$extra)"; fi; \
	done
	@for extra in $(IMPORTS); do \
		rm -f $(MISSING)/$$extra; \
		if ! $(PIP) -e ".[$$extra]" > $(MISSING)/$$extra.log 2>&1; then \
			echo "pip install -e '.[$$extra]' failed (see $(MISSING)/$$extra.log)" > $(MISSING)/$$extra; \
			echo "extra $$extra not installed: $$(cat $(MISSING)/$$extra)"; \
		fi; \
	done
	touch $(EXTRAS_STAMP)

# 4 workers on 2 cores: most tests wait on real processes, not the CPU. --dist loadgroup
# keeps each xdist_group (cluster, browser, clickhouse, heavy, ...) on one worker, in turn
# (docs/cluster-testing.md, "How long the suite takes")
# 0: one process (the default, as CI runs it). 4 pytest-xdist workers take the suite to about
# 10 min on 2 cores, but of three clean runs at 4 workers one failed two timing-bound tests
# (a ClickHouse kill -9 case past its 60 s, plotext's Ctrl-C): `make TEST_WORKERS=4 test`
TEST_WORKERS ?= 0
test: $(STAMP) $(EXTRAS_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not torture" -n $(TEST_WORKERS) --dist loadgroup

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache

# the documentation site (mkdocs.yml, docs/) into site/; any warning fails it
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PIP) duckdb
	$(PY) bench/log_overhead.py
	$(PY) bench/spans.py
	$(PY) bench/summary.py
	$(PY) bench/daemon.py
	$(PY) bench/views.py
	$(PY) bench/completion.py
	-$(PY) bench/clickhouse.py
	-$(PY) bench/store_burst.py
	-$(PY) bench/imports.py
	$(PY) bench/scale.py 16384 200

# 1,024 / 4,096 / 16,384 synthetic ranks (about 1.3 GB, cached under /tmp/expr-scale-cache);
# then each expr mcp tool at 16,384 ranks
bench-scale: $(STAMP)
	$(PY) -m pip install -q duckdb
	$(PY) bench/scale.py
	$(PY) bench/mcp.py

# minutes of kill -9, a full run root and a descriptor limit (needs root: it mounts a tmpfs);
# then issue 43's soak sizes: a 20 GB NUL tail, 1,100 half-sent requests; then every reader
# against the reference on many more generated runs than `make test` tries
REFERENCE_EXAMPLES ?= 400
torture: $(STAMP)
	$(PY) bench/torture.py
	$(PY) bench/torture.py health
	$(PY) bench/hostile.py
	EXPR_REFERENCE_EXAMPLES=$(REFERENCE_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider tests/test_reference.py
	$(PY) -m pytest -q -p no:cacheprovider -m torture

completions: $(STAMP)
	$(PY) -m expr_cli.completions completions

clean:
	rm -rf $(VENV) build site *.egg-info
