"""The config engine: every TOML file ember reads (recipes, owner.toml, targets.toml,
datasets.toml, machine.toml) is a dataclass schema, parsed and validated here the same way.

    schema (dataclasses of `setting(...)` fields)
      -> read_toml(path)                         the raw dict, and the line of every key (one read)
      -> build_file / build_entries                typed, validated objects
      -> reference(header, rows(...))              the Markdown reference in docs/

A file is either sections (`[train]`, `[cpu]`: a schema whose fields are section dataclasses,
`build_file`) or named entries (`[targets.NAME]`: one dataclass per entry, `build_entries`).
Every error has one shape: the file and line, the key path, the value, what was wrong and what
to do, e.g. `owner.toml:6: [activity] idle_minutes = 'soon': must be a number`.
Cross-field rules stay with each file's loader (they know what to advise); they use `Source.at`
so that their errors have the same shape.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import json
import re
import tomllib
import types
from enum import StrEnum
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ember.errors import EmberError

Path_ = tuple[str, ...]  # a key path: ("train", "max_steps"), ("targets", "hpc", "max_nodes")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # an entry's name: [targets.NAME]


def setting(default: Any, help: str, *, min: float | None = None, max: float | None = None,
            exclusive_min: bool = False, factory: bool = False, key: str | None = None,
            required: bool = False) -> Any:
    """A field of a schema with its help text and allowed range; `key` when the TOML name is not a
    Python identifier (checkpoint.async); `required`: a file must state it (the default marks it unset)."""
    meta = {"help": help, "min": min, "max": max, "exclusive_min": exclusive_min, "key": key,
            "required": required}
    if factory:
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def derived(help: str) -> Any:
    """A field ember fills in itself (an entry's name, the file it came from): never a key of the file."""
    return field(default="", metadata={"help": help, "derived": True})


def read_toml(path: Path) -> tuple[dict[str, Any], Source]:
    """A TOML file's contents and where each of its keys is, from one read; a file that is not
    TOML, or not UTF-8 text, is an EmberError naming it."""
    try:
        text = path.read_text()
        return tomllib.loads(text), Source(str(path), key_lines(text))
    except tomllib.TOMLDecodeError as e:
        raise EmberError(f"{path}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise EmberError(f"{path}: not a UTF-8 text file") from None


HEADER = re.compile(r"^\s*\[\s*([^\[\]]+?)\s*\]\s*(#.*)?$")
KEY = re.compile(r'^\s*("[^"]*"|[A-Za-z0-9_-]+)\s*=')
PART = re.compile(r'"([^"]*)"|([A-Za-z0-9_-]+)')


def key_lines(text: str) -> dict[Path_, int]:
    """The line (from 1) where each table ([a] or [a.b]) and each of its keys first appears."""
    out: dict[Path_, int] = {}
    table: Path_ = ()
    for n, line in enumerate(text.splitlines(), 1):
        if m := HEADER.match(line):
            table = tuple(a or b for a, b in PART.findall(m.group(1)))
            out.setdefault(table, n)
        elif m := KEY.match(line):
            out.setdefault((*table, m.group(1).strip('"')), n)
    return out


@dataclass(frozen=True)
class Source:
    """Where values come from: a file (with each key's line), or a description ('changes')."""
    name: str
    lines: Mapping[Path_, int] = field(default_factory=dict)
    overridden: frozenset[Path_] = frozenset()   # keys given on the command line (--set)

    def at(self, *path: str) -> str:
        """'FILE:LINE' of a key (else of its table), 'FILE (--set a.b)' for an override, else 'FILE'."""
        if path in self.overridden:
            return f"{self.name} (--set {'.'.join(path)})"
        for n in range(len(path), 0, -1):
            if line := self.lines.get(path[:n]):
                return f"{self.name}:{line}"
        return self.name

    def where(self, *path: str) -> str:
        """'FILE:LINE: [table] key', the start of every error about that key."""
        if len(path) == 1:
            return f"{self.at(*path)}: [{path[0]}]"
        return f"{self.at(*path)}: [{'.'.join(path[:-1])}] {path[-1]}"


def toml_key(f: dataclasses.Field) -> str:
    """A field's name in the file."""
    return f.metadata.get("key") or f.name


def keys_of(cls: type) -> dict[str, dataclasses.Field]:
    """{TOML key: field} of a schema dataclass, without the fields ember fills in itself."""
    return {toml_key(f): f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for a close match among `choices`, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def build_file(schema: type, raw: Mapping[str, Any], source: Source) -> Any:
    """A file of [sections]: `schema`'s fields are section dataclasses; absent sections and keys
    take their defaults; unknown ones, wrong types and bad ranges are refused."""
    sections = typing.get_type_hints(schema)
    built = {}
    for name, values in raw.items():
        if name not in sections:
            raise EmberError(f"{source.at(name)}: unknown section [{name}]{did_you_mean(name, sections)}; "
                             f"sections are {', '.join(sections)}")
        if not isinstance(values, dict):
            raise EmberError(f"{source.at(name)}: '{name}' must be a [{name}] table, got {values!r}")
        built[name] = build_table(sections[name], (name,), values, source)
    return schema(**built)


def build_entries(cls: type, raw: Mapping[str, Any], table: str, source: Source, advice: str) -> dict[str, Any]:
    """A file of named entries, [TABLE.NAME] each: {NAME: cls}, every entry validated; another
    section, a bad name, a key ember sets itself or a missing required key (the error adds
    `advice`) is refused."""
    unknown = [k for k in raw if k != table]
    if unknown:
        raise EmberError(f"{source.at(unknown[0])}: unknown section [{unknown[0]}]"
                         f"{did_you_mean(unknown[0], [table])}; write each entry as [{table}.NAME]")
    entries = raw.get(table, {})
    if not isinstance(entries, dict):
        raise EmberError(f"{source.at(table)}: '{table}' must be tables, [{table}.NAME] each")
    out = {}
    for name, values in entries.items():
        where = f"{source.at(table, name)}: [{table}.{name}]"
        if not isinstance(values, dict):
            raise EmberError(f"{where} must be a table")
        if not NAME.match(name):
            raise EmberError(f"{where}: a name is letters, digits, '_', '.' and '-'")
        entry = build_table(cls, (table, name), values, source)
        missing = [k for k, f in keys_of(cls).items() if f.metadata.get("required")
                   and getattr(entry, f.name) in (None, "", [])]
        if missing:
            raise EmberError(f"{where}: {', '.join(missing)} missing: {advice}")
        out[name] = entry
    return out


def build_table(cls: type, path: Path_, values: Mapping[str, Any], source: Source) -> Any:
    """One table ([train], [targets.hpc]) onto dataclass `cls`, each value type- and range-checked."""
    fields = keys_of(cls)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise EmberError(f"{source.at(*path, key)}: unknown key '{key}' in [{'.'.join(path)}]"
                             f"{did_you_mean(key, fields)}; known keys: {', '.join(fields)}")
        f = fields[key]
        kwargs[f.name] = check_value(source.where(*path, key), value, hints[f.name], f.metadata)
    return cls(**kwargs)


def check_value(where: str, value: Any, hint: Any, meta: Mapping[str, Any]) -> Any:
    """Type- and range-check one value against its annotation; return it normalised."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):  # a number or a named value (float | Literal["auto"]), or optional
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        named = [a for a in args if typing.get_origin(a) is Literal]
        if isinstance(value, str) and named:
            return check_value(where, value, named[0], {"or": "true or false" if bool in args else "a number"})
        return check_value(where, value, next(a for a in args if a not in named), meta)
    if origin is Literal or isinstance(hint, type) and issubclass(hint, StrEnum):
        allowed = choices(hint)
        if value not in allowed:
            also = f" or {meta['or']}" if meta.get("or") else ""
            raise EmberError(f"{where} = {value!r}: must be one of {', '.join(map(repr, allowed))}{also}")
        return value if origin is Literal else hint(value)
    if origin is list:
        (item_type,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise EmberError(f"{where} = {value!r}: must be a list of {item_type.__name__}")
        return [check_value(f"{where}[{i}]", v, item_type, {}) for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise EmberError(f"{where} = {value!r}: must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise EmberError(f"{where} = {value!r}: must be an integer")
        if not -2**63 <= value < 2**63:
            raise EmberError(f"{where} = {value!r}: too large; integers must fit in 64 bits")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EmberError(f"{where} = {value!r}: must be a number")
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise EmberError(f"{where} = {value!r}: must be a finite number")
    elif hint is str:
        if isinstance(value, (datetime.date, datetime.time)):  # TOML reads an unquoted date as one
            raise EmberError(f"{where} = {value.isoformat()}: must be a string; quote it: \"{value.isoformat()}\"")
        if not isinstance(value, str):
            raise EmberError(f"{where} = {value!r}: must be a string")
        return value
    low, high = meta.get("min"), meta.get("max")
    if low is not None and (value < low or (meta.get("exclusive_min") and value == low)):
        bound = f"> {low}" if meta.get("exclusive_min") else f">= {low}"
        raise EmberError(f"{where} = {value!r}: must be {bound}")
    if high is not None and value > high:
        raise EmberError(f"{where} = {value!r}: must be <= {high}")
    return value


def to_toml(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """{table: {key: value}} as TOML (None: the key is left out)."""
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items() if v is not None]
        lines.append("")
    return "\n".join(lines)


def toml_value(v: Any) -> str:
    """A value as TOML, in ASCII whatever the locale: strings, numbers, booleans and lists of them
    (validation admits no other values). JSON's literals, but for characters beyond U+FFFF: JSON
    writes them as surrogate pairs (\\ud83d\\ude00), which TOML refuses; TOML has \\U0001f600."""
    if isinstance(v, str):
        return '"' + "".join(c if " " <= c <= "~" and c not in '"\\' else
                             {'"': '\\"', "\\": "\\\\"}.get(c) or (f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF
                                                                  else f"\\U{ord(c):08x}")
                             for c in v) + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return json.dumps(v)


# The reference: one row per key, generated from the same fields the validator reads.

@dataclass(frozen=True)
class Row:
    key: str      # 'train.max_steps', 'targets.NAME.max_nodes'
    type: str
    default: str  # as JSON; 'unset' (TOML has no null), or 'required'
    range: str    # '0 to 1', '>= 1024', '' when any value goes
    help: str


def choices(hint: Any) -> tuple[Any, ...]:
    """The values a Literal or a StrEnum setting allows, as written in a file."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return tuple(m.value for m in hint)


def type_label(hint: Any) -> str:
    """An annotation in words: 'int', "'full' | 'lora'", 'list[str] | unset'."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " | ".join(type_label(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is Literal or isinstance(hint, type) and issubclass(hint, StrEnum):
        return " | ".join(map(repr, choices(hint)))
    if typing.get_origin(hint) is list:
        return f"list[{typing.get_args(hint)[0].__name__}]"
    return "unset" if hint is type(None) else hint.__name__


def bounds(meta: Mapping[str, Any]) -> str:
    """A setting's allowed range in words, e.g. '0 to 1', '>= 1024'; '' when any value goes."""
    low, high = meta.get("min"), meta.get("max")

    def shown(x: int | float) -> str:  # an integer whole (2**32 - 1 is not 4.29497e+09), a large one grouped
        return (f"{x:,}" if abs(x) >= 10**6 else str(x)) if isinstance(x, int) else f"{x:g}"
    if low is not None and high is not None and not meta.get("exclusive_min"):
        return f"{shown(low)} to {shown(high)}"
    parts = [f"{'>' if meta.get('exclusive_min') else '>='} {shown(low)}"] if low is not None else []
    return ", ".join(parts + ([f"<= {shown(high)}"] if high is not None else []))


def default_of(f: dataclasses.Field) -> Any:
    """A field's default value (a fresh one for a factory)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def rows(tables: Mapping[str, type]) -> list[Row]:
    """Every key of `tables` ({'train': TrainConfig} or {'targets.NAME': Target}), in file order."""
    out = []
    for table, cls in tables.items():
        hints = typing.get_type_hints(cls)
        for key, f in keys_of(cls).items():
            required, default = f.metadata.get("required"), default_of(f)
            label = type_label(hints[f.name])
            if required:
                label = label.replace(" | unset", "")
            shown = "required" if required else "unset" if default is None else json.dumps(default)
            out.append(Row(f"{table}.{key}", label, shown, bounds(f.metadata), f.metadata["help"]))
    return out


def reference(header: str, table: Sequence[Row],
              extra: Sequence[tuple[str, Callable[[Row], str]]] = ()) -> str:
    """A Markdown reference: `header`, then one table row per key (setting, type, default, range,
    the `extra` columns, meaning); every cell's '|' escaped."""
    names = ["setting", "type", "default", "range", *(name for name, _ in extra), "meaning"]
    lines = [header, "| " + " | ".join(names) + " |", "|" + " --- |" * len(names)]
    for row in table:
        cells = [f"`{row.key}`", row.type, f"`{row.default}`", row.range,
                 *(cell(row) for _, cell in extra), row.help]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"
