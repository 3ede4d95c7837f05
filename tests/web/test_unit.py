"""`ember serve --install-unit`: the systemd user unit runs the ember that wrote it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from tests.helpers import ROOT, ember_cmd


def test_the_systemd_unit_runs_the_ember_that_wrote_it(tmp_path):
    home = tmp_path / "my home 100%"  # a space and a systemd specifier character
    env = {**os.environ, "EMBER_HOME": str(home), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    r = subprocess.run(ember_cmd("serve", "--install-unit"), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    path = tmp_path / "config" / "systemd" / "user" / "ember.service"
    assert r.returncode == 0 and f"wrote {path}" in r.stdout, r.stdout + r.stderr
    lines = [line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and line[0] != "#"]
    words = {k: [shlex.split(v.replace("%%", "%")) for key, v in lines if key == k] for k in ("ExecStart", "Environment")}
    assert words["ExecStart"] == [[sys.executable, "-m", "ember", "serve"]]  # this Python, not a bare `ember`
    unit_env = dict(w[0].split("=", 1) for w in words["Environment"])
    assert unit_env["EMBER_HOME"] == str(home)
    # What systemd starts, from its own folder with only the unit's environment: this ember, this home.
    probe = "import ember, ember.paths; print(ember.__file__, ember.paths.ember_home())"
    seen = subprocess.run([sys.executable, "-c", probe], cwd="/", env={"PATH": "/usr/bin:/bin", **unit_env},
                          capture_output=True, text=True, timeout=120)
    assert seen.stdout.strip() == f"{ROOT / 'ember' / '__init__.py'} {home}", seen.stdout + seen.stderr
