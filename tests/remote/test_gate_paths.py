"""The gate on the paths `ember policy check` and `ember submit --target` take before anything is
sent (decide, the month's spend, staging), with no engine running: what is staged is what the
gate checked, and a request it must refuse is refused and audited, never a crash."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ember.errors import EmberError
from ember.events import Events
from ember.ledger import audit, database as store, remote_rows
from ember.ledger.job_states import REMOTE_FINAL
from ember.policy.gate import Limits, month_of
from ember.policy.registry import register
from ember.remote import stage
from ember.remote.shell import Shell
from ember.remote.submit import RemoteRequest, decide
from tests.helpers import GENESIS, write_recipe
from tests.remote.targets import target_toml

LIMITS = Limits(0.5, 0.5, 0.5, 1)


def project(tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """A folder of two files, a.jsonl and b.jsonl, registered whole as public and allowed to 'lab';
    the registry, targets and ledger files."""
    monkeypatch.chdir(tmp_path)  # the default registries are not these
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(GENESIS.read_bytes())
    (folder / "b.jsonl").write_text('{"text": "bob\'s words, never to leave this machine"}\n')
    reg, targets = tmp_path / "datasets.toml", tmp_path / "targets.toml"
    targets.write_text(target_toml("lab", "slurm", "/scratch/ember"))
    register(reg, "corpus", [folder], "alice", "CC0-1.0", "public", ["lab"], "")
    return folder, reg, targets


def test_a_file_staged_with_the_folder_the_job_reads_from_is_checked_too(tmp_path, monkeypatch):
    """The recipe reads corpus/a.jsonl; the whole 'corpus' folder is staged, b.jsonl with it. A
    dataset that holds b.jsonl (by path, or a copy of it by content) and may not go to 'lab' refuses
    the job, though the job never reads b.jsonl."""
    folder, reg, targets = project(tmp_path, monkeypatch)
    copy = tmp_path / "elsewhere" / "bob.jsonl"
    copy.parent.mkdir()
    copy.write_bytes((folder / "b.jsonl").read_bytes())
    register(reg, "bob", [folder / "b.jsonl"], "bob", "private", "public", [], "")    # local only
    register(reg, "bob-copy", [copy], "bob", "private", "public", [], "")              # local only
    recipe = write_recipe(tmp_path / "project", data={"files": [str(folder / "a.jsonl")]})
    req = RemoteRequest(recipe, "lab", LIMITS, registry=reg, targets=targets, ledger=tmp_path / "ledger.db")
    decided = decide(req, "check", Events())
    d = decided.decision
    assert not d.allowed
    assert d.codes == ["dataset-target", "dataset-target"], d.reasons
    assert [u.name for u in d.datasets if u.staged] == ["corpus"]
    assert {u.name for u in d.datasets if not u.staged} == {"bob", "bob-copy"}
    assert decided.audit.decision == "refused"


def test_zero_nodes_are_refused_and_audited_not_a_crash(tmp_path, monkeypatch):
    folder, reg, targets = project(tmp_path, monkeypatch)
    recipe = write_recipe(tmp_path / "project", data={"files": [str(folder / "a.jsonl")]})
    ledger = tmp_path / "ledger.db"
    req = RemoteRequest(recipe, "lab", LIMITS, nodes=0, registry=reg, targets=targets, ledger=ledger)
    decided = decide(req, "check", Events())
    assert not decided.decision.allowed and "invalid-limit" in decided.decision.codes
    con = store.connect(ledger)
    chain, problems = audit.check_log(con)
    con.close()
    assert problems == [] and [(r.action, r.decision) for r in chain] == [("check", "refused")]


def test_only_the_files_the_gate_hashed_are_staged_not_a_linked_folder_inside_a_dataset(tmp_path, monkeypatch):
    """A registered folder holds a link to a folder outside it. Its fingerprint (and the gate, and
    the overlap check) never sees the files behind the link; staging must not send them either,
    rather than send them and refuse the copy once it has arrived."""
    folder, reg, _ = project(tmp_path, monkeypatch)
    private = tmp_path / "private"
    private.mkdir()
    (private / "secret.jsonl").write_text('{"text": "not in any dataset"}\n')
    (folder / "more").symlink_to(private, target_is_directory=True)
    register(reg, "corpus", [folder], "alice", "CC0-1.0", "public", ["lab"], "")  # the link was there already
    from ember.policy.registry import load_registry
    ds = load_registry(reg)["corpus"]
    job = tmp_path / "stage" / "job"
    refused = None
    try:
        stage.upload(Shell(), str(job), [ds], Events())
    except EmberError as e:
        refused = str(e)
    sent = sorted(p.relative_to(job).as_posix() for p in job.rglob("*") if p.is_file())
    assert sent == ["data/corpus/0/corpus/a.jsonl", "data/corpus/0/corpus/b.jsonl"], refused
    assert refused is None


def test_a_job_continued_this_month_counts_in_this_months_spend(tmp_path):
    """Submitted last month, failed, continued this month under a new cost limit: the gate let
    that limit go against this month's cap, so the next job's monthly-budget check sees it too."""
    con = store.connect(tmp_path / "ledger.db")
    _, since = month_of(time.time())
    job = remote_rows.insert(con, {"name": "j", "target": "hpc", "audit_id": 1, "audit_hash": "h", "host": "",
                                   "ssh_options": [], "python": "python", "recipe": "/r.toml", "out": "/o",
                                   "remote_dir": "/s/j", "limits": {"max_cost": 5.0, "nodes": 1},
                                   "prediction": {}, "backend": "slurm"}, "staging")
    last_month = since - 86400
    con.execute("UPDATE remote_jobs SET submitted = ?, updated = ? WHERE id = ?", (last_month, last_month, job.id))
    con.execute("UPDATE remote_transitions SET time = ? WHERE job_id = ?", (last_month, job.id))
    assert remote_rows.set_state(con, job.id, "staging", "failed", "staging failed", {"cost": 1.0})
    assert remote_rows.month_spend(con, "hpc", since, REMOTE_FINAL) == 0.0     # last month's job
    assert remote_rows.set_state(con, job.id, "failed", "staging", "ember remote continue",
                                 {"limits": {"max_cost": 40.0, "nodes": 1, "spent_before": 1.0}})
    assert remote_rows.month_spend(con, "hpc", since, REMOTE_FINAL) == 41.0
    con.close()


def staged(job: Path, ds, secret: bytes) -> tuple[list[Path], str | None]:
    """Stage `ds` into `job` on this machine: the files that arrived holding `secret`, and the
    refusal's message (None: staged)."""
    try:
        stage.upload(Shell(), str(job), [ds], Events())
    except EmberError as e:
        refused = str(e)
    else:
        refused = None
    return [p for p in job.rglob("*") if p.is_file() and p.read_bytes() == secret], refused


