"""PNG plots of a run's report: loss, step-time histogram, goodput breakdown, attempts timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(report: dict[str, Any], kept: list[dict], lost: list[dict], folder: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

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
    ax.set(xlabel="step", ylabel="loss", title=f"loss — {report['run']['id']}")
    ax.legend()
    save(fig, "loss.png")

    if st := report.get("step_time"):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.hist([r["step_seconds"] * 1000 for r in kept], bins=40, color="tab:blue", alpha=0.8)
        for q, style in (("p50", "-"), ("p99", "--")):
            ax.axvline(st[q] * 1000, color="k", ls=style, label=f"{q} {st[q] * 1000:.1f} ms")
        ax.set(xlabel="step time (ms)", ylabel="steps", title="step-time distribution")
        ax.legend()
        save(fig, "step_time.png")

    if g := report.get("goodput"):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        items = [(k, v) for k, v in g["buckets"].items() if v > 0]
        left = 0.0
        for k, v in items:
            ax.barh(0, v, left=left, label=f"{k} {v:.1f}s")
            left += v
        ax.set(yticks=[], xlabel="seconds of wall-clock",
               title=f"goodput {g['goodput']:.1%} of {g['wall_seconds']:.1f} s")
        ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
        save(fig, "goodput.png")

    if attempts := report.get("attempts"):
        fig, ax = plt.subplots(figsize=(7, 0.6 + 0.5 * len(attempts)))
        t0 = attempts[0]["start"]
        colors = {"completed": "tab:green", "interrupted": "tab:orange", "killed": "tab:red",
                  "crashed": "tab:red"}
        for a in attempts:
            end = a["end"] or a["last_seen"] or a["start"]
            ax.barh(a["attempt"], end - a["start"], left=a["start"] - t0,
                    color=colors.get(a["outcome"], "tab:gray"))
            ax.text(end - t0, a["attempt"], f" {a['outcome']}, {a['lost_steps']} steps lost",
                    va="center", fontsize=8)
        ax.set(xlabel="seconds since the first attempt", ylabel="attempt", title="attempts")
        save(fig, "attempts.png")
    return written
