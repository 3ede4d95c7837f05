"""`ember submit` keeps its local path (the service) without --target, and refuses remote-only
flags there; `ember data register|list|verify` end to end; the gate's refusals through
`ember policy check`; the commands' help and their end when stdout's reader goes away."""

from __future__ import annotations

import json
import subprocess

from ember.ledger import audit, database as store
from tests.helpers import GENESIS, ROOT, ember_cmd, run_ember, write_recipe
from tests.remote.targets import LIMITS, target_toml


def test_submit_without_target_goes_to_the_local_service(tmp_path):
    recipe = write_recipe(tmp_path)
    # No service runs in this EMBER_HOME: the local path answers that, and touches no target.
    done = run_ember("submit", recipe, "--name", "x", env={"EMBER_HOME": str(tmp_path / "home")})
    assert done.returncode == 1
    assert "no service is running" in done.stderr and "start one with `ember serve`" in done.stderr
    done = run_ember("submit", recipe, "--max-cost", "3")
    assert done.returncode == 1 and "--max-cost is for a remote job: add --target T" in done.stderr


def test_data_register_list_verify(tmp_path):
    data = tmp_path / "genesis.jsonl"
    data.write_bytes(GENESIS.read_bytes())
    reg = tmp_path / "datasets.toml"
    done = run_ember("data", "register", "genesis", data, "--owner", "alice", "--licence", "CC0-1.0",
                     "--classification", "public", "--allow", "hpc", "--registry", reg)
    assert done.returncode == 0, done.stderr
    assert "may go to: hpc" in done.stdout
    listed = json.loads(run_ember("data", "list", "--registry", reg, "--json").stdout)
    assert listed["genesis"]["paths"] == [str(data.resolve())]
    assert run_ember("data", "verify", "--registry", reg).returncode == 0
    data.write_text("changed\n")
    done = run_ember("data", "verify", "genesis", "--registry", reg)
    assert done.returncode == 1 and "genesis: FAILED: changed since it was registered" in done.stdout
    done = run_ember("data", "register", "bad", data, "--owner", "a", "--licence", "l", "--classification", "secret",
                     "--registry", reg)
    assert done.returncode == 1 and "--classification 'secret'" in done.stderr


TARGET = target_toml("lab", "slurm", "/scratch/ember")


def test_a_file_of_a_personal_folder_registered_again_as_public_is_refused_for_lab(tmp_path):
    """`ember data register` refuses the overlap, naming both; with --override it is registered and
    audited, and `ember policy check` still refuses the file for 'lab', read directly or through a
    link; a limit of zero or below is refused too."""
    chats = tmp_path / "chats"
    chats.mkdir()
    (chats / "alice.jsonl").write_bytes(GENESIS.read_bytes())
    reg, ledger, targets = tmp_path / "datasets.toml", tmp_path / "ledger.db", tmp_path / "targets.toml"
    targets.write_text(TARGET)
    files = ("--registry", reg, "--targets", targets, "--ledger", ledger)
    done = run_ember("data", "register", "chats", chats, "--owner", "alice", "--licence", "private",
                     "--classification", "personal", "--registry", reg)
    assert done.returncode == 0, done.stderr
    public = ("data", "register", "alice-public", chats / "alice.jsonl", "--owner", "alice", "--licence", "CC0-1.0",
              "--classification", "public", "--allow", "lab", "--registry", reg, "--ledger", ledger)
    done = run_ember(*public)
    assert done.returncode == 1 and "'alice-public' (public) overlaps dataset 'chats' (personal" in done.stderr
    assert "alice-public" not in reg.read_text()
    done = run_ember(*public, "--override")
    assert done.returncode == 0, done.stderr
    rows = json.loads(run_ember("policy", "audit", "--verify", "--json", "--ledger", ledger).stdout)["rows"]
    assert [(r["action"], r["decision"]) for r in rows] == [("register", "override")]
    link = tmp_path / "public.jsonl"
    link.symlink_to(chats / "alice.jsonl")
    for path in (chats / "alice.jsonl", link):
        recipe = write_recipe(tmp_path / f"recipe-{path.name}", data={"files": [str(path)]})
        done = run_ember("policy", "check", recipe, "--target", "lab", *LIMITS, *files, "--json")
        assert done.returncode == 1, done.stderr
        decision = json.loads(done.stdout)
        assert sorted(v["code"] for v in decision["reasons"]) == ["classification", "dataset-target"]
        assert [(u["name"], u["staged"]) for u in decision["datasets"]] == [("alice-public", True), ("chats", False)]
    done = run_ember("policy", "check", recipe, "--target", "lab", "--max-wall-hours", "0", "--max-device-hours", "-1",
                     "--max-cost", "0.5", "--max-nodes", "1", *files)
    assert done.returncode == 1
    assert "invalid-limit: max_wall_hours = 0" in done.stdout and "invalid-limit: max_device_hours = -1" in done.stdout


def test_remote_help_lists_only_the_commands_a_user_runs():
    done = run_ember("remote", "--help")
    assert done.returncode == 0
    assert "SUPPRESS" not in done.stdout and "_allocation" not in done.stdout
    assert "{status,logs,cancel,continue}" in done.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`ember policy audit --json | head -1`: the command stops at the closed pipe without a word
    on stderr, with 141 (128 + SIGPIPE) as a shell shows for tools killed by SIGPIPE."""
    ledger = tmp_path / "ledger.db"
    con = store.connect(ledger)
    for i in range(300):  # about 300 kB of JSON: more than a pipe holds
        audit.append(con, {"time": float(i), "who": "a@b", "action": "check", "recipe": "/r.toml",
                           "recipe_digest": "d" * 64, "target": "lab", "datasets": [], "limits": {},
                           "prediction": {}, "decision": "refused", "reasons": [{"code": "x", "message": "y" * 500}]})
    con.close()
    proc = subprocess.Popen(ember_cmd("policy", "audit", "--json", "--ledger", ledger), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().strip() == b"{"
    proc.stdout.close()  # as head does after its lines
    _, err = proc.communicate(timeout=120)
    assert err == b"" and proc.returncode == 141
