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


def test_a_process_lists_the_packages_once_whatever_its_home(tmp_path, monkeypatch):
    """A process that runs for several homes (or forks runs, as the tests' warm start does) reads
    the packages' metadata once per sys.path state, not once per $EMBER_HOME."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    calls = []
    distributions = metadata.distributions
    monkeypatch.setattr(metadata, "distributions", lambda: calls.append(1) or distributions())
    lists = []
    for name in ("a", "b", "c"):
        monkeypatch.setenv("EMBER_HOME", str(tmp_path / name))
        lists.append(installed_packages())
    assert len(calls) == 1 and lists[0] == lists[1] == lists[2]
    assert not home().packages_cache.exists()  # home "c": nothing to write, the list was known
