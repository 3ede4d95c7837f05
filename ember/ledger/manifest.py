"""The reproducibility manifest: what it takes to re-run a run, including the parts people
usually leave out (the uncommitted diff, every package version, numerics-affecting variables)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from ember import __version__
from ember.durable import write_durable
from ember.paths import home

NUMERICS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "NVIDIA_TF32_OVERRIDE",
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF",
                "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "PYTHONHASHSEED")


_LISTED: dict[str, list[str]] = {}  # packages_key() -> the list this process read (or was handed)


def installed_packages() -> list[str]:
    """Every installed distribution as NAME==VERSION, sorted. Reading each one's METADATA took
    0.26 s of every run's start-up (bench/startup.py), so the list is cached in $EMBER_HOME under
    the interpreter and the modification times of the folders on sys.path: installing, upgrading
    or removing a package creates or removes its .dist-info folder, which changes its folder's.
    A process reads it at most once per key, whatever $EMBER_HOME it is given later (a service
    starting jobs for several homes, or a process that forks runs)."""
    key = packages_key()
    if key in _LISTED:
        return list(_LISTED[key])
    cache = home().packages_cache
    try:
        known = json.loads(cache.read_text())
        if known["key"] == key:
            _LISTED[key] = list(known["packages"])
            return list(known["packages"])
    except (OSError, ValueError, KeyError, TypeError):  # none yet, or unreadable: read them again
        pass
    found = read_packages()
    cache.parent.mkdir(parents=True, exist_ok=True)
    write_durable(cache, json.dumps({"key": key, "packages": found}))
    return found


def read_packages() -> list[str]:
    """Every installed distribution as NAME==VERSION, sorted, read from their METADATA now; kept
    for this process under packages_key()."""
    found = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]})
    _LISTED[packages_key()] = found
    return list(found)


def packages_key() -> str:
    """What the installed packages depend on: the interpreter, and each sys.path folder's mtime."""
    stamps = []
    for entry in sys.path:
        try:
            stamps.append([entry, os.stat(entry or ".").st_mtime_ns])
        except OSError:  # a path entry that does not exist holds no package
            stamps.append([entry, None])
    return hashlib.sha256(json.dumps([sys.executable, stamps]).encode()).hexdigest()


def git_state(folder: Path) -> dict[str, Any] | None:
    """Commit, and a hash of the uncommitted diff, of the git work tree holding `folder`."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(folder), *args], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.decode(errors="replace") if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None:
        return None
    diff = git("diff", "HEAD", "--binary") or ""
    untracked = git("ls-files", "--others", "--exclude-standard") or ""
    return {"root": top.strip(), "commit": (git("rev-parse", "HEAD") or "").strip() or None,
            "dirty": bool(diff or untracked),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff else None,
            "untracked_files": len(untracked.splitlines())}


def devices(device: torch.device) -> dict[str, Any]:
    if device.type == "cpu":
        return {"type": "cpu", "count": 1, "names": [platform.processor() or platform.machine()]}
    module = torch.get_device_module(device.type)
    count = module.device_count()
    return {"type": device.type, "count": count,
            "names": [module.get_device_name(i) for i in range(count)]}


def build_manifest(recipe_file: Path, device: torch.device, threads: int, seed: int,
                   deterministic: bool) -> dict[str, Any]:
    cuda = getattr(torch.version, "cuda", None)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "ember": __version__,
        "ember_source": git_state(Path(__file__).resolve().parent),
        "recipe_file": str(recipe_file.resolve()),
        "recipe_git": git_state(recipe_file.resolve().parent),
        "python": sys.version,
        "torch": {"version": torch.__version__, "cuda": cuda, "cudnn": cudnn,
                  "hip": getattr(torch.version, "hip", None), "git": torch.version.git_version},
        "packages": installed_packages(),
        "platform": platform.platform(), "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(), "devices": devices(device),
        "seed": seed, "threads": threads,
        "determinism": {"use_deterministic_algorithms": deterministic,
                        "cudnn_benchmark": torch.backends.cudnn.benchmark,
                        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32},
        "env": {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ},
        "argv": sys.argv, "cwd": os.getcwd(),
    }
