"""The doctor's figure: the real step's breakdown and each cause's saving, on one time axis (0 to
the step), so a saving of a fraction of a millisecond looks as small as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.doctor.diagnose import Figures


def plot(f: Figures, findings: list[Any], folder: Path) -> list[Path]:
    """doctor.png in `folder`: the mean step's phases, and each cause's saving against the step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    folder.mkdir(parents=True, exist_ok=True)
    step = f.step_seconds * 1000
    causes = [x for x in findings if x.cause != "compute-bound"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 1.9 + 0.35 * max(1, len(causes))),
                               height_ratios=[1, max(1, len(causes))])
    left = 0.0
    for name, seconds in f.baseline.phases.items():
        if seconds > 0:
            a.barh(0, seconds * 1000, left=left, label=f"{name} {seconds * 1000:.3g} ms", height=0.6)
            left += seconds * 1000
    a.set(yticks=[], xlim=(0, step), title=f"the real loop's step: {step:.3g} ms (mean iteration)")
    # Outside the axes, to the right: never over the bars.
    a.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    names = [x.cause for x in causes][::-1]
    savings = [x.saving_seconds * 1000 for x in causes][::-1]
    bars = b.barh(names, savings, color="tab:orange", height=0.6)
    b.bar_label(bars, labels=[f"{s:.3g} ms ({s / step:.0%})" for s in savings], fontsize=7, padding=3)
    b.set(xlim=(0, step), xlabel="ms per step (axis: 0 to the whole step)", title="saving if the remedy is applied")
    fig.tight_layout()
    path = folder / "doctor.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return [path]
