#!/usr/bin/env bash
# The GPU script (issue 31, item 6): MFU of ember's real `ember run` in bf16 on a 0.5B model (full
# and LoRA, eager and compiled), checkpoint blocking (asynchronous against synchronous), memory
# (`ember plan` against CUDA's caching allocator), QLoRA and co-serving where they have landed:
# one markdown table on stdout, and with raw JSON and logs under $OUT (else bench/out/).
#
#   bash bench/gpu.sh               on a machine with a CUDA GPU; rows stop starting after 480 s
#                                   (--budget): on an H200 (2026-12-04) the first nine rows, the
#                                   other three (~4 minutes) through --only in a second call
#   bash bench/gpu.sh --cpu-smoke   the same pipeline on CPU with a tiny model and 2 steps
#   bash bench/gpu.sh --only full-eager,checkpoint-synchronous    some rows (--help lists them)
#
# Nothing is downloaded: the machine may have no network. It needs a Python with torch (CUDA
# unless --cpu-smoke) and ember's dependencies; the first of $EMBER_PYTHON, ./.venv/bin/python,
# python3, python that has them is used, with ember from this working tree (PYTHONPATH: ember reads no
# metadata of its own, so nothing is installed). Exits 3 naming what is missing.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
smoke=0
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && smoke=1; done

# torch, and CUDA unless --cpu-smoke: the first candidate that has them.
python="" ; tried=""
for candidate in "${EMBER_PYTHON:-}" "$ROOT/.venv/bin/python" python3 python; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 || continue
    said="$("$candidate" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())" 2>&1 | tail -n 1)"
    read -r version cuda available <<<"$said"
    case "$available" in
        True) python="$candidate"; break ;;
        False) [ "$smoke" = 1 ] && { python="$candidate"; break; }
               [ "$cuda" = None ] && build="a CPU-only build" || build="built for CUDA $cuda, but it sees no device"
               tried="$tried\n  $candidate: torch $version, $build" ;;
        *) tried="$tried\n  $candidate: no torch ($said)" ;;
    esac
done
if [ -z "$python" ]; then
    printf 'bench/gpu.sh: no Python here has torch%s:%b\n' "$([ "$smoke" = 1 ] || echo " with a CUDA device")" "$tried" >&2
    command -v nvidia-smi >/dev/null && nvidia-smi -L >&2
    echo "Install a CUDA build of torch (pip install torch) and ember's dependencies (pip install -e .)," \
         "or name a Python that has them in EMBER_PYTHON; this script downloads nothing." >&2
    exit 3
fi

# ember's dependencies (pyproject.toml), by import name; then the modules the rows run through.
info="$(ROOT="$ROOT" "$python" - <<'EOF'

import importlib, importlib.util, os, sys
declared = ["torch", "transformers", "peft", "safetensors", "numpy", "rich", "gguf", "matplotlib", "fastapi",
            "uvicorn", "httpx", "psutil", "pyarrow", "crc32c", "jinja2", "prometheus_client", "orjson"]
missing = [m for m in declared if importlib.util.find_spec(m) is None]
if missing:
    print(f"bench/gpu.sh: {sys.executable} lacks ember's dependencies: {', '.join(missing)}", file=sys.stderr)
try:
    for module in ("ember.cli.main", "ember.launch", "ember.train.job", "ember.train.loop", "ember.metrics.report",
                   "ember.cli.accounts", "ember.cli.plan", "ember.doctor.calibrated_plan", "transformers", "peft",
                   "safetensors"):
        importlib.import_module(module)
except ImportError as e:
    sys.exit(f"bench/gpu.sh: ember cannot run here: importing {module}: {e}; install what is missing (pip install "
             f"-e . where there is a network, or copy the packages into {sys.prefix}): this script downloads nothing")
import ember, peft, torch, transformers
if os.path.dirname(os.path.abspath(ember.__file__)) != os.path.join(os.environ["ROOT"], "ember"):
    sys.exit(f"bench/gpu.sh: ember is imported from {ember.__file__}, not from this tree ({os.environ['ROOT']})")
print(f"python: {sys.executable} (Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA "
      f"{torch.version.cuda}, transformers {transformers.__version__}, peft {peft.__version__})")
EOF
)" || exit 3
if [ "$smoke" = 0 ] && command -v nvidia-smi >/dev/null; then
    info="$info
device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -n 1)"
fi
info="$info
ember: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'no git revision'))"
echo "$info"
export GPU_BENCH_ENV="$info"  # bench/gpu.py writes it above the table
exec "$python" "$ROOT/bench/gpu.py" "$@"
