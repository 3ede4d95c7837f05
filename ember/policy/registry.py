"""The dataset registry: `datasets.toml`, what each dataset is, whose, under which licence and
classification, and which remote targets it may go to.

    [datasets.genesis]
    paths = ["/data/genesis.jsonl"]          # files or folders (a save_to_disk dataset)
    fingerprint = "sha256:..."                # written by `ember data register`
    owner = "alice"
    licence = "CC0-1.0"
    classification = "public"                 # public | internal | restricted | personal
    allowed_targets = ["cluster"]             # default none: local only
    expires = "2027-06-30"                    # optional: the permission ends after this day (UTC)
    files = ["<sha256>  0/genesis.jsonl"]     # written by `ember data register`: each file as registered

Two files are read: the project's (`./datasets.toml`) and the machine's
(`$EMBER_HOME/datasets.toml`); a name in both is refused rather than one silently winning.
`--registry FILE` reads that file alone. The fingerprint is a SHA-256 over every file's place in
the dataset and its content hash (`fingerprint()`), the same whether computed here or over the
staged copy on a cluster; a file that changed is refused until the dataset is registered again.
`files` keeps each file's SHA-256 and place as registered (sha256sum's format), so that a copy of
what was registered is known by its content after the original changed, moved or went away, and
`ember data verify` names the files that changed.

A file may be in several datasets: listed in one, inside a folder listed in another, or a copy of
another's file. It counts as every dataset that holds it, by path (after realpath) or by content
(its SHA-256 among a dataset's files'): the gate applies each one's permission, and the most
restrictive classification (`holdings`). Registering a dataset that overlaps one of another
classification is refused, naming both, unless `--override` asks for it; the override is a row of
the audit log (`register`). So is registering a name again as less than it was (a less
restrictive classification, or another owner): the same `--override`, the same audit row.
"""

from __future__ import annotations

import datetime as dt
import getpass
import hashlib
import json
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ember.config import NAME, build_entries, derived, did_you_mean, read_toml, reference, rows, setting, toml_value
from ember.durable import sha256_file
from ember.errors import EmberError
from ember.ledger import audit
from ember.ledger import database as ledger_store
from ember.paths import cached_sha256, home

CLASSIFICATIONS = ("public", "internal", "restricted", "personal")


@dataclass
class Dataset:
    paths: list[str] = setting(list, "Absolute paths of the dataset's files or folders.", factory=True,
                               required=True)
    fingerprint: str = setting("", "sha256:HEX over the files (ember data register computes it).",
                               required=True)
    owner: str = setting("", "Who answers for the dataset.", required=True)
    licence: str = setting("", "The licence it is used under (an SPDX name, or the contract's).",
                           required=True)
    classification: str = setting("", "public, internal, restricted or personal.", required=True)
    allowed_targets: list[str] = setting(list, "Targets (targets.toml) it may be staged to; none: "
                                         "local only.", factory=True)
    expires: str = setting("", "Last day (YYYY-MM-DD, UTC) the permission holds; '' never ends.")
    files: list[str] = setting(list, "Each file's SHA-256 and place as registered ('HEX  0/a.jsonl', "
                               "sha256sum's format; ember data register writes them): a copy of a registered "
                               "file is known by content after the original changed or moved.", factory=True)
    name: str = derived("set from the table name")
    source: str = derived("the file it was read from")

    def expiry(self) -> float | None:
        """The end of the permission as a UTC timestamp (the end of its last day), or None."""
        if not self.expires:
            return None
        day = dt.date.fromisoformat(self.expires)
        return dt.datetime.combine(day + dt.timedelta(days=1), dt.time(), dt.timezone.utc).timestamp()

    def registered_files(self) -> dict[str, str]:
        """{place: SHA-256} of the files as registered ({} for an entry written before `files`)."""
        return {line[66:]: line[:64] for line in self.files}


Registry = dict[str, Dataset]


def registry_files(explicit: Path | None = None) -> list[Path]:
    """The files a registry is read from: `explicit` alone, else the project's and the machine's
    (once, when they are the same file: run from $EMBER_HOME, or one a link to the other)."""
    if explicit is not None:
        return [explicit]
    return distinct([Path("datasets.toml"), home().datasets_toml])


