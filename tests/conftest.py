"""Shared fixtures: an isolated EMBER_HOME and no model hub."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session", autouse=True)
def ember_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("ember_home")
    os.environ["EMBER_HOME"] = str(home)
    return home


@pytest.fixture
def small_disk(tmp_path):
    """small_disk("1m") mounts a tmpfs of that size: a real full disk. Needs root and mount(2);
    the test is skipped, with the reason, where that is not allowed."""
    mounted = []

    def make(size: str) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip()}")
        mounted.append(mnt)
        return mnt
    yield make
    for mnt in mounted:
        subprocess.run(["umount", str(mnt)], check=True)
