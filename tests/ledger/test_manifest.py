"""The run manifest's package list (ember.ledger.manifest.installed_packages): every installed
distribution, read once and then from $EMBER_HOME's cache until a folder on sys.path changes."""

from __future__ import annotations

import json
import sys
from importlib import metadata

from ember.ledger.manifest import installed_packages
from ember.paths import home


def test_the_package_list_is_cached_and_sees_a_package_installed_since(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    monkeypatch.setenv("EMBER_HOME", str(tmp_path / "home"))
    read = sorted({f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions() if d.metadata["Name"]})
    assert installed_packages() == read
    assert json.loads(home().packages_cache.read_text())["packages"] == read  # the next run reads this
    assert installed_packages() == read

    info = site / "ember_test_pkg-1.2.dist-info"  # what pip leaves: a new folder in a sys.path folder
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ember-test-pkg\nVersion: 1.2\n")
    assert installed_packages() == sorted([*read, "ember-test-pkg==1.2"])
