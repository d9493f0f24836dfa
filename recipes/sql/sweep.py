"""The sweep driver: K text-to-SQL jobs at once against one service, a leaderboard, curves, autoresearch rounds.

`python -m recipes.sql sweep --lr 2e-4,8e-4 --loss importance_sampling,ppo ...`
runs the grid (the product of the comma-separated lists) `--jobs` at a time,
each job the training entry (`train.train`) in a thread of its own: its
rollouts and requests overlap the others', which is what a shared service is
for. Every job uses the same job seed and data seed, so the jobs and the base
model answer the same held-out questions and are compared pairwise. Each job
runs the cookbook's loop, which prints its per-step metrics table and points
the logging module at its own `logs.log` (the last job started holds it);
this driver's own lines start with the job's name or "round".

After each round it writes, under `--out`:
- `leaderboard.csv` and `leaderboard.md` (see `leaderboard.py`), the latter
  with the exact McNemar test of the best job against the base model;
- `heldout_curves.png`: every job's held-out accuracy by step, and the base;
- `jobs/<job>/log.jsonl`: each job's records.

With `--autoresearch`, `--rounds R` runs R rounds in all: the given grid,
then R-1 grids proposed by `autoresearch.next_grid` from the leaderboard so
far, each round's rows appended to it.
"""

from __future__ import annotations

import argparse
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from recipes.cookbook_offline import LOSSES
from recipes.sql.autoresearch import GridPoint, next_grid
from recipes.sql.leaderboard import BaseComparison, JobRow, best_row, write_csv, write_markdown
from recipes.sql.reward import REWARDS
from recipes.sql.stats import bonferroni, mcnemar_exact
from recipes.sql.train import DoneRecord, EvalRecord, LogRecord, SqlTrainConfig, read_log, train

logger = logging.getLogger(__name__)


def grid_product(lrs: Sequence[float], ranks: Sequence[int], group_sizes: Sequence[int], losses: Sequence[str],
                 rewards: Sequence[str]) -> list[GridPoint]:
    return [GridPoint(*values) for values in itertools.product(lrs, ranks, group_sizes, losses, rewards)]


def job_name(round_: int, index: int, p: GridPoint) -> str:
    return f"r{round_}-j{index}-lr{p.learning_rate:g}-rank{p.lora_rank}-g{p.group_size}-{p.loss}-{p.reward}"


def row_from_log(round_: int, job: str, point: GridPoint, seed: int, records: Sequence[LogRecord]) -> JobRow:
    evals = [r for r in records if isinstance(r, EvalRecord)]
    done = records[-1]
    assert isinstance(done, DoneRecord), f"{job}: its log ends without a summary"
    return JobRow(round=round_, job=job, point=point, seed=seed,
                  accuracy_by_step={e.step: e.accuracy for e in evals}, tokens=done.tokens, wall_s=done.wall_s)


def run_round(round_: int, grid: Sequence[GridPoint], make_config: Callable[..., SqlTrainConfig], out: Path,
              parallel: int) -> list[JobRow]:
    """Run `grid`'s jobs, `parallel` at a time; their rows in grid order.

    Only the sweep's first job evaluates the base model (step 0): every job
    starts from the same base with a zero LoRA update and decodes greedily,
    so the others' step-0 answers would be the same, at the cost of one
    held-out pass each.
    """
    names = [job_name(round_, i, p) for i, p in enumerate(grid)]
    configs = [
        make_config(out / "jobs" / name / "log.jsonl", learning_rate=p.learning_rate, lora_rank=p.lora_rank,
                    group_size=p.group_size, loss=p.loss, reward=p.reward, eval_at_start=(round_ == 0 and i == 0))
        for i, (name, p) in enumerate(zip(names, grid))
    ]

    def run(name: str, config: SqlTrainConfig) -> list[LogRecord]:
        def report(record: LogRecord) -> None:
            if isinstance(record, EvalRecord):
                print(f"{name}: eval step {record.step} heldout_accuracy {record.accuracy:.3f} "
                      f"t {record.elapsed_s:.0f}s", flush=True)
        return train(config, on_record=report)

    with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="sql-job") as pool:
        futures = [pool.submit(run, name, config) for name, config in zip(names, configs)]
        logs = [f.result() for f in futures]
    return [row_from_log(round_, n, p, c.seed, log) for n, p, c, log in zip(names, grid, configs, logs)]


