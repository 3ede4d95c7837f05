"""`ember submit` keeps its local path (the service) without --target, and refuses remote-only
flags there; `ember data register|list|verify` end to end."""

from __future__ import annotations

import json

from tests.helpers import GENESIS, run_ember, write_recipe


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