def test_a_file_changed_after_the_check_is_not_sent(tmp_path, monkeypatch):
    """What is staged is what was hashed: a dataset file changed after the gate's decision is
    refused before its bytes leave the machine, not copied there and refused on arrival; one
    changed while the copy runs (after staging hashed it) stops the copy before its bytes go."""
    folder, reg, _ = project(tmp_path, monkeypatch)
    from ember.policy.registry import load_registry
    ds = load_registry(reg)["corpus"]
    secret = b'{"text": "written after the check: never to leave"}\n'
    (folder / "b.jsonl").write_bytes(secret)
    arrived, refused = staged(tmp_path / "stage" / "job", ds, secret)
    assert arrived == [] and refused is not None and "nothing was sent" in refused
    # Changed between staging's own hash and the copy: the hash it checked is the registered one.
    (folder / "b.jsonl").write_text('{"text": "bob\'s words, never to leave this machine"}\n')
    real = stage.sha256_file
    before = {folder / "b.jsonl": real(folder / "b.jsonl")}
    (folder / "b.jsonl").write_bytes(secret)
    monkeypatch.setattr(stage, "sha256_file", lambda f: before.get(f) or real(f))
    arrived, refused = staged(tmp_path / "stage" / "job2", ds, secret)
    assert arrived == [] and refused is not None and "changed while it was staged" in refused


