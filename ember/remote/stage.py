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

import shlex
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ember.errors import Conflict, EmberError
from ember.events import Events
from ember.policy.registry import Dataset, fingerprint
from ember.remote.shell import Shell


def link_datasets(bundle: Path, datasets: list[Dataset]) -> None:
    """Lay out `bundle/data/NAME/I/BASENAME` as symbolic links to the registered paths (tar
    follows them while it copies)."""
    for ds in datasets:
        for i, p in enumerate(ds.paths):
            place = bundle / "data" / ds.name / str(i)
            place.mkdir(parents=True)
            (place / Path(p).name).symlink_to(p)


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


def upload(shell: Shell, folder: str, datasets: list[Dataset], events: Events) -> str:
    """Copy the datasets into `folder` there and verify them on arrival; data.sha256's text."""
    with tempfile.TemporaryDirectory(prefix="ember-stage-") as tmp:
        bundle = Path(tmp)
        link_datasets(bundle, datasets)
        events.stage(f"staging {len(datasets)} dataset(s) to {shell.where()}:{folder}")
        shell.put(bundle, folder)
    sums = verify_arrival(shell, folder, datasets)
    events.info(f"verified on arrival: {', '.join(d.name for d in datasets)} (fingerprints match)")
    return sums


def put_files(shell: Shell, folder: str, files: dict[str, str]) -> None:
    """Write `files` ({name: text}) into `folder` there."""
    with tempfile.TemporaryDirectory(prefix="ember-control-") as tmp:
        for name, text in files.items():
            (Path(tmp) / name).write_text(text)
        shell.put(Path(tmp), folder)
