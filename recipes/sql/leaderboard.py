"""The sweep's leaderboard: one row per job, written as CSV (read back by autoresearch) and Markdown.

A row holds the job's grid point, its held-out execution accuracy at each
evaluated step (the same steps for every job of a sweep), its tokens and wall
time. The Markdown adds the base model's accuracy (every job's step-0
evaluation: a fresh LoRA adapter is the base model, and greedy decoding makes
them identical) and the exact McNemar test of the best job against the base,
Bonferroni-adjusted for the best being picked from all the jobs, with the
seeds, so a reader can rerun it.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import msgspec

from recipes.sql.autoresearch import GridPoint, Result, best_result
from recipes.sql.stats import McNemar

CSV_FIELDS = ("round", "job", "learning_rate", "lora_rank", "group_size", "loss", "reward", "seed",
              "accuracy_by_step", "final_accuracy", "tokens", "wall_s")


class JobRow(msgspec.Struct, frozen=True):
    round: int  # 0 for the first grid, then one per autoresearch round
    job: str  # its directory name under the sweep's jobs/
    point: GridPoint
    seed: int
    accuracy_by_step: dict[int, float]  # held-out execution accuracy (greedy) at each evaluated step
    tokens: int  # prompt and sampled tokens, training and evaluation
    wall_s: float

    @property
    def final_accuracy(self) -> float:
        return self.accuracy_by_step[max(self.accuracy_by_step)]

    def result(self) -> Result:
        return Result(self.point, self.final_accuracy, self.tokens)


class BaseComparison(msgspec.Struct, frozen=True):
    base_accuracy: float
    best_job: str
    test: McNemar
    n_questions: int
    job_seed: int
    data_seed: int
    jobs_compared: int  # the K jobs the best was picked from
    adjusted_p: float  # the test's p-value, Bonferroni-adjusted for that choice

    @property
    def significant(self) -> bool:
        """Whether the best job beats the base at the 5% level after the adjustment."""
        return self.test.job_only > self.test.base_only and self.adjusted_p < 0.05


def _steps_text(accuracy_by_step: dict[int, float]) -> str:
    return " ".join(f"{step}:{accuracy!r}" for step, accuracy in sorted(accuracy_by_step.items()))


def _steps_parse(text: str) -> dict[int, float]:
    pairs = (item.split(":") for item in text.split())
    return {int(step): float(accuracy) for step, accuracy in pairs}


def write_csv(rows: Sequence[JobRow], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS)
        for r in rows:
            p = r.point
            writer.writerow([r.round, r.job, repr(p.learning_rate), p.lora_rank, p.group_size, p.loss, p.reward,
                             r.seed, _steps_text(r.accuracy_by_step), repr(r.final_accuracy), r.tokens,
                             f"{r.wall_s:.1f}"])
    return path


def read_csv(path: Path) -> list[JobRow]:
    with path.open(newline="") as f:
        return [
            JobRow(
                round=int(d["round"]), job=d["job"],
                point=GridPoint(float(d["learning_rate"]), int(d["lora_rank"]), int(d["group_size"]), d["loss"],
                                d["reward"]),
                seed=int(d["seed"]), accuracy_by_step=_steps_parse(d["accuracy_by_step"]), tokens=int(d["tokens"]),
                wall_s=float(d["wall_s"]),
            )
            for d in csv.DictReader(f)
        ]


def best_row(rows: Sequence[JobRow]) -> JobRow:
    """The row autoresearch calls best (highest final accuracy, then fewer tokens, then earlier)."""
    best = best_result([r.result() for r in rows])
    return next(r for r in rows if r.result() == best)


def write_markdown(rows: Sequence[JobRow], comparison: BaseComparison, path: Path, *, title: str) -> Path:
    steps = sorted({s for r in rows for s in r.accuracy_by_step})
    ranked = sorted(rows, key=lambda r: (-r.final_accuracy, r.tokens, rows.index(r)))
    lines = [
        f"# {title}", "",
        f"Held-out execution accuracy (greedy, {comparison.n_questions} questions) at each evaluated step; "
        f"base model (step 0, evaluated once: every job starts from it): {comparison.base_accuracy:.3f}. "
        f"Job seed {comparison.job_seed} (the order of train questions; the cookbook loop seeds neither the LoRA "
        f"initialisation nor sampling) and data seed {comparison.data_seed} (rows, questions, split) for every job. "
        "Ranked by final accuracy, then fewer tokens.", "",
        "| rank | round | job | lr | LoRA rank | group | loss | reward | "
        + " | ".join(f"acc@{s}" for s in steps) + " | tokens | wall s |",
        "|" + "---|" * (10 + len(steps)),
    ]
    for i, r in enumerate(ranked, start=1):
        p = r.point
        accs = " | ".join(f"{r.accuracy_by_step[s]:.3f}" if s in r.accuracy_by_step else "" for s in steps)
        lines.append(f"| {i} | {r.round} | {r.job} | {p.learning_rate:g} | {p.lora_rank} | {p.group_size} | {p.loss} "
                     f"| {p.reward} | {accs} | {r.tokens} | {r.wall_s:.0f} |")
    t = comparison.test
    lines += [
        "", "## Best job against the base model", "",
        f"Exact McNemar test (two-sided) on the paired held-out answers of `{comparison.best_job}` (final step) and "
        f"the base model (step 0): the job alone right on {t.job_only} questions, the base alone on {t.base_only}; "
        f"p = {t.p_value:.4g}. It is the best of {comparison.jobs_compared} jobs, picked after seeing their answers, "
        f"so the p-value is Bonferroni-adjusted for that choice: {comparison.adjusted_p:.4g}, "
        f"{'significant' if comparison.significant else 'not significant'} at the 5% level. "
        f"Seeds: job {comparison.job_seed}, data {comparison.data_seed}.", "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path
