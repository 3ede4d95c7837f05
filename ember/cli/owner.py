"""`ember owner`: the owner's rules file (owner.toml) checked and resolved, or every setting
listed (docs/owner.md). Argument parsing, one call, printing."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ember.errors import EXIT_USAGE, EmberError

COMMANDS = ("owner",)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    o = sub.add_parser("owner", help="the owner's rules (owner.toml): check a file, or list every setting",
                       description="owner.toml holds the rules `ember serve` follows: when training may "
                       "run, what pauses it, the service's address and its inference engine. Every "
                       "setting is in docs/owner.md.")
    osub = o.add_subparsers(dest="owner_command", required=True)
    c = osub.add_parser("check", help="validate owner.toml and print its rules resolved; exit 2 when it "
                        "does not validate")
    c.add_argument("path", type=Path, nargs="?",
                   help="the file (default $EMBER_HOME/owner.toml, the one `ember serve` reads)")
    s = osub.add_parser("settings", help="every setting: type, default, range, whether a running service "
                        "applies a change at once or at its restart, and what it does")
    s.add_argument("--markdown", action="store_true", help="as Markdown (docs/owner.md)")


def cmd(args: argparse.Namespace) -> int:
    return cmd_settings(args) if args.owner_command == "settings" else cmd_check(args)


def cmd_check(args: argparse.Namespace) -> int:
    from ember.sched.owner_rules import load_rules, owner_file
    from ember.sched.owner_reference import resolved
    path = args.path or owner_file()
    err, out = Console(stderr=True, soft_wrap=True), Console(soft_wrap=True)
    try:
        if args.path is not None and not path.is_file():
            raise EmberError(f"{path}: no such file")
        rows = resolved(load_rules(path))
    except EmberError as e:
        err.print("[bold red]error:[/bold red] ", end="", highlight=False)
        err.print(f"{e}\n{path} does not validate: fix it and run `ember owner check` again (docs/owner.md "
                  f"lists every setting); a running service keeps the rules it had until the file validates",
                  markup=False, highlight=False)
        return EXIT_USAGE
    changed = [key for key, value, default, _ in rows if value != default]
    out.print(f"{path}: valid" if path.is_file() else f"{path}: no such file; every rule is its default",
              markup=False, highlight=False)
    out.print(f"set to other than the default: {', '.join(changed) or 'nothing'}; a running service applies "
              f"'live' keys within a second of an edit, 'restart' keys when it starts", markup=False,
              highlight=False)
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column("setting", no_wrap=True)  # the key is what a reader looks for: never cut
    for name in ("value", "default", "on change"):
        table.add_column(name, overflow="fold")  # a value is wrapped, never cut
    section = None
    for key, *cells in rows:
        if key.split(".")[0] != section:
            section = key.split(".")[0]
            table.add_row(Text(f"[{section}]", style="bold"))
        table.add_row(*(Text(c) for c in ["  " + key.split(".")[1], *cells]))  # values are text, never markup
    out.print(table)
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    from ember.sched.owner_reference import reference, settings
    if args.markdown:
        print(reference(), end="")
        return 0
    out = Console(soft_wrap=False)
    for key, type_name, default, allowed, change, help_text in settings():  # a block each: six columns never fit
        facts = ", ".join(filter(None, [type_name, f"default {default}", allowed, f"on change: {change}"]))
        out.print(Text.assemble((key, "bold"), f"  {facts}"))
        out.print(Padding(Text(help_text), (0, 0, 1, 4)))
    return 0