def distinct(paths: list[Path]) -> list[Path]:
    """`paths` without those that name a file already listed (after realpath)."""
    seen: set[str] = set()
    out = []
    for p in paths:
        if os.path.realpath(p) not in seen:
            seen.add(os.path.realpath(p))
            out.append(p)
    return out


def load_registry(explicit: Path | None = None) -> Registry:
    """Every registered dataset, validated like a recipe; a missing file is an empty registry
    (unless named explicitly)."""
    if explicit is not None and not explicit.is_file():
        raise EmberError(f"--registry {explicit}: no such file")
    out: Registry = {}
    for path in registry_files(explicit):
        for name, ds in _read(path).items():
            if name in out:
                raise EmberError(f"{path}: dataset '{name}' is also registered in {out[name].source}; "
                                 f"keep one of them")
            out[name] = ds
    return out


def _read(path: Path) -> Registry:
    if not path.is_file():
        return {}
    raw, source = read_toml(path)
    out = build_entries(Dataset, raw, "datasets", source,
                        "`ember data register` writes a complete entry")
    for name, ds in out.items():
        at = source.where
        if ds.classification not in CLASSIFICATIONS:
            raise EmberError(f"{at('datasets', name, 'classification')} = {ds.classification!r}: one of "
                             f"{', '.join(CLASSIFICATIONS)}")
        if not ds.fingerprint.startswith("sha256:") or len(ds.fingerprint) != 71:
            raise EmberError(f"{at('datasets', name, 'fingerprint')} = {ds.fingerprint!r}: expected "
                             f"sha256:<64 hex digits>; run `ember data register` again")
        if any(not os.path.isabs(p) for p in ds.paths):
            raise EmberError(f"{at('datasets', name, 'paths')}: each must be absolute")
        if ds.expires:
            try:
                dt.date.fromisoformat(ds.expires)
            except ValueError:
                raise EmberError(f"{at('datasets', name, 'expires')} = {ds.expires!r}: write a date, "
                                 f"YYYY-MM-DD") from None
        bad = next((line for line in ds.files if not FILE_LINE.match(line)), None)
        if bad is not None:
            raise EmberError(f"{at('datasets', name, 'files')}: {bad!r} is not '<64 hex digits>  <place>'; "
                             f"run `ember data register` again")
        if ds.files and fingerprint(list(ds.registered_files().items())) != ds.fingerprint:
            raise EmberError(f"{at('datasets', name, 'files')}: the files' hashes do not make the registered "
                             f"fingerprint (edited by hand?); run `ember data register` again")
        ds.name, ds.source = name, str(path)
    return out


FILE_LINE = re.compile(r"^[0-9a-f]{64}  \S.*$")  # sha256sum's format: HEX, two spaces, the place


HEADER = """# The dataset registry (`datasets.toml`)

Generated by `ember settings datasets --markdown > docs/datasets.md` from `ember/policy/registry.py`.
What each dataset is, whose, under which licence and classification, and which remote targets it
may go to. `ember data register` writes complete entries; the gate (`ember policy check`,
`ember submit --target`) reads `./datasets.toml` and `$EMBER_HOME/datasets.toml` (a name in both is
refused), or `--registry FILE` alone. Each dataset is a table `[datasets.NAME]` (NAME: letters,
digits, '_', '.', '-'). A key marked `required` must be stated. An error names the file, the line
and the key.
"""


def datasets_reference() -> str:
    """docs/datasets.md: every key of a dataset entry with its type, default and meaning."""
    return reference(HEADER, rows({"datasets.NAME": Dataset}))


def members(paths: list[str]) -> list[tuple[str, Path]]:
    """Every file of a dataset with its place in it: '0/genesis.jsonl', '1/corpus/part-0.arrow'.
    The place is the staged copy's path under data/NAME/ too, so both sides hash the same names."""
    out = []
    for i, p in enumerate(paths):
        path = Path(p)
        if path.is_dir():
            out += [(f"{i}/{path.name}/{f.relative_to(path).as_posix()}", f)
                    for f in sorted(path.rglob("*")) if f.is_file()]
        else:
            out.append((f"{i}/{path.name}", path))
    return out