def compare_best_to_base(rows: Sequence[JobRow], out: Path, data_seed: int) -> BaseComparison:
    """The best job's final held-out answers against the base model's (the first job's step-0 answers)."""
    best = best_row(rows)
    base_eval = next(r for r in read_log(out / "jobs" / rows[0].job / "log.jsonl") if isinstance(r, EvalRecord))
    best_eval = [r for r in read_log(out / "jobs" / best.job / "log.jsonl") if isinstance(r, EvalRecord)][-1]
    assert base_eval.question_ids == best_eval.question_ids, "the jobs were evaluated on different questions"
    test = mcnemar_exact(best_eval.correct, base_eval.correct)
    return BaseComparison(base_accuracy=base_eval.accuracy, best_job=best.job, test=test,
                          n_questions=len(base_eval.correct), job_seed=best.seed, data_seed=data_seed,
                          jobs_compared=len(rows), adjusted_p=bonferroni(test.p_value, len(rows)))


def write_curves_png(rows: Sequence[JobRow], base_accuracy: float, path: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for r in rows:
        curve = {0: base_accuracy, **r.accuracy_by_step}  # every job starts at the base model
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], marker="o", label=r.job)
    ax.axhline(base_accuracy, color="black", linestyle="--", label="base model")
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out execution accuracy (greedy)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(rows: Sequence[JobRow], out: Path, data_seed: int, base_model: str) -> BaseComparison:
    comparison = compare_best_to_base(rows, out, data_seed)
    title = f"{base_model}: text-to-SQL LoRA RL sweep"
    write_csv(rows, out / "leaderboard.csv")
    write_markdown(rows, comparison, out / "leaderboard.md", title=title)
    write_curves_png(rows, comparison.base_accuracy, out / "heldout_curves.png", title=title)
    return comparison


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = text.split(",")
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"expected names from {', '.join(allowed)}; got {', '.join(bad)}")
        return names
    return parse


def main_sweep(argv: list[str], add_job_args, job_config) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.sql sweep", description=__doc__.splitlines()[0])
    add_job_args(parser)
    parser.add_argument("--lr", type=_floats, default=[2e-4, 8e-4], help="comma-separated learning rates")
    parser.add_argument("--rank", type=_ints, default=[16], help="comma-separated LoRA ranks")
    parser.add_argument("--group-size", type=_ints, default=[4], help="comma-separated group sizes")
    parser.add_argument("--loss", type=_names(LOSSES), default=["importance_sampling", "ppo"])
    parser.add_argument("--reward", type=_names(tuple(REWARDS)), default=["execution"])
    parser.add_argument("--jobs", type=int, default=4, help="jobs run at once (and the size of proposed grids)")
    parser.add_argument("--seed", type=int, default=0, help="every job's seed")
    parser.add_argument("--autoresearch", action="store_true", help="propose each next grid from the leaderboard")
    parser.add_argument("--rounds", type=int, default=1, help="rounds in all, the given grid's included")
    parser.add_argument("--out", type=Path, default=Path("sql_sweep"))
    args = parser.parse_args(argv)

    def make_config(log_path: Path, **point) -> SqlTrainConfig:
        return job_config(args, log_path, seed=args.seed, query_workers=1, **point)

    grid = grid_product(args.lr, args.rank, args.group_size, args.loss, args.reward)
    rows: list[JobRow] = []
    for round_ in range(args.rounds if args.autoresearch else 1):
        if round_ > 0:
            grid = next_grid([r.result() for r in rows], args.jobs)
            if not grid:
                print(f"round {round_}: no untried neighbour of the best job is left; stopping", flush=True)
                break
        print(f"round {round_}: {len(grid)} jobs", flush=True)
        rows += run_round(round_, grid, make_config, args.out, args.jobs)
        comparison = write_outputs(rows, args.out, args.data_seed, args.base_model)
        t = comparison.test
        print(f"round {round_} done: best {comparison.best_job} "
              f"{best_row(rows).final_accuracy:.3f} vs base {comparison.base_accuracy:.3f} "
              f"(McNemar exact p={t.p_value:.4g}, {t.job_only} vs {t.base_only}; Bonferroni over {len(rows)} jobs "
              f"{comparison.adjusted_p:.4g}); leaderboard {args.out}/leaderboard.md",
              flush=True)
    return 0
