"""Staging: the datasets a job was allowed to take, copied into its folder on the cluster and
verified there, and its recipe rewritten to read the copies. A backend whose jobs live in a folder
its Shell reaches (Slurm's) stages with `new_folder`, `upload` and `put_files`.

    JOB/data/NAME/PLACE      each file of dataset NAME at its place (ember.policy.registry.members:
                             '0/genesis.jsonl'), so the copy's fingerprint is computed over the
                             same names as the registered one
    JOB/data.sha256          every staged file's SHA-256 as hashed on arrival (`sha256sum` there);
                             each allocation checks it again before training
"""

from __future__ import annotations

import hashlib
import os
import shlex
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from ember.durable import sha256_file
from ember.errors import Conflict, EmberError
from ember.events import Events
from ember.policy.registry import Dataset, fingerprint, members
from ember.remote.shell import Shell

SPOOL_BYTES = 64 << 20  # a staged file is spooled in memory up to this size, on disk beyond


def staged_path(file: str, datasets: list[Dataset]) -> str:
    """Where data file `file` (a registered path, or a file inside a registered folder) is
    staged, relative to the job's folder."""
    for ds in datasets:
        for i, p in enumerate(ds.paths):
            base = f"data/{ds.name}/{i}/{Path(p).name}"
            if file == p:
                return base
            if file.startswith(p.rstrip("/") + "/"):
                return f"{base}/{file[len(p.rstrip('/')) + 1:]}"
    raise EmberError(f"{file}: in no staged dataset")  # the gate refused such a job already


def verify_arrival(shell: Shell, job_dir: str, datasets: list[Dataset]) -> str:
    """Hash every staged file where it arrived; refuse unless each dataset's copy has its
    registered fingerprint. Returns data.sha256's text."""
    out = shell.text(["sh", "-c", f"cd {shlex.quote(job_dir)} && find data -type f -exec sha256sum {{}} +"],
                     timeout=3600)
    per: dict[str, list[tuple[str, str]]] = {ds.name: [] for ds in datasets}
    lines = []
    for line in out.splitlines():
        if line.startswith("\\"):
            raise EmberError(f"a staged file's name holds a backslash or a newline ({line[:80]!r}): rename it")
        digest, _, name = line.partition("  ")
        parts = name.split("/", 2)
        if len(parts) != 3 or parts[1] not in per:
            raise EmberError(f"{job_dir}/{name}: staged, but in no dataset of this job")
        per[parts[1]].append((parts[2], digest))
        lines.append(f"{digest}  {name}\n")
    for ds in datasets:
        got = fingerprint(per[ds.name])
        if got != ds.fingerprint:
            raise EmberError(f"dataset '{ds.name}' arrived at {shell.where()}:{job_dir} with fingerprint "
                             f"{got[:19]}..., not the registered {ds.fingerprint[:19]}...: the copy is "
                             f"refused; the job was not submitted")
    return "".join(sorted(lines))



@contextmanager
def new_folder(shell: Shell, folder: str) -> Iterator[None]:
    """A job's new folder there: Conflict when it exists already; removed when what runs inside
    the block fails (nothing runs from it: no staged data is left behind)."""
    if shell.run(["test", "-e", folder], check=False).returncode == 0:
        raise Conflict(f"{shell.where()}:{folder} exists: another job's folder; choose another --name")
    try:
        yield
    except BaseException as e:
        gone = shell.run(["rm", "-rf", folder], check=False)
        if gone.returncode != 0 and isinstance(e, EmberError):
            raise EmberError(f"{e}\nthe staged folder {shell.where()}:{folder} could not be removed "
                             f"({gone.stderr.decode(errors='replace').strip()}); remove it") from None
        raise


def upload(shell: Shell, folder: str, datasets: list[Dataset], events: Events,
           digests: Mapping[str, str] | None = None) -> str:
    """Copy the datasets into `folder` there and verify them on arrival; data.sha256's text.

    What is sent is what was hashed. Each dataset's files (members: what its fingerprint covers,
    nothing behind a link to a folder) have their SHA-256 from the gate's decision (`digests`, by
    path: the gate read every byte) or, for a file it did not read, from reading it here; a
    dataset whose files no longer make its registered fingerprint is refused before a byte leaves.
    Then each file is read once more into a spool and sent only if those bytes hash as the gate
    saw them: a file changed meanwhile cuts the copy off before its bytes go. A dataset is read
    twice in all, once to decide and once to send."""
    digests = digests or {}
    checked: list[tuple[str, Path, str]] = []
    for ds in datasets:
        files = [(place, f, digests.get(str(f)) or sha256_file(f)) for place, f in members(ds.paths)]
        got = fingerprint([(place, digest) for place, _, digest in files])
        if got != ds.fingerprint:
            raise EmberError(f"dataset '{ds.name}' changed since the gate checked it ({got[:19]}... now, "
                             f"{ds.fingerprint[:19]}... registered): nothing was sent; check it, then `ember data "
                             f"register` it again")
        checked += [(f"data/{ds.name}/{place}", f, digest) for place, f, digest in files]
    events.stage(f"staging {len(datasets)} dataset(s) to {shell.where()}:{folder}")
    shell.put_tar(folder, lambda out: _write_checked(out, checked))
    sums = verify_arrival(shell, folder, datasets)
    events.info(f"verified on arrival: {', '.join(d.name for d in datasets)} (fingerprints match)")
    return sums


def _write_checked(out: IO[bytes], checked: list[tuple[str, Path, str]]) -> None:
    """A tar stream of `checked` (name in the stream, file, its SHA-256 as hashed): each file is
    spooled while it is hashed and written only when the hash is still the one checked."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, f, digest in checked:
            with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool, open(f, "rb") as src:
                h = hashlib.sha256()
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    spool.write(chunk)
                if h.hexdigest() != digest:
                    raise EmberError(f"{f} changed while it was staged: the copy was cut off before its bytes were "
                                     f"sent; check it, then `ember data register` its dataset again")
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = spool.tell(), 0o644, int(os.stat(f).st_mtime)
                spool.seek(0)
                tar.addfile(info, spool)


def put_files(shell: Shell, folder: str, files: dict[str, str]) -> None:
    """Write `files` ({name: text}) into `folder` there."""
    with tempfile.TemporaryDirectory(prefix="ember-control-") as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        shell.put(Path(tmp), folder)