def fingerprint(hashes: list[tuple[str, str]]) -> str:
    """sha256: over (place, file SHA-256) pairs, in order of place."""
    h = hashlib.sha256()
    for place, digest in sorted(hashes):
        h.update(f"{place}\0{digest}\n".encode())
    return "sha256:" + h.hexdigest()


def fingerprint_files(paths: list[str], digest: Callable[[Path], str] = sha256_file) -> str:
    """The fingerprint of the files as they are now (every byte read: no cache, this is the gate;
    `digest` may remember what it read in this decision)."""
    return fingerprint(list(hash_files(paths, digest).items()))


def hash_files(paths: list[str], digest: Callable[[Path], str] = sha256_file) -> dict[str, str]:
    """{place: SHA-256} of the files as they are now."""
    missing = [p for p in paths if not Path(p).exists()]
    if missing:
        raise EmberError(f"{missing[0]}: no such file or folder")
    return {place: digest(f) for place, f in members(paths)}


@dataclass(frozen=True)
class Holding:
    source: str | None          # the dataset that lists it most closely by path: it is staged from there
    holders: tuple[str, ...]    # every dataset that holds it, by path or by content (the source too)


def nested(a: str, b: str) -> bool:
    """Whether path `a` is `b` or inside it."""
    return a == b or a.startswith(b.rstrip("/") + "/")


def holdings(files: list[str], registry: Registry, contents: Mapping[str, frozenset[str]] | None = None,
             registered: Mapping[str, frozenset[str]] | None = None) -> dict[str, Holding]:
    """Which datasets hold each data path a job reads (pure; the caller resolves the paths and
    hashes): by path, the path listed, inside a folder listed, or a folder holding a listed path;
    by content, one of its files' SHA-256 (`contents[path]`) among a dataset's (`registered[name]`)."""
    contents, registered = contents or {}, registered or {}
    out = {}
    for f in files:
        listing: list[tuple[int, str]] = []
        held = set()
        for name, ds in sorted(registry.items()):
            for p in ds.paths:
                if nested(f, p):
                    listing.append((-len(p.rstrip("/")), name))
                elif nested(p, f):
                    held.add(name)
            if contents.get(f, frozenset()) & registered.get(name, frozenset()):
                held.add(name)
        source = min(listing)[1] if listing else None
        out[f] = Holding(source, tuple(sorted(held | {n for _, n in listing})))
    return out


def covering(files: list[str], registry: Registry) -> tuple[dict[str, list[str]], list[str]]:
    """The dataset each file is staged from (by path: the one listing it most closely):
    ({dataset: [files]}, [files in none])."""
    used: dict[str, list[str]] = {}
    outside = []
    for f, h in holdings(files, registry).items():
        if h.source is None:
            outside.append(f)
        else:
            used.setdefault(h.source, []).append(f)
    return used, outside


EMPTY = hashlib.sha256(b"").hexdigest()


def contents_of(paths: list[str], digest: Callable[[Path], str] = cached_sha256) -> frozenset[str]:
    """The SHA-256 of every file under `paths` that exists, for content identity (a missing file
    is the fingerprint's business; an empty file, in many datasets, is nobody's copy)."""
    return frozenset(digest(f) for _, f in members([p for p in paths if Path(p).exists()])) - {EMPTY}


def dataset_contents(ds: Dataset, digest: Callable[[Path], str] = cached_sha256) -> frozenset[str]:
    """What a dataset holds by content: its files as registered and as they are now. A copy of
    what was registered stays the dataset's after the original changed, moved or was deleted."""
    return contents_of(ds.paths, digest) | (frozenset(ds.registered_files().values()) - {EMPTY})


def most_restrictive(classifications: list[str]) -> str:
    return max(classifications, key=CLASSIFICATIONS.index)


