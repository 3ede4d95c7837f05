"""The `ember` command: argument parsing and printing only."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ember import __version__
from ember.errors import EXIT_ERROR, EmberError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="Recoverable, reproducible, "
                                     "accountable fine-tuning on machines you control.")
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train from a recipe; run it again to resume",
                         description="Train from a TOML recipe into OUT. Run the same command again "
                         "after any interruption and it resumes from the newest valid checkpoint. "
                         "Exit codes: 0 completed, 75 interrupted (resumable), 1 error, 2 bad usage.")
    run.add_argument("recipe", type=Path, help="the TOML recipe")
    run.add_argument("--out", type=Path, required=True, help="the run folder (created, or resumed)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override a recipe field; repeatable")
    run.add_argument("--allow-recipe-change", action="store_true",
                     help="resume even though the recipe or data changed (recorded in run.json)")

    recipe = sub.add_parser("recipe", help="check a recipe, or list every setting")
    recipe.add_argument("recipe", type=Path, nargs="?", help="a TOML recipe to validate and print")
    recipe.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE")
    recipe.add_argument("--markdown", action="store_true", help="list the settings as a Markdown table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on bad usage
    console = Console(stderr=True, soft_wrap=True)
    try:
        if args.command == "run":
            return cmd_run(args, console)
        return cmd_recipe(args)
    except EmberError as e:
        console.print(f"[bold red]error:[/bold red] {escape(str(e))}", highlight=False)
        return EXIT_ERROR
    except OSError as e:  # e.g. a full disk while appending metrics: say what and where
        console.print(f"[bold red]error:[/bold red] {escape(str(e))}; committed checkpoints are "
                      f"intact: fix the cause and run the same command to resume", highlight=False)
        return EXIT_ERROR
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub mid-run
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # quiet fork warnings with workers
    from transformers.utils import logging as hf_logging

    from ember.recipe import load_recipe
    from ember.train.job import prepare
    from ember.train.loop import train

    hf_logging.disable_progress_bar()
    recipe = load_recipe(args.recipe, args.overrides)
    job = prepare(recipe, args.out, args.allow_recipe_change, console)
    return train(job)


def cmd_recipe(args: argparse.Namespace) -> int:
    from ember.recipe import canonical_json, explain, load_recipe
    console = Console()
    if args.recipe is None and args.markdown:
        print("| setting | type | default | meaning |\n| --- | --- | --- | --- |")
        for key, type_name, default, help_text in explain():
            cells = [f"`{key}`", type_name.replace("|", "\\|"), f"`{default}`", help_text]
            print("| " + " | ".join(cells) + " |")
        return 0
    if args.recipe is None:
        table = Table("setting", "type", "default", "meaning", show_lines=False)
        for row in explain():
            table.add_row(*row)
        console.print(table)
        return 0
    recipe = load_recipe(args.recipe, args.overrides)
    print(canonical_json(recipe.to_dict()))
    return 0

