"""A real Slurm for the remote backend's tests: tests/slurm_cluster.sh installs Debian's packages
when they are missing and starts munged, MariaDB, slurmdbd, slurmctld and slurmd on 127.0.0.1, all
state in a temporary folder; the daemons are stopped, by the PIDs they wrote there, at the end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "slurm_cluster.sh"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    """The cluster's state folder; SLURM_CONF is set for this process and its children."""
    if os.geteuid() != 0:
        pytest.skip("a real Slurm needs root here: its daemons run as root (slurmd starts jobs as their "
                    "user) and installing Debian's packages does too; run as root, or `make test` in CI")
    state = tmp_path_factory.mktemp("slurm")
    try:
        done = subprocess.run([str(SCRIPT), "start", str(state)], capture_output=True, text=True, timeout=1200)
    except BaseException:  # interrupted or timed out half-way: stop what did start
        subprocess.run([str(SCRIPT), "stop", str(state)], capture_output=True, timeout=120)
        raise
    if done.returncode != 0:
        subprocess.run([str(SCRIPT), "stop", str(state)], capture_output=True, timeout=120)
        pytest.fail(f"{SCRIPT} start failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    conf = next(line.split("=", 1)[1] for line in done.stdout.splitlines() if line.startswith("SLURM_CONF="))
    os.environ["SLURM_CONF"] = conf
    try:
        yield state
    finally:
        os.environ.pop("SLURM_CONF", None)
        subprocess.run([str(SCRIPT), "stop", str(state)], capture_output=True, timeout=120)


SSHD_CONFIG = """Port {port}
ListenAddress 127.0.0.1
HostKey {dir}/host_key
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AcceptEnv SLURM_CONF EMBER_HOME HF_HUB_OFFLINE TRANSFORMERS_OFFLINE
"""


@pytest.fixture(scope="session")
def sshd(slurm, tmp_path_factory: pytest.TempPathFactory):
    """An SSH server on a port of 127.0.0.1 with its own host key and one authorized key (the
    package comes with the Slurm set-up's install); the ssh options that reach it as root, with
    this session's SLURM_CONF and EMBER_HOME passed along."""
    folder = tmp_path_factory.mktemp("sshd")
    for key in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / key)], check=True)
    (folder / "authorized_keys").write_text((folder / "client_key.pub").read_text())
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (folder / "sshd_config").write_text(SSHD_CONFIG.format(port=port, dir=folder))
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    done = subprocess.run(["/usr/sbin/sshd", "-f", str(folder / "sshd_config"), "-E", str(folder / "sshd.log")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"sshd did not start: {done.stderr}")
    env = f"SLURM_CONF={os.environ['SLURM_CONF']} EMBER_HOME={os.environ['EMBER_HOME']} HF_HUB_OFFLINE=1"
    options = ["-p", str(port), "-i", str(folder / "client_key"), "-o", "StrictHostKeyChecking=no",
               "-o", f"UserKnownHostsFile={folder / 'known_hosts'}", "-o", f"SetEnv={env}"]
    try:
        yield options
    finally:
        pid = (folder / "sshd.pid").read_text().strip() if (folder / "sshd.pid").exists() else ""
        if pid:
            os.kill(int(pid), 15)
