"""Shared fixtures: an isolated EMBER_HOME and no model hub."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session", autouse=True)
def ember_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("ember_home")
    os.environ["EMBER_HOME"] = str(home)
    return home
