"""datasets.toml and targets.toml: written, read back, validated like recipes; fingerprints that
see every changed byte and are the same over a staged copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ember.errors import EmberError
from ember.ledger import audit, database as store
from ember.policy.registry import (Holding, covering, fingerprint, fingerprint_files, holdings, load_registry, members,
                                   register, verify)
from ember.policy.targets import load_targets
from ember.remote.backends import BACKENDS

TARGET = """
[targets.hpc]
kind = "slurm"
device = "cpu"
device_hour_price = 1.5
max_nodes = 2
max_wall_hours = 4
max_device_hours = 8
max_cost_per_job = 10
max_cost_per_month = 100
allowed_classifications = ["public"]
stage_dir = "/scratch/ember"
"""


def corpus(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "part-0.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "folder" / "part-1.jsonl").write_text('{"text": "b"}\n')
    (tmp_path / "one.txt").write_text("one document\n")
    return tmp_path / "folder", tmp_path / "one.txt"


def test_register_then_read_back_verify_and_cover_files(tmp_path):
    folder, one = corpus(tmp_path)
    reg = tmp_path / "datasets.toml"
    ds = register(reg, "mixed", [folder, one], "alice", "CC0-1.0", "internal", ["hpc"], "2030-01-31")
    loaded = load_registry(reg)
    assert list(loaded) == ["mixed"]
    back = loaded["mixed"]
    assert (back.paths, back.fingerprint, back.classification, back.allowed_targets, back.expires) == \
        (ds.paths, ds.fingerprint, "internal", ["hpc"], "2030-01-31")
    assert verify(back) is None
    used, outside = covering([str(folder / "part-1.jsonl"), str(one), str(tmp_path / "elsewhere.txt")], loaded)
    assert used == {"mixed": [str(folder / "part-1.jsonl"), str(one)]}
    assert outside == [str(tmp_path / "elsewhere.txt")]
    # A folder whose name only starts like a registered one is not inside it.
    assert covering([str(folder) + "-2/x.jsonl"], loaded)[1] == [str(folder) + "-2/x.jsonl"]


def test_an_entry_with_text_beyond_the_basic_multilingual_plane_reads_back(tmp_path):
    """An owner (or a path) with an emoji was written as JSON's surrogate escapes, which TOML
    refuses: every later `ember data list`, `verify` and gate check failed on the registry."""
    folder, one = corpus(tmp_path)
    reg = tmp_path / "datasets.toml"
    register(reg, "mixed", [one], "Zoë 🐍", "CC0-1.0", "public", [], "")
    assert load_registry(reg)["mixed"].owner == "Zoë 🐍"


def test_a_changed_byte_changes_the_fingerprint_and_verify_says_so(tmp_path):
    folder, one = corpus(tmp_path)
    reg = tmp_path / "datasets.toml"
    register(reg, "mixed", [folder, one], "alice", "CC0-1.0", "public", [], "")
    (folder / "part-0.jsonl").write_text('{"text": "A"}\n')  # same size
    problem = verify(load_registry(reg)["mixed"])
    assert problem is not None and "changed since it was registered" in problem
    (folder / "part-0.jsonl").unlink()  # a file gone from a folder is a change too
    assert "changed since it was registered" in verify(load_registry(reg)["mixed"])
    one.unlink()
    assert "no such file" in verify(load_registry(reg)["mixed"])


def test_the_fingerprint_of_a_staged_copy_equals_the_registered_one(tmp_path):
    folder, one = corpus(tmp_path)
    registered = fingerprint_files([str(folder), str(one)])
    staged = tmp_path / "job" / "data" / "mixed"
    for place, src in members([str(folder), str(one)]):  # the layout ember.remote.stage copies to
        (staged / place).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, staged / place)
    from ember.durable import sha256_file
    copies = [(f.relative_to(staged).as_posix(), sha256_file(f)) for f in staged.rglob("*") if f.is_file()]
    assert fingerprint(copies) == registered


@pytest.mark.parametrize("entry,message", [
    ('paths = ["/x"]\nowner = "a"\nlicence = "l"\nclassification = "public"', "fingerprint missing"),
    ('paths = ["/x"]\nfingerprint = "sha256:' + "0" * 64 + '"\nowner = "a"\nlicence = "l"\nclassification = "secret"',
     "classification = 'secret'"),
    ('paths = ["rel/x"]\nfingerprint = "sha256:' + "0" * 64 + '"\nowner = "a"\nlicence = "l"\nclassification = "public"',
     "each must be absolute"),
    ('paths = ["/x"]\nfingerprint = "sha256:' + "0" * 64 + '"\nowner = "a"\nlicence = "l"\nclassification = "public"'
     '\nallowed_target = ["hpc"]', "did you mean 'allowed_targets'"),
    ('paths = ["/x"]\nfingerprint = "sha256:' + "0" * 64 + '"\nowner = "a"\nlicence = "l"\nclassification = "public"'
     '\nexpires = "next year"', "write a date"),
])
def test_a_bad_registry_entry_is_refused_naming_file_and_key(tmp_path, entry, message):
    reg = tmp_path / "datasets.toml"
    reg.write_text(f"[datasets.corpus]\n{entry}\n")
    with pytest.raises(EmberError, match="datasets.toml") as e:
        load_registry(reg)
    assert message in str(e.value)


def test_a_dataset_in_both_registries_is_refused(tmp_path, monkeypatch):
    folder, _ = corpus(tmp_path)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("EMBER_HOME", str(home))
    monkeypatch.chdir(tmp_path)
    register(Path("datasets.toml"), "c", [folder], "a", "l", "public", [], "")
    register(home / "datasets.toml", "c", [folder], "a", "l", "public", [], "")
    with pytest.raises(EmberError, match="also registered in"):
        load_registry()


def test_targets_read_back_and_every_cap_is_required(tmp_path):
    f = tmp_path / "targets.toml"
    f.write_text(TARGET)
    t = load_targets(BACKENDS, f)["hpc"]
    assert (t.max_nodes, t.max_wall_hours, t.price, t.allowed_classifications) == (2, 4.0, 1.5, ["public"])
    for cap in ("max_nodes", "max_cost_per_month", "device_hour_price"):
        f.write_text("\n".join(line for line in TARGET.splitlines() if not line.startswith(cap)))
        with pytest.raises(EmberError, match=f"{cap} missing"):
            load_targets(BACKENDS, f)
    f.write_text(TARGET.replace('stage_dir = "/scratch/ember"', 'stage_dir = "scratch"'))
    with pytest.raises(EmberError, match="absolute folder"):
        load_targets(BACKENDS, f)
    f.write_text(TARGET + 'host = "login.hpc"\n')
    with pytest.raises(EmberError, match="python is required with an SSH host"):
        load_targets(BACKENDS, f)
    f.write_text(TARGET.replace("max_nodes = 2", "max_nodes = 0"))
    with pytest.raises(EmberError, match="max_nodes = 0: must be >= 1"):
        load_targets(BACKENDS, f)


def test_registering_an_overlap_of_another_classification_is_refused_with_both_names(tmp_path, monkeypatch):
    """A file of a registered personal folder registered again alone as public, a copy of it
    registered as public, and the same file in both: refused, naming both datasets; nothing is
    written. The same classification is no conflict."""
    monkeypatch.chdir(tmp_path)  # the default registries (./datasets.toml, $EMBER_HOME's) are not this one
    folder, one = corpus(tmp_path)
    reg = tmp_path / "registry.toml"
    register(reg, "chats", [folder], "alice", "private", "personal", [], "")
    before = reg.read_text()
    with pytest.raises(EmberError) as e:
        register(reg, "part-public", [folder / "part-0.jsonl"], "alice", "CC0-1.0", "public", ["lab"], "")
    print(e.value)  # the figure for the note: the refusal
    assert (f"'part-public' (public) overlaps dataset 'chats' (personal, {reg}): {folder / 'part-0.jsonl'} is in "
            f"both (by path); a file counts as the most restrictive dataset that holds it, here personal") in str(e.value)
    assert "pass --override" in str(e.value) and reg.read_text() == before
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    copy.write_bytes((folder / "part-1.jsonl").read_bytes())
    with pytest.raises(EmberError, match=r"overlaps dataset 'chats' \(personal.*copy.jsonl is in both \(by content\)"):
        register(reg, "copy", [copy.parent], "bob", "CC0-1.0", "public", ["lab"], "")
    link = tmp_path / "link.jsonl"
    link.symlink_to(folder / "part-0.jsonl")  # path identity is after realpath
    with pytest.raises(EmberError, match="by path"):
        register(reg, "linked", [link], "bob", "CC0-1.0", "internal", ["lab"], "")
    register(reg, "part-personal", [folder / "part-0.jsonl"], "alice", "private", "personal", [], "")
    assert set(load_registry(reg)) == {"chats", "part-personal"}


def test_an_overridden_overlap_is_registered_audited_and_still_counts_as_the_most_restrictive(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder, _ = corpus(tmp_path)
    reg, ledger = tmp_path / "registry.toml", tmp_path / "ledger.db"
    register(reg, "chats", [folder], "alice", "private", "personal", [], "")
    register(reg, "part-public", [folder / "part-0.jsonl"], "alice", "CC0-1.0", "public", ["lab"], "",
             override=True, ledger=ledger)
    registry = load_registry(reg)
    assert set(registry) == {"chats", "part-public"}
    con = store.connect(ledger)
    chain, problems = audit.check_log(con)
    con.close()
    assert problems == [] and len(chain) == 1
    row = chain[0]
    assert (row.action, row.decision, [d["name"] for d in row.datasets]) == ("register", "override",
                                                                            ["part-public", "chats"])
    assert row.reasons[0]["code"] == "overlap" and "'chats' (personal" in row.reasons[0]["message"]
    held = holdings([str(folder / "part-0.jsonl")], registry)
    assert held[str(folder / "part-0.jsonl")] == Holding("part-public", ("chats", "part-public"))


def test_registering_a_name_again_as_less_than_it_was_needs_the_override_and_is_audited(tmp_path, monkeypatch):
    """Re-registering a personal dataset's own name as public, or as another owner's, skipped the
    overlap check (the same name) and went through silently: the file then went to a target that
    takes public data. New data, more targets, a later end (the owner's to grant) or a stricter
    classification need nothing."""
    monkeypatch.chdir(tmp_path)
    folder, _ = corpus(tmp_path)
    reg, ledger = tmp_path / "registry.toml", tmp_path / "ledger.db"
    register(reg, "chats", [folder], "bob", "private", "personal", [], "2030-01-31")
    before = reg.read_text()
    for change, owner, classification in (("classification personal -> public", "bob", "public"),
                                          ("owner bob -> alice", "alice", "personal")):
        with pytest.raises(EmberError) as e:
            register(reg, "chats", [folder], owner, "private", classification, ["lab"], "2030-01-31", ledger=ledger)
        assert f"'chats' is registered in {reg} as it would no longer be: {change}" in str(e.value)
        assert "--override" in str(e.value) and reg.read_text() == before
    (folder / "part-2.jsonl").write_text('{"text": "c"}\n')
    register(reg, "chats", [folder], "bob", "private", "personal", ["lab"], "")  # renewed, more targets, no end
    register(reg, "chats", [folder], "alice", "CC0-1.0", "public", ["lab"], "", override=True, ledger=ledger)
    assert load_registry(reg)["chats"].classification == "public"
    con = store.connect(ledger)
    chain, problems = audit.check_log(con)
    con.close()
    assert problems == [] and [(r.action, r.decision) for r in chain] == [("register", "override")]
    assert [r["code"] for r in chain[0].reasons] == ["loosened"] * 2, chain[0].reasons
    assert [d["classification"] for d in chain[0].datasets] == ["public", "personal"]


def test_the_registry_is_read_once_when_the_project_and_the_machine_share_it(tmp_path, monkeypatch):
    """Run from inside $EMBER_HOME, ./datasets.toml and ./targets.toml are the machine's own: every
    dataset and target was 'also registered in' itself, and every registry command failed."""
    folder, _ = corpus(tmp_path)
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "targets.toml").write_text(TARGET)
    register(Path("datasets.toml"), "c", [folder], "a", "l", "public", [], "")
    assert list(load_registry()) == ["c"]
    assert list(load_targets(BACKENDS)) == ["hpc"]


def test_a_registry_inside_the_dataset_it_registers_is_refused(tmp_path, monkeypatch):
    """`cd corpus; ember data register corpus .` fingerprinted the folder, then wrote
    datasets.toml into it: the registration was stale at once and `ember data verify` failed."""
    folder, _ = corpus(tmp_path)
    monkeypatch.chdir(folder)
    with pytest.raises(EmberError, match="the registry file is inside the dataset"):
        register(Path("datasets.toml"), "corpus", [Path(".")], "a", "l", "public", [], "")
    assert not (folder / "datasets.toml").exists()


def test_verify_names_the_files_that_changed_came_or_went(tmp_path):
    folder, one = corpus(tmp_path)
    reg = tmp_path / "datasets.toml"
    register(reg, "mixed", [folder, one], "alice", "CC0-1.0", "public", [], "")
    assert "0/folder/part-0.jsonl" in reg.read_text()  # each file's hash as registered, sha256sum's way
    (folder / "part-0.jsonl").write_text('{"text": "A"}\n')
    (folder / "part-1.jsonl").unlink()
    (folder / "part-9.jsonl").write_text("{}\n")
    problem = verify(load_registry(reg)["mixed"])
    assert "1 changed: 0/folder/part-0.jsonl; 1 added: 0/folder/part-9.jsonl; 1 gone: 0/folder/part-1.jsonl" in problem
    reg.write_text(reg.read_text().replace('/part-0.jsonl"', '/part-5.jsonl"'))  # edited by hand
    with pytest.raises(EmberError, match="do not make the registered fingerprint"):
        load_registry(reg)


def test_an_unquoted_date_says_to_quote_it(tmp_path):
    reg = tmp_path / "datasets.toml"
    reg.write_text('[datasets.c]\npaths = ["/x"]\nfingerprint = "sha256:' + "0" * 64 + '"\nowner = "a"\n'
                   'licence = "l"\nclassification = "public"\nexpires = 2020-01-01\n')
    with pytest.raises(EmberError, match='expires = 2020-01-01: must be a string; quote it: "2020-01-01"'):
        load_registry(reg)
