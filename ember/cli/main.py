"""The `ember` command: argument parsing and printing only."""

from __future__ import annotations

import argparse
import os
import select
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ember import __version__
from ember.cli.quiet import quiet_libraries
from ember.cli.render import console as surviving_console
from ember.errors import EXIT_ERROR, EXIT_USAGE, BadInput, EmberError

EXIT_PIPE = 141  # 128 + SIGPIPE: what a shell shows for `git log | head` or `yes | head`

def build_parser() -> argparse.ArgumentParser:
    """The `ember` command line: one sub-command per function below (and the other cli modules')."""
    from ember.cli import doctor, owner, plan, remote, serve, settings
    parser = argparse.ArgumentParser(prog="ember", description="Recoverable, reproducible, "
                                     "accountable fine-tuning on machines you control.")
    parser.add_argument("--version", action="version", version=f"ember {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_run, add_runs, add_report, add_compare, add_repro, add_capacity, add_export, plan.add_parsers,
                doctor.add_parser, serve.add_parsers, remote.add_parsers, owner.add_parsers, settings.add_parsers,
                add_recipe):
        add(sub)  # in the order `ember -h` lists them
    return parser


def add_run(sub: argparse._SubParsersAction) -> None:
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
    run.add_argument("--restarts", type=int, default=None, metavar="N",
                     help="supervise: restart after a crash, giving up after N crashes within an "
                     "hour (overrides [train] restarts)")
    run.add_argument("--preflight", action="store_true",
                     help="run `ember preflight` first and stop if a check fails")
    run.add_argument("--restart-from-scratch", action="store_true",
                     help="when no committed checkpoint verifies, set them aside (corrupt-*) and "
                     "train from step 0")
    run.add_argument("--nproc", type=int, default=1, metavar="N",
                     help="train on N processes on this machine (torchrun; gloo on CPU, NCCL on CUDA); "
                     "[distributed] strategy says how they split the work")
    run.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes taking part (each runs this command)")
    run.add_argument("--node-rank", type=int, default=0, metavar="K", help="this node's number, 0..M-1")
    run.add_argument("--rdzv", default="", metavar="HOST:PORT",
                     help="node 0's address and a free port there, the same on every node")
    run.add_argument("--no-supervise", action="store_true", help=argparse.SUPPRESS)
    add_ledger_args(run, allow_off=True)


def add_runs(sub: argparse._SubParsersAction) -> None:
    runs = sub.add_parser("runs", help="a table of the runs in the ledger")
    runs.add_argument("--status", help="only runs in this state (completed, running, interrupted, failed, ...)")
    runs.add_argument("--match", help="only runs whose id, name or folder contains this")
    runs.add_argument("--sort", default="created", help="order by this column: created (default), id, name, "
                      "status, steps, progress, tokens_per_second_per_device, mfu, goodput, cost, p50, p99, "
                      "wall_seconds")
    runs.add_argument("--desc", action="store_true", help="largest first")
    runs.add_argument("--json", action="store_true")
    add_ledger_args(runs)


def add_report(sub: argparse._SubParsersAction) -> None:
    report = sub.add_parser("report", help="throughput, MFU, step-time spread, goodput and cost of a run")
    report.add_argument("run", help="a run folder or a run id from `ember runs`")
    report.add_argument("--json", action="store_true", help="machine-readable output")
    report.add_argument("--plots", type=Path, metavar="DIR", help="write PNG plots into DIR")
    add_ledger_args(report)


def add_compare(sub: argparse._SubParsersAction) -> None:
    compare = sub.add_parser("compare", help="differences between two runs, and a verdict")
    compare.add_argument("run_a")
    compare.add_argument("run_b")
    compare.add_argument("--tolerance", type=float, default=1e-3,
                         help="max absolute loss difference still called 'close' (default 1e-3)")
    compare.add_argument("--json", action="store_true")
    add_ledger_args(compare)


def add_repro(sub: argparse._SubParsersAction) -> None:
    repro = sub.add_parser("repro", help="re-run a run from its record into a new folder, then compare")
    repro.add_argument("run")
    repro.add_argument("--out", type=Path, required=True)
    repro.add_argument("--tolerance", type=float, default=1e-3)
    add_ledger_args(repro)


def add_capacity(sub: argparse._SubParsersAction) -> None:
    capacity = sub.add_parser("capacity", help="duty cycle per device; rent, reserve or own")
    capacity.add_argument("--since", help="start of the period (ISO date), default the first attempt")
    add_ledger_args(capacity)


