"""The commands that only read the ledger and files, or talk HTTP to the service, start without
torch or transformers (issue 31, item 2: `ember --help`, `queue`, `runs`, `submit` in a fraction of
a second; bench/startup.py times them), and the HTTP ones without the service's own modules nor
httpx. Each command runs in a fresh interpreter (not the warm fork of tests/warm.py, which has
torch loaded already) with an audit hook that records every import of those modules."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.helpers import ROOT, ember_cmd, write_recipe
from tests.serve_harness import Serve

HEAVY = ("torch", "transformers")
SERVICE = "ember.web.server"  # the service itself: uvicorn, the scheduler, the owner's rules
CLIENT = "httpx"  # 0.2 s to import: the commands speak HTTP with the standard library's http.client

SITECUSTOMIZE = """
import os, sys
_fd = os.open(os.environ["EMBER_TEST_IMPORTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
_watched = set(os.environ["EMBER_TEST_IMPORTS_OF"].split(","))
def _hook(event, args):
    if event == "import" and args[0] in _watched:
        os.write(_fd, f"{args[0]}\\n".encode())
sys.addaudithook(_hook)
"""


def imports_of(tmp_path, env: dict, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `ember ARGS` in a fresh interpreter; which of HEAVY, SERVICE and CLIENT it imported."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / f"imports-{len(list(tmp_path.glob('imports-*')))}"
    env = {**env, "PYTHONPATH": f"{hook}:{ROOT}", "EMBER_TEST_IMPORTS": str(log),
           "EMBER_TEST_IMPORTS_OF": ",".join((*HEAVY, SERVICE, CLIENT))}
    done = subprocess.run(ember_cmd(*args), capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    return done, set(log.read_text().split()) if log.exists() else set()


@pytest.mark.parametrize("args", [("--help",), ("runs",), ("runs", "--json"), ("capacity",), ("remote", "status"),
                                  ("policy", "audit"), ("data", "list"), ("settings", "owner"),
                                  ("report", "no-such-run"), ("submit", "--help")])
def test_the_commands_that_read_files_do_not_import_torch(tmp_path, args):
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home")}
    done, seen = imports_of(tmp_path, env, *args)
    assert done.returncode in (0, 1), done.stderr  # `report no-such-run` says it is not there
    assert not seen & set(HEAVY), f"`ember {' '.join(args)}` imported {sorted(seen)}"


def test_the_commands_that_talk_to_the_service_import_neither_torch_nor_the_service_nor_httpx(tmp_path):
    s = Serve(tmp_path / "home", f'[service]\nallowed = ["{tmp_path}"]\n[inference]\nenabled = false\n').start()
    try:
        recipe = write_recipe(tmp_path, train={"max_steps": 3})
        commands = [("yield", "--for", "10m"),  # first: the job submitted below waits, so it stays cheap
                    ("submit", str(recipe), "--name", "j", "--out", str(tmp_path / "run")), ("queue",),
                    ("queue", "--json"), ("queue", "--explain"), ("logs", "j"), ("pause", "j"), ("resume", "j"),
                    ("cancel", "j"), ("yield", "--release")]
        for args in commands:
            done, seen = imports_of(tmp_path, s.env, *args)
            assert done.returncode == 0, (args, done.stderr)
            assert not seen, f"`ember {' '.join(args)}` imported {sorted(seen)}"
    finally:
        s.jobs()  # the harness learns a job's process, to stop it too
        s.stop()


def test_a_plan_of_a_lora_model_seen_before_imports_neither_torch_nor_transformers(tmp_path):
    """LoRA's target modules are checked against the model's module names; building them imports
    torch and transformers once per model config, then they come from $EMBER_HOME/cache/modules:
    `ember plan` and the prediction of `ember submit --target` stay torch-free (issue 31, item 2).
    A target the model lacks is still refused, from the cache, naming its linear layers."""
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home")}
    recipe = write_recipe(tmp_path, method={"kind": "lora", "target_modules": ["q_proj", "v_proj"]},
                          cost={"peak_tflops": 1.0})  # no CPU peak to measure: that would import torch
    first, _ = imports_of(tmp_path, env, "plan", str(recipe))
    assert first.returncode == 0 and "fits: yes" in first.stdout, first.stderr
    again, seen = imports_of(tmp_path, env, "plan", str(recipe))
    assert again.returncode == 0 and "fits: yes" in again.stdout, again.stderr
    assert not seen & set(HEAVY), f"the second plan imported {sorted(seen)}"
    wrong, seen = imports_of(tmp_path, env, "plan", str(recipe), "--set", 'method.target_modules=["nope"]')
    assert wrong.returncode != 0 and "no layer named 'nope' in this model" in wrong.stderr, wrong.stderr
    assert "q_proj" in wrong.stderr and not seen & set(HEAVY), (wrong.stderr, seen)


def test_a_plan_fit_imports_neither_torch_nor_transformers(tmp_path):
    """`ember plan --fit` is the plan's arithmetic over a few hundred configurations: torch-free
    like the plan (LoRA over all linear layers needs no module names)."""
    env = {**os.environ, "EMBER_HOME": str(tmp_path / "home")}
    # no CPU peak nor CPU dequantization rate (QLoRA's time) to measure: that would import torch
    recipe = write_recipe(tmp_path, cost={"peak_tflops": 1.0, "memory_gbps": 1.0})
    done, seen = imports_of(tmp_path, env, "plan", str(recipe), "--fit", "2MB", "--fit-seq")
    assert done.returncode == 0 and "1. fastest that fits" in done.stdout, done.stderr
    assert not seen & set(HEAVY), f"`ember plan --fit` imported {sorted(seen)}"
