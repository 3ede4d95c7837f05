"""From the doctor's measured figures to a ranked list of causes: pure arithmetic.

Each cause carries its evidence (the measured numbers), the step time it would save, and the
concrete remedy. Causes are ranked by that saving; "compute-bound" is what is left when none of
the others saves at least `THRESHOLD` of the step, so a healthy run is not a false alarm.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

THRESHOLD = 0.10  # a cause must save at least this share of the step to rank above compute


@dataclass
class Finding:
    cause: str  # input-bound, checkpoint-bound, overhead-bound, communication-bound, compute-bound
    saving_seconds: float  # per optimizer step, if the remedy is applied
    saving_share: float  # of the current step time
    evidence: list[str]
    remedy: str
    predicted_step_seconds: float = 0.0
    changes: dict[str, Any] = field(default_factory=dict)


def diagnose(f: dict[str, Any]) -> list[Finding]:
    """`f`: the figures of ember.doctor.experiments.run_all (see there for the keys)."""
    step = f["step_seconds"]  # the real step, input pipeline and checkpoints included
    out: list[Finding] = []

    def add(cause: str, saving: float, evidence: list[str], remedy: str, changes: dict | None = None) -> None:
        saving = max(0.0, min(saving, step))
        out.append(Finding(cause, saving, saving / step, evidence, remedy, step - saving, changes or {}))

    if "synthetic_step_seconds" in f:
        wait = f["data_wait_seconds"]
        consume = f["micro_batches_per_step"] / max(f["real_step_seconds"] - wait, 1e-9)
        loader = f["loader_batches_per_second"]
        # With W loader workers the input delivers W times the measured single-loader rate; the
        # step then takes the longer of the model's time and the input's time.
        per_worker = loader / max(1, f["workers"])
        input_time = f["micro_batches_per_step"] / (f["suggested_workers"] * per_worker)
        after = max(f["synthetic_step_seconds"], input_time)
        add("input-bound", max(0.0, f["real_step_seconds"] - after), [
            f"the loader alone delivers {loader:,.1f} micro-batches/s; the model consumes {consume:,.1f}/s",
            f"step waits {wait * 1000:.1f} ms for data; with in-memory batches the step takes "
            f"{f['synthetic_step_seconds'] * 1000:.1f} ms against {f['real_step_seconds'] * 1000:.1f} ms"],
            f"more loader workers ([data] workers = {f['suggested_workers']}), pinned memory and "
            f"prefetch; pre-tokenize the data", {"data.workers": f["suggested_workers"]})
    if "checkpoint_seconds_per_step" in f:
        per_step = f["checkpoint_seconds_per_step"]
        blocked, durable = f["checkpoint_blocked_seconds"], f["checkpoint_durable_seconds"]
        if not f["checkpoint_async"]:
            saving = per_step * (1 - f["snapshot_seconds"] / max(blocked, 1e-9))
            remedy, changes = ("asynchronous checkpoints ([checkpoint] async = true): training blocks "
                               f"for the snapshot only ({f['snapshot_seconds'] * 1000:.1f} ms)"), {"checkpoint.async": True}
        else:
            saving = max(0.0, per_step - f["daly_seconds_per_step"])
            remedy, changes = ("a longer checkpoint interval ([checkpoint] every_seconds = \"auto\": "
                               f"Young/Daly, every {f['daly_interval_seconds']:.0f} s)"), {"checkpoint.every_seconds": "auto"}
        add("checkpoint-bound", saving, [
            f"a checkpoint blocks training {blocked * 1000:.1f} ms ({'asynchronous' if f['checkpoint_async'] else 'synchronous'}"
            f"; durable after {durable * 1000:.1f} ms), every {f['checkpoint_every_steps']:.3g} steps: "
            f"{per_step * 1000:.2f} ms per step"], remedy, changes)
    if f.get("sweep"):
        mb = f["micro_batch"]
        per_sample = {int(k): v / int(k) for k, v in f["sweep"].items()}
        best = min((k for k in per_sample if k in f["fits"]), key=per_sample.get, default=mb)
        fixed, slope = f["sweep_fit"]
        if best > mb and mb in per_sample:
            saving = (per_sample[mb] - per_sample[best]) * mb * f["micro_batches_per_step"]
            changes = _batch_changes(mb, best, f["grad_accum"])
            if "train.grad_accum" not in changes:  # more tokens per optimizer step: fewer steps
                saving += _per_step(f) * (1 - mb / best)
            add("overhead-bound", saving, [
                f"micro-batch sweep: {', '.join(f'{k}: {v * 1000:.2f} ms/sample' for k, v in sorted(per_sample.items()))}",
                f"fit: {fixed * 1000:.2f} ms fixed per micro-batch + {slope * 1000:.3f} ms per sample: the fixed "
                f"part is {fixed / (fixed + slope * mb):.0%} of a micro-batch of {mb}",
                f"micro batch {best} fits in memory (plan: {f['fits'][best] / 2**30:.2f} GiB peak)"],
                _batch_remedy(mb, best, f["grad_accum"]), changes)
    if "ddp_sync_seconds" in f:
        # One synchronisation per optimizer step costs what the micro-batches of a step lose to it.
        per_sync = max(0.0, f["ddp_sync_seconds"] - f["ddp_nosync_seconds"]) * f["grad_accum"]
        k = 4 * f["grad_accum"]  # synchronise 4x less often than now
        # Fewer synchronisations, and fewer optimizer steps for the same tokens.
        add("communication-bound", (per_sync + _per_step(f)) * (1 - f["grad_accum"] / k) * f["ddp_step_share"], [
            f"DDP over {f['ddp_backend']} x{f['ddp_world']}: {f['ddp_sync_seconds'] * 1000:.1f} ms per micro-batch with "
            f"gradient synchronisation, {f['ddp_nosync_seconds'] * 1000:.1f} ms without (no_sync)",
            f"all-reduce of the gradients alone: {f['ddp_allreduce_seconds'] * 1000:.1f} ms; "
            f"{f['ddp_overlap']:.0%} of it overlaps the backward pass"],
            f"gradient accumulation {k} (one synchronisation per {k} micro-batches; revisit the learning "
            f"rate: more tokens per optimizer step), larger DDP buckets, or fewer processes over a "
            f"faster link", {"train.grad_accum": k})
    others = sum(x.saving_seconds for x in out if x.saving_share >= THRESHOLD)
    compute = step - others
    ev = [f"forward {f['phases'].get('forward', 0) * 1000:.1f} ms, backward {f['phases'].get('backward', 0) * 1000:.1f} ms, "
          f"optimizer {f['phases'].get('optimizer', 0) * 1000:.1f} ms per step"]
    if f.get("mfu") is not None:
        ev.append(f"MFU {f['mfu']:.1%} of {f['peak_source']}")
    if f.get("top_ops"):
        ev.append("top operators: " + ", ".join(f"{o['name']} {o['share']:.0%}" for o in f["top_ops"][:5]))
    out.append(Finding("compute-bound", 0.0, compute / step, ev,
                       "the step is spent computing: bf16 on hardware with fast bf16 matmuls, a larger "
                       "micro batch where memory allows, or a smaller model / LoRA", step))
    significant = [x for x in out if x.cause != "compute-bound" and x.saving_share >= THRESHOLD]
    minor = [x for x in out if x.cause != "compute-bound" and x.saving_share < THRESHOLD]
    compute_f = [x for x in out if x.cause == "compute-bound"]
    return sorted(significant, key=lambda x: -x.saving_seconds) + compute_f + sorted(minor, key=lambda x: -x.saving_seconds)


def _per_step(f: dict[str, Any]) -> float:
    """Time an optimizer step spends outside forward, backward and waiting for data (update,
    clipping, bookkeeping): what fewer, larger optimizer steps save. Loading scales with samples."""
    ph = f["phases"]
    return max(0.0, f["real_step_seconds"] - f["data_wait_seconds"] - ph.get("h2d", 0) - ph.get("forward", 0)
               - ph.get("backward", 0))


def _batch_changes(mb: int, best: int, accum: int) -> dict[str, int]:
    if mb * accum % best == 0 and mb * accum >= best:
        return {"train.micro_batch": best, "train.grad_accum": mb * accum // best}
    return {"train.micro_batch": best}


def _batch_remedy(mb: int, best: int, accum: int) -> str:
    c = _batch_changes(mb, best, accum)
    if "train.grad_accum" in c:
        how = (f"micro batch {best} with gradient accumulation {c['train.grad_accum']} (same tokens per "
               f"optimizer step)")
    else:
        how = (f"micro batch {best}: {best * accum // mb}x the tokens per optimizer step (revisit the "
               f"learning rate)")
    return how + "; if memory stops it, activation checkpointing or the chunked loss unlock it"
