"""The agentic run's curve as a PNG: held-out success at each evaluation, and the training episodes' reward.

matplotlib (the recipes extra) is imported here only, with the Agg backend.
"""

from __future__ import annotations

from pathlib import Path

from recipes.agentic.train import EvalRecord, LogRecord, StepRecord


def write_curve_png(records: list[LogRecord], path: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in records if isinstance(r, EvalRecord)]
    steps = [r for r in records if isinstance(r, StepRecord)]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot([r.step for r in evals], [r.held_out_success for r in evals], marker="o",
            label="held-out success (one episode per task)")
    ax.plot([r.step for r in steps], [r.mean_reward for r in steps], alpha=0.6, label="training mean rubric score")
    ax.plot([r.step for r in steps], [r.success_rate for r in steps], linestyle="--", alpha=0.6,
            label="training success")
    ax.set_xlabel("training steps taken")
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
