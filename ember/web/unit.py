"""The systemd *user* unit that runs `ember serve`, written by `ember serve --install-unit` for the
ember that writes it: its Python (a virtual environment's, unresolved, so the environment stays
in force), its source folder when that Python would not find it by itself (a checkout run with
`python -m ember` from its folder), and its $EMBER_HOME. A unit naming a bare `ember` runs
whichever one systemd's PATH finds first, or none."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import ember
from ember.errors import EmberError
from ember.paths import home

UNIT = """\
# ember serve as a systemd user service (the machine's owner runs it, not root), written by
# `ember serve --install-unit` for the ember in {source}.
#   systemctl --user daemon-reload && systemctl --user enable --now ember
#   loginctl enable-linger $USER     # keep it running when you are logged out
[Unit]
Description=ember: local training queue that steps aside for the owner and for inference
Documentation={docs}
After=network.target

[Service]
Type=simple
ExecStart={python} -m ember serve
{environment}
# Jobs run in their own sessions. KillMode=process: a restart of the service (an upgrade, a
# crash) does not kill training; the new service adopts the jobs that still run. On a stop the
# service itself preempts its jobs (checkpoint at the next step, exit 75) before it exits.
KillMode=process
TimeoutStopSec=150
Restart=on-failure
RestartSec=5
# The service never needs more than the user's own files.
NoNewPrivileges=yes
PrivateTmp=no

[Install]
WantedBy=default.target
"""


def quoted(value: str) -> str:
    """A value as systemd reads it back: `%` doubled (specifiers), quoted when it has spaces,
    quotes or backslashes."""
    value = value.replace("%", "%%")
    if any(c in value for c in ' \t"\\\''):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def source_folder() -> Path:
    """The folder holding this ember's package."""
    return Path(ember.__file__).resolve().parent.parent


def found_by_default(folder: Path) -> bool:
    """Whether this Python finds packages in `folder` from any folder and without PYTHONPATH
    (site-packages, an editable install's .pth), as it will under systemd."""
    own = {Path(p).resolve() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    return folder in {Path(p).resolve() for p in sys.path[1:] if p} - own  # [0]: where it was started


def unit_text() -> str:
    """The unit for the ember running this function."""
    source = source_folder()
    env = [f"EMBER_HOME={home().root.absolute()}", "HF_HUB_OFFLINE=1"]
    if not found_by_default(source):
        env.insert(0, f"PYTHONPATH={source}")
    return UNIT.format(source=source, docs=quoted(home().owner_toml.absolute().as_uri()),
                       python=quoted(os.path.abspath(sys.executable)),
                       environment="\n".join(f"Environment={quoted(e)}" for e in env))


def unit_path() -> Path:
    """Where systemd looks for the user's units: $XDG_CONFIG_HOME/systemd/user/ember.service."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "systemd" / "user" / "ember.service"


def install_unit() -> tuple[Path, bool]:
    """Write the unit; where, and whether it replaced a different one."""
    path, text = unit_path(), unit_text()
    try:
        replaced = path.exists() and path.read_text() != text
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as e:
        raise EmberError(f"cannot write the systemd unit {path}: {e}") from None
    return path, replaced
