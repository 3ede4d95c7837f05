"""The config engine (ember.config): every TOML file ember reads is parsed, validated and
documented one way. Each reference in docs/ is what the engine generates now; an error names the
file, the line, the key path and the value in every file alike."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ember.cli.settings import FILES, references
from ember.config import Source, build_entries, build_file, derived, key_lines, setting
from ember.errors import EmberError
from ember.metrics.machine import read_machine
from ember.policy.registry import load_registry
from ember.policy.targets import load_targets
from ember.recipe import load_recipe
from ember.sched.owner_rules import load_rules
from tests.helpers import ROOT, run_ember


@pytest.mark.parametrize("name", FILES)
def test_each_reference_is_current_and_documents_every_key(name):
    """docs/recipe.md, owner.md, targets.md, datasets.md and machine.md: generated from the schema
    the file is validated with (`ember settings NAME --markdown`), every key with its help."""
    doc, markdown, rows = references()[name]
    text = (ROOT / doc).read_text()
    assert text == markdown(), f"{doc} is stale: `ember settings {name} --markdown > {doc}`"
    for row in rows():
        assert row.help.strip(), row.key
        assert f"| `{row.key}` |" in text, f"{row.key} missing from {doc}"


def test_the_settings_command_prints_each_reference():
    assert tuple(references()) == FILES
    result = run_ember("settings", "targets", "--markdown")
    assert result.returncode == 0, result.stderr
    assert result.stdout == references()["targets"][1]()


def test_key_lines_follow_tables_dotted_and_quoted_names():
    text = '# top\nx = 1\n[a]\nk = 2\n\n[b.c]  # comment\n"q" = 3\n[b."d e"]\nk = [\n  "v = 1",\n]\n'
    lines = key_lines(text)
    assert lines[("x",)] == 2 and lines[("a",)] == 3 and lines[("a", "k")] == 4
    assert lines[("b", "c")] == 6 and lines[("b", "c", "q")] == 7
    assert lines[("b", "d e")] == 8 and lines[("b", "d e", "k")] == 9
    src = Source("f.toml", lines, frozenset({("a", "z")}))
    assert src.at("a", "k") == "f.toml:4"
    assert src.at("a", "missing") == "f.toml:3"          # the table's line
    assert src.at("nowhere", "k") == "f.toml"
    assert src.at("a", "z") == "f.toml (--set a.z)"
    assert src.where("b", "c", "q") == "f.toml:7: [b.c] q"


BAD = [  # (file name, text, the message's start)
    ("recipe.toml", '[data]\nfiles = ["d.jsonl"]\n\n[train]\nmax_steps = 0\n',
     ":5: [train] max_steps = 0: must be >= 1"),
    ("owner.toml", "[cpu]\n\nmax_other_load = 2\n", ":3: [cpu] max_other_load = 2.0: must be <= 1"),
    ("targets.toml", "[targets.hpc]\nkind = 'slurm'\nmax_nodes = 0\n", ":3: [targets.hpc] max_nodes = 0: must be >= 1"),
    ("datasets.toml", "[datasets.c]\n\nowner = 3\n", ":3: [datasets.c] owner = 3: must be a string"),
    ("machine.toml", "[cost]\nwatts = 'lots'\n", ":2: [cost] watts = 'lots': must be a number"),
]


@pytest.mark.parametrize("name,text,start", BAD, ids=[b[0] for b in BAD])
def test_one_error_shape_in_every_file(tmp_path, monkeypatch, name, text, start):
    """Before the engine only owner.toml's errors named the line; machine.toml had its own wording."""
    path = tmp_path / name
    path.write_text(text)
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    load = {"recipe.toml": load_recipe, "owner.toml": load_rules, "targets.toml": load_targets,
            "datasets.toml": load_registry, "machine.toml": lambda _: read_machine()}[name]
    with pytest.raises(EmberError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}{start}"), e.value


@dataclasses.dataclass
class Entry:
    size: int = setting(None, "A size.", min=1, required=True)
    tags: list[str] = setting(list, "Tags.", factory=True)
    name: str = derived("set from the table name")


@dataclasses.dataclass
class Section:
    level: float = setting(0.5, "A share.", min=0, max=1)


@dataclasses.dataclass
class File:
    one: Section = dataclasses.field(default_factory=Section)


def test_entries_refuse_missing_required_keys_keys_ember_sets_and_other_sections():
    src = Source("e.toml", key_lines("[e.a]\nsize = 2\n[e.b]\ntags = []\n"))
    with pytest.raises(EmberError, match=r"^e.toml:3: \[e.b\]: size missing: state it$"):
        build_entries(Entry, {"e": {"a": {"size": 2}, "b": {"tags": []}}}, "e", src, "state it")
    assert build_entries(Entry, {"e": {"a": {"size": 2}}}, "e", src, "")["a"].size == 2
    with pytest.raises(EmberError, match=r"unknown key 'name' in \[e.a\]"):
        build_entries(Entry, {"e": {"a": {"size": 2, "name": "x"}}}, "e", src, "")
    with pytest.raises(EmberError, match=r"unknown section \[f\]; write each entry as \[e.NAME\]"):
        build_entries(Entry, {"f": {}}, "e", src, "")
    with pytest.raises(EmberError, match="a name is letters"):
        build_entries(Entry, {"e": {"a b": {"size": 2}}}, "e", src, "")


def test_sections_take_defaults_and_refuse_unknown_names():
    assert build_file(File, {}, Source("f")).one.level == 0.5
    assert build_file(File, {"one": {"level": 1}}, Source("f")).one.level == 1.0
    with pytest.raises(EmberError, match=r"unknown section \[on\] \(did you mean 'one'\?\)"):
        build_file(File, {"on": {}}, Source("f"))
    with pytest.raises(EmberError, match=r"'one' must be a \[one\] table"):
        build_file(File, {"one": 3}, Source("f"))


def test_every_file_under_ember_home_is_named_by_home(tmp_path, monkeypatch):
    """$EMBER_HOME's layout is known in one place (ember.paths.Home): every owner of a file asks it."""
    from ember.ledger.database import default_path
    from ember.metrics.machine import machine_file
    from ember.paths import home
    from ember.policy.registry import registry_files
    from ember.sched.owner_rules import owner_file
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    h = home()
    assert h.root == tmp_path
    assert (default_path(), owner_file(), machine_file(), registry_files()[1]) == \
        (h.ledger, h.owner_toml, h.machine_toml, h.datasets_toml)
    joined = []
    for path in (ROOT / "ember").rglob("*.py"):
        if path.name != "paths.py" and "ember_home() /" in path.read_text():
            joined.append(str(path.relative_to(ROOT)))
    assert not joined, f"join paths under $EMBER_HOME through ember.paths.home(): {joined}"


def test_home_names_distinct_paths_under_its_root():
    from ember.paths import Home
    h = Home(Path("/h"))
    names = [n for n, v in vars(type(h)).items() if isinstance(v, property)]
    paths = [getattr(h, n) for n in names] + [h.token_cache("k"), h.job_control(3), h.job_log(3)]
    assert len(set(paths)) == len(paths) and all(p.is_relative_to("/h") and p != Path("/h") for p in paths)