def add_export(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser("export", help="a run's weights for serving engines (hf, peft, gguf)",
                            description="Write a completed run's final weights, or one of its checkpoints' "
                            "(--checkpoint), as a merged Hugging Face folder "
                            "(hf: transformers, vLLM), a peft LoRA adapter (peft: LoRA runs only) or one "
                            "GGUF file (gguf: llama.cpp, Ollama; Llama family only). Written under a "
                            "temporary name and renamed into place; an existing --out is refused.")
    export.add_argument("run", type=Path, help="a run folder (the --out of `ember run`)")
    export.add_argument("--format", required=True, metavar="{hf,peft,gguf}", help="hf, peft or gguf")
    export.add_argument("--out", type=Path, default=None,
                        help="where to write (default RUN/export/FORMAT; gguf: RUN/export/model-DTYPE.gguf)")
    export.add_argument("--dtype", default="f32", metavar="{f16,f32}",
                        help="weight precision: f32 (default, the trained weights exactly) or f16")
    export.add_argument("--checkpoint", metavar="STEP|best|last", default=None,
                        help="export a committed checkpoint instead of the final weights: its step, "
                        "'last' (the newest) or 'best' (the lowest held-out loss); the run need not "
                        "have completed")


def add_recipe(sub: argparse._SubParsersAction) -> None:
    recipe = sub.add_parser("recipe", help="check a recipe, or list every setting")
    recipe.add_argument("recipe", type=Path, nargs="?", help="a TOML recipe to validate and print")
    recipe.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE")
    recipe.add_argument("--markdown", action="store_true", help="list the settings as a Markdown table")


def add_ledger_args(parser: argparse.ArgumentParser, allow_off: bool = False) -> None:
    parser.add_argument("--ledger", type=Path, default=os.environ.get("EMBER_LEDGER") or None,
                        help="the ledger database (default $EMBER_HOME/ledger.db)")
    if allow_off:
        parser.add_argument("--no-ledger", action="store_true",
                            help="no accounting: nothing is written to the ledger")


def main(argv: list[str] | None = None) -> int:
    """Run one `ember` command; its exit code."""
    quiet_libraries()
    try:
        code = command(argv)
        sys.stdout.flush()  # a reader gone (`ember ... | head`) shows here at the latest, not at exit
        return code
    except BrokenPipeError:
        if not stdout_gone():
            raise
        # stdout's reader went away: stop quietly, as a tool killed by SIGPIPE does; stdout now
        # points at /dev/null, so the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE


def stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR)."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def command(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # exits 2 on bad usage
    console = surviving_console(stderr=True)
    try:
        if args.command == "run":
            return cmd_run(args)
        if args.command == "recipe":
            return cmd_recipe(args)
        if args.command == "owner":
            from ember.cli import owner
            return owner.cmd(args)
        if args.command == "settings":
            from ember.cli import settings
            return settings.cmd(args)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub
        from ember.cli import remote, serve
        if args.command in remote.COMMANDS:
            return remote.cmd(args)
        if args.command in serve.COMMANDS:
            return serve.cmd(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "doctor":
            from ember.cli.doctor import cmd_doctor
            return cmd_doctor(args)
        if args.command in ("plan", "preflight"):
            from ember.cli import plan
            return plan.cmd_plan(args) if args.command == "plan" else plan.cmd_preflight(args)
        from ember.cli import accounts
        return {"runs": accounts.cmd_runs, "report": accounts.cmd_report,
                "compare": accounts.cmd_compare, "repro": accounts.cmd_repro,
                "capacity": accounts.cmd_capacity}[args.command](args)
    except EmberError as e:
        console.print("[bold red]error:[/bold red] ", end="", highlight=False)
        console.print(str(e), markup=False, highlight=False)
        return exit_code(e)
    except OSError as e:  # e.g. a full disk while appending metrics: say what and where
        if isinstance(e, BrokenPipeError) and stdout_gone():
            raise  # the reader of stdout went away (`| head`): main() ends quietly
        console.print("[bold red]error:[/bold red] ", end="", highlight=False)
        console.print(f"{e}" + (RESUME_HINT if args.command == "run" else ""), markup=False, highlight=False)
        return EXIT_ERROR
    except KeyboardInterrupt:
        console.print("interrupted")
        return 130


def exit_code(e: EmberError) -> int:
    """The one mapping from an error's meaning (ember.errors) to the exit status: bad input is bad
    usage (2, as argparse's own); every other error is 1. Errors a command reaches over HTTP come
    back as EmberError (1): a 400 may be a bad recipe as well as a malformed field."""
    return EXIT_USAGE if isinstance(e, BadInput) else EXIT_ERROR


RESUME_HINT = "; committed checkpoints are intact: fix the cause and run the same command to resume"


def cmd_run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub mid-run
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # quiet fork warnings with workers
    from ember.cli.render import stderr_events
    from ember.train.signals import StopRequest
    from ember.world import launched
    # First, before the imports and the plan (seconds on a busy machine): a stop signal during
    # start-up stops the run (exit 75) instead of killing it (143), or breaking an import (Ctrl-C).
    stop = StopRequest(stderr_events(), quiet=launched()).install()
    from ember.cli.plan import print_checks
    from ember.cli.render import keep_output_in
    from ember.launch import PreflightFailed, RunRequest, fast_exit, run
    from ember.ranks import Topology
    from ember.runfolder import CONSOLE_LOG
    keep_output_in(args.out / CONSOLE_LOG)  # a closed pipe or a hung-up terminal: training goes on
    req = RunRequest(args.recipe, args.out, args.overrides, args.allow_recipe_change, args.restarts,
                     args.preflight, False if args.no_ledger else args.ledger, args.restart_from_scratch,
                     args.no_supervise, Topology(args.nproc, args.nnodes, args.node_rank, args.rdzv))
    req.serving = start_coserving  # used when the recipe says [serve] coserve
    req.stop = stop
    out = surviving_console()
    try:
        outcome = run(req, stderr_events())
    except PreflightFailed as e:
        print_checks(e.checks, surviving_console(stderr=True))
        raise
    print_checks(outcome.checks, surviving_console(stderr=True))
    if outcome.completed_step is not None:
        out.print(f"{args.out}: already completed {outcome.completed_step} steps; nothing to do (final "
                  f"weights in {args.out / 'final'})", markup=False, highlight=False)
    elif outcome.code == 0 and outcome.report is not None:
        print_completed(outcome.report, out)
    if outcome.report is not None or outcome.kept is not None:  # this process trained: all it wrote is durable
        fast_exit(outcome.code)
    return outcome.code


def start_coserving(job: Any) -> Any:
    """[serve] coserve's HTTP server in the training process (the web layer, above launch)."""
    from ember.web.coserve import start
    return start(job)


def cmd_export(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from ember.cli.render import stderr_events
    from ember.infer.export import export_run
    hf_logging.disable_progress_bar()
    done = export_run(args.run, args.format, args.out, args.dtype, stderr_events(), args.checkpoint)
    Console(soft_wrap=True).print(f"{done.path} ({done.format}, {done.dtype}, {done.bytes / 1e6:.1f} MB)",
                                  markup=False, highlight=False)
    return 0


def print_completed(report, out: Console) -> None:
    from ember.ckpt.store import committed_in
    from ember.metrics.report import summary_line
    run = Path(report.run.path)
    loss = f"; loss {report.loss.first:.4f} -> {report.loss.last:.4f}" if report.loss else ""
    out.print(f"completed {report.run.steps} steps{loss}", markup=False, highlight=False)
    if report.run.stopped_early:
        out.print(report.run.stopped_early, markup=False, highlight=False)
    out.print(summary_line(report), markup=False, highlight=False)
    checkpoints = ", ".join(p.name for _, p in committed_in(run / "checkpoints"))
    out.print(f"checkpoints: {checkpoints} in {run / 'checkpoints'}\nfinal weights: {run / 'final'}",
              markup=False, highlight=False)


def cmd_recipe(args: argparse.Namespace) -> int:
    from ember.recipe import canonical_json, explain, load_recipe, recipe_reference
    console = Console()
    if args.recipe is None and args.markdown:
        print(recipe_reference(), end="")
        return 0
    if args.recipe is None:
        table = Table("setting", "type", "default", "meaning", show_lines=False)
        for row in explain():
            table.add_row(*row)
        console.print(table)
        return 0
    err = Console(stderr=True, soft_wrap=True)
    recipe = load_recipe(args.recipe, args.overrides,
                         lambda message: err.print(f"warning: {message}", markup=False, highlight=False))
    print(canonical_json(recipe.to_dict()))
    return 0

