"""PNG plots of a run's report: loss, step-time histogram, goodput breakdown, attempts timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.jsonl import read_jsonl


def write_plots(report: Any, run: Path, folder: Path) -> list[Path]:
    """loss.png, step_time.png, goodput.png and attempts.png of `report` (a RunReport) in `folder`."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    kept, lost = read_jsonl(run / "metrics.jsonl", []), read_jsonl(run / "metrics.lost.jsonl", [])
    folder.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        path = folder / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in kept], [r["loss"] for r in kept], lw=1.2, label="loss")
    if lost:
        ax.scatter([r["step"] for r in lost], [r["loss"] for r in lost], s=8, c="tab:red",
                   label="lost (recomputed) steps")
    if report.held_out:
        ax.plot([e["step"] for e in report.held_out], [e["loss"] for e in report.held_out], "o-", lw=1.2,
                c="tab:green", label="held-out loss")
    ax.set(xlabel="step", ylabel="loss", title=f"loss — {report.run.id}")
    ax.legend()
    save(fig, "loss.png")

    if (st := report.step_time) and (h := report.step_histogram):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.stairs(h.counts, [e * 1000 for e in h.edges], fill=True, color="tab:blue", alpha=0.8)
        for q, style in (("p50", "-"), ("p99", "--")):
            ax.axvline(getattr(st, q) * 1000, color="k", ls=style, label=f"{q} {getattr(st, q) * 1000:.1f} ms")
        ax.set(xlabel="step time (ms)", ylabel="steps", title="step-time distribution")
        ax.legend()
        save(fig, "step_time.png")

    if g := report.goodput:
        fig, ax = plt.subplots(figsize=(7, 3.2))
        left = 0.0
        for k, v in ((k, v) for k, v in g.buckets.items() if v > 0):
            ax.barh(0, v, left=left, label=f"{k} {v:.1f}s")
            left += v
        ax.set(yticks=[], xlabel="seconds of wall-clock", title=f"goodput {g.goodput:.1%} of {g.wall_seconds:.1f} s")
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
        save(fig, "goodput.png")

    if attempts := report.attempts:
        # At least 2 inches tall: one attempt's bar and its tick labels otherwise overlap.
        fig, ax = plt.subplots(figsize=(7, max(2.0, 0.8 + 0.5 * len(attempts))))
        t0 = attempts[0].start
        colors = {"completed": "tab:green", "interrupted": "tab:orange", "killed": "tab:red",
                  "crashed": "tab:red", "failed": "tab:purple"}
        span = max((a.end or a.last_seen or a.start) - t0 for a in attempts) or 1.0
        for a in attempts:
            end = a.end or a.last_seen or a.start
            ax.barh(a.attempt, end - a.start, left=a.start - t0, height=0.6, color=colors.get(a.outcome, "tab:gray"))
            ax.text(end - t0 + span * 0.01, a.attempt, f"{a.outcome or 'running'}, {a.lost_steps} steps lost",
                    va="center", fontsize=8)
        ax.set_yticks([a.attempt for a in attempts])
        ax.set_ylim(min(a.attempt for a in attempts) - 0.7, max(a.attempt for a in attempts) + 0.7)
        ax.set_xlim(0, span * 1.35)  # room for the labels right of the bars
        ax.set(xlabel="seconds since the first attempt", ylabel="attempt", title="attempts")
        save(fig, "attempts.png")
    return written
