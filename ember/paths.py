"""Where ember keeps state outside a run folder (`Home`: the one map of $EMBER_HOME), and content
hashes of large files.

    $EMBER_HOME (default ~/.ember)
      ledger.db                 runs, attempts, events, jobs, the audit log (ember.ledger)
      owner.toml                the owner's rules `ember serve` follows (docs/owner.md)
      targets.toml              remote targets and their caps (docs/targets.md)
      datasets.toml             the dataset registry (docs/datasets.md)
      machine.toml              this machine's prices and power (docs/machine.md)
      runs/NAME/                default run folders of jobs
      models/                   GGUF files dequantized into model folders
      scratch/                  private working folders: the doctor's and preflight's jobs, the
                                ranks' error files, the data-loader workers' sockets (ember.scratch:
                                one made removes those of dead owners)
      cache/tokens/KEY/         token caches of training data
      cache/sha256.json         content hashes by (path, size, mtime)
      cache/cpu_peak.json       measured CPU peaks, per machine
      cache/modules/KEY.json    a model's module names (LoRA's targets), by its config
      cache/gguf/SHA.json       a GGUF file's tensor index ([method] quantize = 'gguf'), by its content
      cache/traced/KEY.json     a step traced on fake tensors (the plan of a family without formulas)
      cache/packages.json       the installed packages, by sys.path's folders' modification times
      cache/inductor/           torch.compile's caches ([train] compile; ember.train.compiled)
      logs/libraries.log        what libraries said below the commands
      serve/                    the service: serve.lock, token, serve.json, ui.json, engine.json,
                                engine.log, yield.json, control/JOB/, jobs/JOB.log
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ember.durable import sha256_file
from ember.errors import BadInput, Refused

# A job's name (local or remote) names its default run folder and its staging folder: one path
# segment, never '.', '..' or anything with a separator, short enough to show.
NAME_GRAMMAR = "[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_NAME = re.compile(NAME_GRAMMAR)


@dataclass(frozen=True)
class Home:
    """Every file and folder ember keeps under $EMBER_HOME, by name (the layout in the module
    docstring): callers ask for `home().ledger`, never join paths under the root themselves."""
    root: Path

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.db"

    @property
    def owner_toml(self) -> Path:
        return self.root / "owner.toml"

    @property
    def targets_toml(self) -> Path:
        return self.root / "targets.toml"

    @property
    def datasets_toml(self) -> Path:
        return self.root / "datasets.toml"

    @property
    def machine_toml(self) -> Path:
        return self.root / "machine.toml"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def scratch(self) -> Path:
        return self.root / "scratch"

    @property
    def cache(self) -> Path:
        return self.root / "cache"

    def token_cache(self, key: str) -> Path:
        """The token cache of one tokenization (its key names the files, tokenizer and settings)."""
        return self.cache / "tokens" / key

    @property
    def sha256_cache(self) -> Path:
        return self.cache / "sha256.json"

    @property
    def cpu_peak_cache(self) -> Path:
        return self.cache / "cpu_peak.json"

    @property
    def inductor_cache(self) -> Path:
        """TORCHINDUCTOR_CACHE_DIR of compiled runs: FX graphs, AOTAutograd, generated kernels."""
        return self.cache / "inductor"

    @property
    def packages_cache(self) -> Path:
        """The installed packages a run's manifest lists (ember.ledger.manifest.installed_packages)."""
        return self.cache / "packages.json"

    def traced_cache(self, key: str) -> Path:
        """A training step traced on fake tensors (ember.doctor.traced), keyed by what shapes it."""
        return self.cache / "traced" / f"{key}.json"

    def gguf_tensors_cache(self, sha256: str) -> Path:
        """A GGUF file's architecture and 2-D tensors' places (ember.train.gguf_blocks), by its content."""
        return self.cache / "gguf" / f"{sha256[:32]}.json"

    def module_names_cache(self, key: str) -> Path:
        """A model's module names (ember.models.module_names), keyed by its config."""
        return self.cache / "modules" / f"{key}.json"

    @property
    def libraries_log(self) -> Path:
        return self.root / "logs" / "libraries.log"

    @property
    def serve(self) -> Path:
        """The service's folder: its lock, token, address files, engine, yield and per-job files."""
        return self.root / "serve"

    @property
    def serve_token(self) -> Path:
        return self.serve / "token"

    def job_control(self, job: int) -> Path:
        """The folder of one job's control files (ember.control)."""
        return self.serve / "control" / str(job)

    def job_log(self, job: int) -> Path:
        """One job's output (`ember logs`)."""
        return self.serve / "jobs" / f"{job}.log"

    def job_launch(self, job: int) -> Path:
        """What the service launched a job with (ember.launchspec), read by its processes."""
        return self.serve / "jobs" / f"{job}.launch.json"

    def recipe_snapshot(self, digest: str) -> Path:
        """A submitted recipe as it was admitted (resolved), by its digest: what the job trains."""
        return self.serve / "recipes" / f"{digest[:16]}.toml"


