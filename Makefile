# Set-up on a fresh machine: `make demo` (install + the main job) and `make test` (install + tests).
# The venv gets the CPU build of torch when it has no torch; GPU users install their own torch
# first (e.g. VENV_FLAGS=--system-site-packages to reuse a system-wide CUDA torch).
VENV ?= .venv
VENV_FLAGS ?=
PY := $(VENV)/bin/python
TORCH_CPU := torch==2.13.0

.PHONY: demo test install clean gpu-truth

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV_FLAGS) $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/autoplan search --model gpt2-1.5b --mem 8GB

# the suite on 2 processes (pytest-xdist), a test file per process at a time: a file's module-scoped launches and
# measurements run once; the torchrun tests start their own ranks beside the other process's tests
test: $(VENV)/.installed
	$(PY) -m pytest -n 2 --dist loadfile

# on a machine with a GPU: profile it, run the fake-world memory grid and single-GPU runs (at most 20 min);
# results in benchmarks/results/gpu_truth/ (see benchmarks/gpu_truth.py for a machine without a package index)
gpu-truth: $(VENV)/.installed
	$(PY) benchmarks/gpu_truth.py --device cuda

clean:
	rm -rf $(VENV) build *.egg-info
