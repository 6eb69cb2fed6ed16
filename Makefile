# Two commands do everything on a fresh machine: `make book` and `make test` (what CI runs). Two more test tiers:
# `make test-site` (the browser checks of the site `make book` builds) and `make gpu-test` (on an NVIDIA GPU).
# VENV may point at an existing environment (e.g. VENV=$CONDA_PREFIX after `conda env create`).
VENV ?= .venv
# TORCH_INDEX: a wheel index to take torch from first (the publishing workflow, CPU only, sets
# https://download.pytorch.org/whl/cpu: same version, without PyPI's multi-GB CUDA libraries).
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvwall-installed
BOOK_FLAGS := --all -W -n --keep-going

.PHONY: help setup book test test-site gpu-test lab record format clean

help:
	@echo "make book    execute every chapter and build the site into _build/html"
	@echo "make test    what CI runs: unit and kernel tests on the CPU, each chapter executed once under papermill,"
	@echo "             the book built from those runs (Jupyter Book's execution cache); not the GPU or browser tests"
	@echo "make test-site  make book, then the browser checks of the built site (headless Chromium)"
	@echo "make gpu-test   on an NVIDIA GPU: the GPU tests (pytest -m gpu, a process per test file)"
	@echo "make lab     JupyterLab on the book (the .md chapters open as notebooks)"
	@echo "make record  on a GPU machine: re-measure every experiment at full scale into book/results/"
	@echo "make format  apply the style make test checks (ruff format, clang-format) to the code"

setup: $(STAMP)

$(STAMP): requirements.txt requirements-triton-cpu.txt requirements-triton-gpu.txt requirements-flashinfer.txt \
          pyproject.toml book/lab-overrides.json
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip==25.3
	$(if $(TORCH_INDEX),$(PY) -m pip install -q --index-url $(TORCH_INDEX) "$$(grep -E '^torch==' requirements.txt)")
	$(PY) -m pip install -q -r requirements.txt
	# No GPU here: the Triton whose interpreter runs the kernels (see requirements-triton-cpu.txt).
	if $(PY) -c "import sys, torch; sys.exit(torch.cuda.is_available())"; then \
	  $(PY) -m pip install -q -r requirements-triton-cpu.txt; fi
	# The GPU machines' Triton, apart from the environment's own, for the offline architecture check (see
	# requirements-triton-gpu.txt); replaced whole, so a new pin leaves none of the old one behind.
	rm -rf $(VENV)/triton-gpu
	$(PY) -m pip install -q --no-deps --target $(VENV)/triton-gpu -r requirements-triton-gpu.txt
	# FlashInfer without its heavy declared extras (not needed for MLA): see requirements-flashinfer.txt.
	$(PY) -m pip install -q --no-deps -r requirements-flashinfer.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	# JupyterLab: open MyST .md files as notebooks (jupytext) by default. JupyterLab layers every file of the
	# environment's settings/overrides.d/ under its own overrides.json, so settings the environment has win.
	mkdir -p $(VENV)/share/jupyter/lab/settings/overrides.d
	cp book/lab-overrides.json $(VENV)/share/jupyter/lab/settings/overrides.d/kvwall.json
	touch $(STAMP)

book: $(STAMP)
	rm -rf _build/execution
	$(VENV)/bin/jupyter-book build . $(BOOK_FLAGS)
	@echo
	@echo "The book is built: open file://$(CURDIR)/_build/html/index.html"

# The GPU tests are left out (deselected, not collected as skips); so are the browser checks of the built site.
test: $(STAMP)
	$(PY) -m pytest -m "not gpu and not site"

# The site readers get, built by `make book` (every chapter executed by Jupyter Book), checked in a browser.
test-site: book
	KVWALL_SITE=$(CURDIR)/_build/html $(PY) -m pytest -m site

gpu-test: $(STAMP)
	@$(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make gpu-test: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine')"
	$(PY) -m kvwall.experiments.gpu_tests

lab: $(STAMP)
	$(VENV)/bin/jupyter lab --notebook-dir=book $(if $(filter 0,$(shell id -u)),--allow-root,)

record: $(STAMP)
	$(PY) -m kvwall record all

# What tests/test_style.py checks, applied: both formatters leave a recorded result's code fingerprint as it is
# (it hashes the syntax tree, and CUDA without its comments and layout). `ruff check` findings are fixed by hand.
format: $(STAMP)
	$(VENV)/bin/ruff format lib kernels tests
	$(VENV)/bin/clang-format -i $$(find kernels -name '*.cu' -o -name '*.cuh')

clean:
	rm -rf _build
