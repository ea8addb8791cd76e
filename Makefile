# Everything a fresh machine needs, in two commands: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# a checkout keeps its downloads and exports in its own models/ (an installed wheel uses the
# per-user cache directory instead)
export ORTSPEC_MODELS_DIR ?= $(CURDIR)/models

.PHONY: setup demo test test-fast bench clean-models

# torch 2.13.0 first: on this machine pip takes that CPU build from local disk; asking for
# any other version would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[export,test,bench,serve,ray]'
	touch $(STAMP)

setup: $(STAMP)

# Gets and exports the default model on first use (cached under models/), at int4, its native
# precision, then decodes one input-grounded prompt plainly and speculatively.
# `make demo DEMO_ARGS=--precision=fp32` runs the fp32 export instead.
DEMO_ARGS ?=
demo: $(STAMP)
	$(BIN)/python scripts/demo.py $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

bench: $(STAMP)
	$(BIN)/python -m ortspec.runtime.cli bench

clean-models:
	rm -rf models/cache models/exported
