"""The reward curve as a PNG: mean reward and the share of full-reward replies per step.

matplotlib is the recipe's own extra (`pip install -e '.[recipes]'`); it is
imported here only, with the Agg backend, so the loop runs without a display.
"""

from __future__ import annotations

from pathlib import Path

from recipes.quickstart.train import StepRecord


def write_reward_png(records: list[StepRecord], path: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r.step for r in records]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot(steps, [r.mean_reward for r in records], marker="o", label="mean reward")
    full_marks = [r.full_marks_fraction for r in records]
    ax.plot(steps, full_marks, marker="s", linestyle="--", label="replies with full reward")
    ax.set_xlabel("step")
    ax.set_ylabel("per-step value (0 to 1)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
