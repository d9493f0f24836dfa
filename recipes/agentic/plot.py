"""The agentic run's curves as a PNG: held-out figures per family at each evaluation, and the training steps.

Left: for each family, held-out success and mean rubric reward at each evaluation
(the base model, after the warm start, after k RL steps), and the LLM judge's
agreement with the exact checks where a judge ran. Right: the training episodes'
mean reward and success per RL step. matplotlib (the recipes extra) is imported
here only, with the Agg backend.
"""

from __future__ import annotations

from pathlib import Path

from recipes.agentic.train import EvalRecord, LogRecord, Stage, StepRecord


def eval_label(record: EvalRecord) -> str:
    return {Stage.BASE.value: "base", Stage.WARM_START.value: "warm start"}.get(record.stage, f"RL {record.step}")


def family_means(record: EvalRecord, family: str) -> tuple[float, float]:
    """(success, mean rubric reward) of `record`'s tasks of `family`."""
    rows = [i for i, f in enumerate(record.families) if f == family]
    return sum(record.successes[i] for i in rows) / len(rows), sum(record.scores[i] for i in rows) / len(rows)


def write_curve_png(records: list[LogRecord], path: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in records if isinstance(r, EvalRecord)]
    steps = [r for r in records if isinstance(r, StepRecord)]
    fig, (held, trained) = plt.subplots(1, 2, figsize=(11, 4), dpi=100)
    xs = list(range(len(evals)))
    for family in dict.fromkeys(f for r in evals for f in r.families):
        means = [family_means(r, family) for r in evals]
        line, = held.plot(xs, [m[0] for m in means], marker="o", label=f"{family}: success")
        held.plot(xs, [m[1] for m in means], marker="s", linestyle="--", color=line.get_color(),
                  label=f"{family}: mean reward")
    judged = [(x, r.judge_agreement) for x, r in zip(xs, evals) if r.judge_agreement is not None]
    if judged:
        held.plot([x for x, _ in judged], [a for _, a in judged], marker="^", linestyle=":", color="grey",
                  label="judge agreement with the exact checks")
    held.set_xticks(xs, [eval_label(r) for r in evals])
    per_task = evals[0].episodes_per_task if evals else 1
    held.set_title(f"held out ({per_task} episode{'s' if per_task > 1 else ''} per task)")
    trained.plot([r.step for r in steps], [r.mean_reward for r in steps], marker=".", label="mean rubric reward")
    trained.plot([r.step for r in steps], [r.success_rate for r in steps], marker=".", linestyle="--", label="success")
    trained.set_xlabel("RL step")
    trained.set_title("training episodes")
    for ax in (held, trained):
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
