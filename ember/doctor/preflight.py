"""`ember preflight`: a few real steps before a long run, each check passed or failed with figures.

    data        the data tokenizes (into the cache the run will use) and holds a micro batch
    memory      the measured peak of a step (ember/doctor/measure.py) against the plan's estimate
    input       batches/s the input pipeline delivers alone, against batches/s the model consumes
    loss        a short run of --steps optimizer steps: every loss finite, no step skipped
    resume      that run checkpoints before its last step; a fresh process restores the
                checkpoint and redoes the last step: loss and final weights must be bit-identical
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ember.doctor.measure import build_for_measurement, calibrate, loader_rate
from ember.errors import EmberError
from ember.events import Events
from ember.metrics.compare import weight_differences
from ember.proc import dies_with_us
from ember.scratch import scratch
from ember.plan.planner import make_plan
from ember.recipe import Recipe
from ember.data.loader import data_fingerprint, tokenize

INPUT_HEADROOM = 1.2  # the loader should deliver at least this many times what the model uses


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    figures: dict[str, Any]
    warn_only: bool = False


def preflight(r: Recipe, recipe_file: Path, steps: int, events: Events) -> list[Check]:
    """Every check in the module docstring's order, each passed or failed with its figures."""
    checks: list[Check] = []
    events.stage("preflight: building the model and tokenizing the data")
    bundle, device = build_for_measurement(r)
    try:
        tokens_path = tokenize(r.data, bundle.tokenizer, data_fingerprint(r.data.files, bundle.tokenizer), ev=r.eval)
        import numpy as np
        n = len(np.load(tokens_path, mmap_mode="r"))
        need = r.train.micro_batch * r.data.seq_len
        checks.append(Check("data", n >= need, f"{n:,} tokens; one micro batch needs {need:,}",
                            {"tokens": n}))
    except EmberError as e:
        return [Check("data", False, str(e), {})]

    events.stage("preflight: measuring a step")
    try:
        cal = calibrate(r, bundle=bundle, device=device)
    except (RuntimeError, ValueError) as e:  # e.g. an lr that overflows fp32, an out-of-memory
        return checks + [Check("memory", False, f"a training step failed: {type(e).__name__}: {e}", {})]
    try:
        plan = make_plan(r, None, cal)
        est, measured = plan.memory.peak, cal.peak_bytes
        err = est / measured - 1
        ok = -0.05 <= err <= 0.10 and plan.fits
        checks.append(Check("memory", ok, f"peak {measured / 2**20:.1f} MiB measured, {est / 2**20:.1f} MiB "
                            f"planned ({err:+.1%}); {'fits' if plan.fits else 'does NOT fit'} "
                            f"{plan.devices[0].free / 2**30:.1f} GiB free",
                            {"measured_bytes": measured, "estimated_bytes": est, "error": err}))
    except EmberError as e:
        checks.append(Check("memory", True, f"peak {cal.peak_bytes / 2**20:.1f} MiB measured; no "
                            f"estimate: {e}", {"measured_bytes": cal.peak_bytes}, warn_only=True))
    consume = 1 / cal.step_seconds
    deliver = loader_rate(r, tokens_path)
    checks.append(Check("input", deliver >= INPUT_HEADROOM * consume,
                        f"loader alone {deliver:,.0f} micro-batches/s, model consumes {consume:,.1f}/s "
                        f"({deliver / consume:.1f}x; below {INPUT_HEADROOM}x the run would wait on data: "
                        f"raise [data] workers)",
                        {"loader_batches_per_s": deliver, "model_batches_per_s": consume}, warn_only=True))
    del bundle

    events.stage(f"preflight: {steps} optimizer steps, then a resume in a fresh process")
    checks += _loss_and_resume(r, recipe_file, steps)
    return checks


def _ember(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`ember ARGS` in a child that dies with this process: a preflight killed (SIGKILL, its
    terminal closed) takes its short run with it rather than leaving it training unwatched."""
    return subprocess.run([sys.executable, "-m", "ember", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, preexec_fn=dies_with_us())


def _loss_and_resume(r: Recipe, recipe_file: Path, steps: int) -> list[Check]:
    with scratch("preflight-") as work:
        short = r.with_changes({"train.max_steps": steps, "checkpoint.every_steps": steps - 1,
                                "checkpoint.every_seconds": 0.0, "checkpoint.keep_last": 2,
                                "train.restarts": 0}, "preflight's short run")
        recipe = work / "recipe.toml"
        recipe.write_text(short.to_toml())
        a = _ember(["run", str(recipe), "--out", str(work / "a"), "--no-ledger"])
        rows = [json.loads(x) for x in (work / "a" / "metrics.jsonl").read_text().splitlines()] \
            if (work / "a" / "metrics.jsonl").exists() else []
        bad = [x for x in rows if not math.isfinite(x["loss"]) or "skipped" in x]
        if a.returncode != 0 or bad or len(rows) < steps:
            why = a.stderr.strip().splitlines()[-1] if a.returncode != 0 and a.stderr.strip() else ""
            return [Check("loss", False, f"{len(rows)} of {steps} steps; bad: "
                          + (", ".join(f"step {x['step']} loss {x['loss']:.4g}"
                                      + (f" ({x['skipped']}: update skipped)" if "skipped" in x else "")
                                      for x in bad) or "none")
                          + (f"; the run stopped: {why}" if why else ""), {"losses": [x["loss"] for x in rows]}),
                    Check("resume", False, "not checked: the short run did not complete", {})]
        checks = [Check("loss", True, f"{steps} steps, loss {rows[0]['loss']:.4g} -> {rows[-1]['loss']:.4g}, "
                        "all finite", {"losses": [x["loss"] for x in rows]})]
        # A fresh process restores the checkpoint before the last step and redoes that step.
        b = work / "b"
        b.mkdir()
        shutil.copy2(work / "a" / "run.json", b / "run.json")
        (b / "checkpoints").mkdir()
        name = f"step-{steps - 1:09d}"
        shutil.copytree(work / "a" / "checkpoints" / name, b / "checkpoints" / name)
        (b / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows[:-1]))
        t0 = time.perf_counter()
        res = _ember(["run", str(recipe), "--out", str(b), "--no-ledger"])
        took = time.perf_counter() - t0
        if res.returncode != 0:
            return checks + [Check("resume", False, f"the resumed process failed: {res.stderr.strip()[-400:]}", {})]
        again = json.loads((b / "metrics.jsonl").read_text().splitlines()[-1])
        diffs = []
        if again["loss"] != rows[-1]["loss"]:
            diffs.append(f"loss of step {steps}: {rows[-1]['loss']!r} uninterrupted, {again['loss']!r} resumed")
        weights = weight_differences(work / "a" / "final", b / "final")
        diffs += ["no final weights to compare"] if weights is None else weights
        checks.append(Check("resume", not diffs, "restored in a fresh process and redid the last step: "
                            + ("loss and final weights bit-identical" if not diffs else "; ".join(diffs))
                            + f" ({took:.1f} s)", {"differences": diffs}))
        return checks
