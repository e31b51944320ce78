# One set-up for every target: a virtual environment in .venv with everything installed.
# CPU machines get the CPU torch wheel (torch==2.13.0); a machine whose python3 already has a
# CUDA torch keeps it (the venv then sees the system site-packages).
PY ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed
export PATH := $(BIN):$(PATH)
export PIP_DISABLE_PIP_VERSION_CHECK := 1
PYTEST_ARGS ?=

.PHONY: setup lab demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	  echo "keeping the CUDA torch of $(PY)"; $(PY) -m venv --system-site-packages $(VENV); \
	else $(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	# DeepSpeed builds its ops lazily; its sdist needs the installed torch at build time.
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed==0.19.8"
	touch $(STAMP)

lab: setup
	$(BIN)/jupyter lab notebooks/quickstart.ipynb

demo: setup
	$(BIN)/workbench demo

test: setup
	$(BIN)/python -m pytest -p no:cacheprovider --nbval-lax tests notebooks $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check workbench tests bench

bench: setup
	$(BIN)/python bench/bench_train.py

clean:
	rm -rf $(VENV) build *.egg-info