@dataclass(frozen=True)
class Overlap:
    other: Dataset
    file: str       # one file both hold
    how: str        # "by path" | "by content"

    def message(self, name: str, classification: str) -> str:
        o = self.other
        worst = most_restrictive([classification, o.classification])
        return (f"'{name}' ({classification}) overlaps dataset '{o.name}' ({o.classification}, {o.source}): "
                f"{self.file} is in both ({self.how}); a file counts as the most restrictive dataset that "
                f"holds it, here {worst}")


def overlaps(name: str, paths: list[str], digests: dict[str, str], classification: str,
             others: Registry) -> list[Overlap]:
    """The datasets of another classification that share a file with the new one: by path
    (after realpath) or by content (`digests`: the new dataset's files' SHA-256)."""
    out = []
    mine = [os.path.realpath(p) for p in paths]
    for other_name, other in sorted(others.items()):
        if other_name == name or other.classification == classification:
            continue
        theirs = [os.path.realpath(p) for p in other.paths]
        pair = next(((a, b) for a in mine for b in theirs if nested(a, b) or nested(b, a)), None)
        if pair is not None:
            out.append(Overlap(other, max(pair, key=len), "by path"))
            continue
        shared = dataset_contents(other)
        same = next((f for f, d in sorted(digests.items()) if d in shared and d != EMPTY), None)
        if same is not None:
            out.append(Overlap(other, same, "by content"))
    return out


def register(file: Path, name: str, paths: list[Path], owner: str, licence: str, classification: str,
             allowed_targets: list[str], expires: str, *, override: bool = False,
             ledger: Path | None = None) -> Dataset:
    """Add or replace `name` in registry file `file`, fingerprinting its files now. An overlap
    with a dataset of another classification, or a name registered again with a less restrictive
    classification or another owner, is refused, or with `override` appended to the audit log in
    `ledger` (default $EMBER_HOME/ledger.db) and registered."""
    if not NAME.match(name):
        raise EmberError(f"dataset name {name!r}: letters, digits, '_', '.' and '-'")
    if classification not in CLASSIFICATIONS:
        raise EmberError(f"--classification {classification!r}: one of {', '.join(CLASSIFICATIONS)}")
    if not paths or not owner or not licence:
        raise EmberError("a dataset needs at least one path, an --owner and a --licence")
    if expires:
        try:
            dt.date.fromisoformat(expires)
        except ValueError:
            raise EmberError(f"--expires {expires!r}: write a date, YYYY-MM-DD") from None
    absolute = [str(p.resolve()) for p in paths]
    inside = next((p for p in absolute if nested(os.path.realpath(file), p)), None)
    if inside is not None:
        raise EmberError(f"{file}: the registry file is inside the dataset ({inside}): writing it would change "
                         f"the files it fingerprints, and it would be staged with them; keep the registry "
                         f"outside the dataset (run from another folder, or pass --registry FILE)")
    digests: dict[str, str] = {}

    def digest(f: Path) -> str:
        digests[str(f)] = sha256_file(f)
        return digests[str(f)]

    hashes = hash_files(absolute, digest)
    ds = Dataset(absolute, fingerprint(list(hashes.items())), owner, licence, classification,
                 list(allowed_targets), expires, [f"{h}  {place}" for place, h in sorted(hashes.items())])
    entries = _read(file)
    others = _others(file, entries)
    found = overlaps(name, absolute, digests, classification, others)
    looser = loosened(others[name], ds) if name in others else []
    if (found or looser) and not override:
        was = others.get(name)
        raise EmberError("\n".join([o.message(name, classification) for o in found]
                                   + [f"'{name}' is registered in {was.source if was else file} as it would no "
                                      f"longer be: {change}" for change in looser])
                         + "\nnothing was registered: keep the classification and owner it had, "
                         "leave the shared files out, or pass --override to register it anyway (audited; the gate "
                         "still treats each shared file as the most restrictive dataset that holds it)")
    ds.name, ds.source = name, str(file)
    if found or looser:
        _audit_override(ds, found, looser, others.get(name), ledger)
    entries[name] = ds
    text = "".join(_toml(n, d) for n, d in sorted(entries.items()))
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, file)
    return ds


