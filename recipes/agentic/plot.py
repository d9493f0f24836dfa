"""The agentic run's curve as a PNG: held-out success at each evaluation, and the training episodes' reward.

matplotlib (the recipes extra) is imported here only, with the Agg backend.
"""

from __future__ import annotations

from pathlib import Path

from recipes.agentic.train import StepRecord


def write_curve_png(records: list[StepRecord], path: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    evaluated = [r for r in records if r.held_out_success is not None]
    ax.plot([r.step for r in evaluated], [r.held_out_success for r in evaluated], marker="o",
            label="held-out success (one episode per task)")
    ax.plot([r.step for r in records], [r.mean_reward for r in records], alpha=0.6, label="training mean rubric score")
    ax.plot([r.step for r in records], [r.success_rate for r in records], linestyle="--", alpha=0.6,
            label="training success")
    ax.set_xlabel("step")
    ax.set_ylabel("fraction (0 to 1)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
