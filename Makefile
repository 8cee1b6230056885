# Two commands for a newcomer: `make demo` and `make test`. Both build .venv through `make setup`.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
STAMP := $(VENV)/.exactrl-setup

.PHONY: setup demo test test-all lint clean

setup: $(STAMP)

# Pinned CPU torch first: a bare `torch` requirement with nothing installed would pull the CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(VPY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/exactrl train configs/quickstart.toml

# --dist loadfile: a module's tests on one worker, so a module-scoped fixture (the multi-rank launches, up to two
# minutes on 2 cores) runs once, not once per worker that gets one of its tests.
test: setup
	$(VPY) -m pytest -q -n 2 --dist loadfile tests

# Everything, the extended variants too (a later -m replaces the default "not extended").
test-all: setup
	$(VPY) -m pytest -q -n 2 --dist loadfile -m "" tests

# ruff (style, imports), then mypy (types: its settings are in pyproject.toml's [tool.mypy]) on exactrl/.
lint: setup
	$(VENV)/bin/ruff check exactrl tests benchmarks
	$(VENV)/bin/ruff format --check exactrl tests benchmarks
	$(VENV)/bin/mypy exactrl

clean:
	rm -rf $(VENV) runs .pytest_cache