def home() -> Home:
    """$EMBER_HOME (default ~/.ember), read now: a test or a child may set it."""
    return Home(Path(os.environ.get("EMBER_HOME") or Path.home() / ".ember"))


def ember_home() -> Path:
    """$EMBER_HOME's root itself (for a child's environment); a file under it is `home().NAME`."""
    return home().root


class NotOwnFile(OSError):
    """A file ember would write into names something else too (a hard link) or is no regular file."""


def open_own_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of `path` opened with `flags` (none that truncates: the file is checked once
    open) for a file ember writes into in a folder others can write to (a run folder's .lock and
    console.log): never through a symbolic link (OSError ELOOP), and NotOwnFile where the file has
    other names (a hard link: writing would change the file it shares) or is no regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1:  # 0: removed meanwhile, which changes nothing else
        return fd
    os.close(fd)
    what = f"a hard link (the file has {st.st_nlink} names)" if stat.S_ISREG(st.st_mode) else "not a regular file"
    raise NotOwnFile(errno.EMLINK if stat.S_ISREG(st.st_mode) else errno.EINVAL, what, str(path))


def ascii_digits(text: str) -> bool:
    """Whether `text` is one or more ASCII digits, the number int() reads it as: str.isdigit alone
    also takes '²' (int() refuses it) and '٣' (int() reads it as 3)."""
    return text.isascii() and text.isdigit()


def check_name(name: str, what: str = "job name") -> str:
    """`name` when it follows NAME_GRAMMAR; otherwise a BadInput that shows the grammar."""
    if not _NAME.fullmatch(name):
        shown = name if len(name) <= 80 else f"{name[:60]}... ({len(name)} characters)"
        raise BadInput(f"{what} {shown!r}: use 1 to 64 letters, digits, '.', '_' or '-', starting with a "
                       f"letter or digit ({NAME_GRAMMAR}); it names the job's run folder")
    return name


def check_job_name(name: str, what: str = "job name") -> str:
    """A job's `name` (check_name), and not digits alone: a job is found by its name or its id, so
    a job named '2' would be confused with job 2."""
    check_name(name, what)
    if name.isdigit():
        raise BadInput(f"{what} {name!r}: digits alone would be read as a job's id (`ember cancel 2` is job "
                       f"2); add a letter, e.g. 'job-{name}'")
    return name


def name_from(stem: str, suffix: str) -> str:
    """A valid name made of a file's stem (other characters become '-') and a unique suffix."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("._-")[: 63 - len(suffix)].rstrip("._-") or "job"
    return check_name(f"{base}-{suffix}")


def default_run_folder(name: str) -> Path:
    """$EMBER_HOME/runs/NAME, resolved; refused when it resolves elsewhere (a link put there)."""
    root = home().runs.resolve()
    folder = (root / check_name(name)).resolve()
    if folder.parent != root:
        raise Refused(f"run folder {root / name} resolves to {folder}, outside {root}; remove "
                      f"the link or give the job an --out")
    return folder


def cached_sha256(path: Path) -> str:
    """SHA-256 of a file, remembered by (path, size, mtime, inode, ctime) so large model files
    hash once. The inode and the change time are in the key because the others can be kept by a
    replacement: `cp -p`, `rsync -a` or `tar x` of other bytes of the same size set the old mtime,
    and were read as the old file (its cached tokens trained, a changed dataset's resume allowed);
    no tool can set a file's ctime."""
    path = path.resolve()
    st = path.stat()
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}:{st.st_ctime_ns}"
    cache_file = home().sha256_cache
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = sha256_file(path)
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        os.replace(tmp, cache_file)  # a cache: atomic, but needs no fsync
    return cache[key]