def read_so_far() -> int:
    """Bytes this thread has read through read(2) and its kind so far: /proc/thread-self/io's
    rchar (the process's own figure takes in its children's once they are reaped: here, the
    far side's tar and sha256sum)."""
    with open("/proc/thread-self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


def test_a_staged_dataset_is_read_twice_once_to_decide_and_once_to_send(tmp_path, monkeypatch):
    """Staging read each file of a staged dataset three times on this machine (the gate's
    decision, a second hash before sending, and the copy, hashed as it is sent), and four on
    a first submit (the overlap check's content cache): minutes each for tens of GB. The copy is
    now held to the gate's own digests: what is sent is still what the gate read, and nothing is
    read a third time."""
    folder, reg, targets = project(tmp_path, monkeypatch)
    size = 24 << 20
    big = os.urandom(size)
    (folder / "big.bin").write_bytes(big)
    register(reg, "corpus", [folder], "alice", "CC0-1.0", "public", ["lab"], "")  # with big.bin
    recipe = write_recipe(tmp_path / "project", data={"files": [str(folder / "a.jsonl")]})
    req = RemoteRequest(recipe, "lab", LIMITS, registry=reg, targets=targets, ledger=tmp_path / "ledger.db")
    job = tmp_path / "stage" / "job"
    before = read_so_far()
    decided = decide(req, "submit", Events())
    assert decided.decision.allowed, decided.decision.reasons
    datasets = [decided.registry[u.name] for u in decided.decision.datasets if u.staged]
    stage.upload(Shell(), str(job), datasets, Events(), decided.digests)
    read = read_so_far() - before
    assert 2 * size <= read < 2.5 * size, f"the dataset was read {read / size:.2f} times"
    assert (job / "data" / "corpus" / "0" / "corpus" / "big.bin").read_bytes() == big


def test_a_file_changed_after_the_decision_is_not_sent_with_the_gates_digests(tmp_path, monkeypatch):
    """With the gate's digests, staging hashes nothing before it sends: a file changed after the
    decision is still cut off before its bytes go, by the hash taken as it is sent."""
    folder, reg, targets = project(tmp_path, monkeypatch)
    recipe = write_recipe(tmp_path / "project", data={"files": [str(folder / "a.jsonl")]})
    req = RemoteRequest(recipe, "lab", LIMITS, registry=reg, targets=targets, ledger=tmp_path / "ledger.db")
    decided = decide(req, "submit", Events())
    assert decided.decision.allowed, decided.decision.reasons
    secret = b'{"text": "written after the gate decided"}\n'
    (folder / "b.jsonl").write_bytes(secret)
    datasets = [decided.registry[u.name] for u in decided.decision.datasets if u.staged]
    job = tmp_path / "stage" / "job"
    try:
        stage.upload(Shell(), str(job), datasets, Events(), decided.digests)
        refused = None
    except EmberError as e:
        refused = str(e)
    assert refused is not None and "changed while it was staged" in refused, refused
    assert not [p for p in job.rglob("*") if p.is_file() and p.read_bytes() == secret]


def test_a_copy_of_a_personal_file_is_refused_after_the_original_changed_or_went(tmp_path, monkeypatch):
    """Bob's file is registered as personal; Alice copies it into her public folder (registered
    while Bob's file still had those bytes would be refused: the copy is known by content). Then
    Bob appends a line to his file, or moves it away: the copy is still what was registered as
    personal, and the gate refuses it. (It was allowed: content identity read Bob's file as it is
    now, not as it was registered.)"""
    monkeypatch.chdir(tmp_path)
    reg, targets = tmp_path / "datasets.toml", tmp_path / "targets.toml"
    targets.write_text(target_toml("lab", "slurm", "/scratch/ember"))
    private = tmp_path / "bob" / "notes.jsonl"
    private.parent.mkdir()
    private.write_text('{"text": "bob: medical record 1, phone 555-0101"}\n')
    register(reg, "bob", [private], "bob", "private", "personal", [], "")
    public = tmp_path / "alice"
    public.mkdir()
    (public / "a.jsonl").write_bytes(GENESIS.read_bytes())
    (public / "notes.jsonl").write_bytes(private.read_bytes())
    with private.open("a") as f:
        f.write('{"text": "bob: record 2"}\n')
    register(reg, "alice", [public], "alice", "CC0-1.0", "public", ["lab"], "", override=True,
             ledger=tmp_path / "ledger.db")  # the overlap is found (by content, as registered); overridden
    recipe = write_recipe(tmp_path / "project", data={"files": [str(public / "notes.jsonl")]})
    req = RemoteRequest(recipe, "lab", LIMITS, registry=reg, targets=targets, ledger=tmp_path / "ledger.db")
    for moment in ("bob's file changed", "bob's file moved away"):
        d = decide(req, "check", Events()).decision
        assert not d.allowed and {"classification", "dataset-target"} <= set(d.codes), (moment, d.reasons)
        assert "bob" in {u.name for u in d.datasets}, moment
        if private.exists():
            private.rename(tmp_path / "bob-archive.jsonl")
