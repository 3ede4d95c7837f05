"""PNG plots of a run's report: loss, step-time histogram, goodput breakdown, attempts timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.runfolder import read_metrics


def write_plots(report: Any, run: Path, folder: Path) -> list[Path]:
    """loss.png, step_time.png, goodput.png and attempts.png of `report` (a RunReport) in `folder`;
    a plot with nothing to show (no step times, no goodput, no attempts) is not written."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    kept, lost = read_metrics(run / "metrics.jsonl", []), read_metrics(run / "metrics.lost.jsonl", [])
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    figures = (("loss.png", lambda: _loss(plt, report, kept, lost)), ("step_time.png", lambda: _step_time(plt, report)),
               ("goodput.png", lambda: _goodput(plt, report)), ("attempts.png", lambda: _attempts(plt, report)))
    for name, draw in figures:  # one figure at a time: each is closed before the next is drawn
        fig = draw()
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        written.append(folder / name)
    return written


def _loss(plt: Any, report: Any, kept: list[dict], lost: list[dict]) -> Any:
    """The training loss by step, the lost (recomputed) steps' losses, and the held-out loss."""
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
    return fig


def _step_time(plt: Any, report: Any) -> Any:
    """The step-time histogram with its p50 and p99; None without step times."""
    if not ((st := report.step_time) and (h := report.step_histogram)):
        return None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.stairs(h.counts, [e * 1000 for e in h.edges], fill=True, color="tab:blue", alpha=0.8)
    for q, style in (("p50", "-"), ("p99", "--")):
        ax.axvline(getattr(st, q) * 1000, color="k", ls=style, label=f"{q} {getattr(st, q) * 1000:.1f} ms")
    ax.set(xlabel="step time (ms)", ylabel="steps", title="step-time distribution")
    ax.legend()
    return fig


def _goodput(plt: Any, report: Any) -> Any:
    """Wall-clock time as one bar of goodput buckets; None without goodput."""
    if not (g := report.goodput):
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    left = 0.0
    for k, v in ((k, v) for k, v in g.buckets.items() if v > 0):
        ax.barh(0, v, left=left, label=f"{k} {v:.1f}s")
        left += v
    ax.set(yticks=[], xlabel="seconds of wall-clock", title=f"goodput {g.goodput:.1%} of {g.wall_seconds:.1f} s")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    return fig


def _attempts(plt: Any, report: Any) -> Any:
    """Each attempt as a bar over time, coloured by outcome, with its lost steps; None without attempts."""
    if not (attempts := report.attempts):
        return None
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
    return fig