def loosened(old: Dataset, new: Dataset) -> list[str]:
    """What `new` changes of `old` that the overlap check guards (pure): a less restrictive
    classification (the data, copies included, would count as less than it was registered), or
    another owner answering for it. Targets and an expiry are the owner's to grant: the gate
    still holds each target to its allowed classifications."""
    out = []
    if CLASSIFICATIONS.index(new.classification) < CLASSIFICATIONS.index(old.classification):
        out.append(f"classification {old.classification} -> {new.classification}")
    if new.owner != old.owner:
        out.append(f"owner {old.owner} -> {new.owner}")
    return out


def _others(file: Path, entries: Registry) -> Registry:
    """The datasets a new registration in `file` may overlap: that file's and the default
    registries' (a name in several: the first seen)."""
    out = dict(entries)
    for path in registry_files():
        if path.resolve() != file.resolve():
            for n, ds in _read(path).items():
                out.setdefault(n, ds)
    return out


def _audit_override(ds: Dataset, found: list[Overlap], looser: list[str], was: Dataset | None,
                    ledger: Path | None) -> None:
    """The override, as a row of the gate's audit log: who registered which overlap, or what the
    name lost of what it was."""
    con = ledger_store.connect(ledger)
    try:
        audit.append(con, {
            "time": time.time(), "who": f"{getpass.getuser()}@{socket.gethostname()}", "action": "register",
            "recipe": ds.source, "recipe_digest": "", "target": "",
            "datasets": [_entry(ds)] + [_entry(o.other) for o in found] + ([_entry(was)] if looser and was else []),
            "limits": {}, "prediction": {}, "decision": "override",
            "reasons": [{"code": "overlap", "message": o.message(ds.name, ds.classification)} for o in found]
            + [{"code": "loosened", "message": f"'{ds.name}': {change}"} for change in looser]})
    finally:
        con.close()


def _entry(ds: Dataset) -> dict:
    return {"name": ds.name, "fingerprint": ds.fingerprint, "classification": ds.classification,
            "paths": list(ds.paths), "source": ds.source}


def _toml(name: str, ds: Dataset) -> str:
    keys = ("paths", "fingerprint", "owner", "licence", "classification", "allowed_targets", "expires", "files")
    lines = [f"[datasets.{json.dumps(name)}]"] + [f"{k} = {_value(k, getattr(ds, k))}" for k in keys
                                                  if getattr(ds, k) or k == "allowed_targets"]
    return "\n".join(lines) + "\n\n"


def _value(key: str, value: object) -> str:
    """A key's TOML value; `files` one a line, as sha256sum prints them."""
    if key == "files":
        return "[\n" + "".join(f"  {toml_value(line)},\n" for line in value) + "]"  # type: ignore[union-attr]
    return toml_value(value)


def verify(ds: Dataset) -> str | None:
    """None when the files still have the registered fingerprint, else what is wrong (which files
    changed, came or went, where the registry keeps each file's hash)."""
    try:
        now = hash_files(ds.paths)
    except EmberError as e:
        return str(e)
    print_now = fingerprint(list(now.items()))
    if print_now == ds.fingerprint:
        return None
    then = ds.registered_files()
    parts = [f"{print_now[:19]}... now, {ds.fingerprint[:19]}... registered"]
    for what, places in (("changed", [p for p in now.keys() & then.keys() if now[p] != then[p]]),
                         ("added", list(now.keys() - then.keys())), ("gone", list(then.keys() - now.keys()))):
        if then and places:
            places.sort()
            parts.append(f"{len(places)} {what}: {', '.join(places[:3])}{', ...' * (len(places) > 3)}")
    return f"changed since it was registered ({'; '.join(parts)})"


def verify_all(registry: Registry, names: list[str]) -> dict[str, str | None]:
    """verify() for each named dataset (all when none are named): {name: None or the problem}."""
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise EmberError(f"dataset '{unknown[0]}' is not registered{did_you_mean(unknown[0], registry)}")
    return {n: verify(registry[n]) for n in (names or sorted(registry))}
