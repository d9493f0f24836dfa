"""`python -m recipes.sql train|sweep ...`: one text-to-SQL RL job, or a sweep of them (with autoresearch rounds).

`train` writes the job's JSONL log (held-out eval records as they come, then
step records and a summary) and the cookbook's own logs beside it, and prints
one line per record. `sweep` runs a grid of jobs in parallel against one
service and writes the leaderboard (Markdown, CSV) and the held-out curves
(PNG); with `--autoresearch --rounds R` it proposes each next grid from the
leaderboard. Both print only results.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from recipes.cookbook_offline import LOSSES
from recipes.sql.reward import REWARDS
from recipes.sql.train import DoneRecord, EvalRecord, LogRecord, SqlTrainConfig, train

DEFAULTS = SqlTrainConfig(base_url="")


def _add_job_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the Tinker service")
    parser.add_argument("--api-key", default=DEFAULTS.api_key)
    parser.add_argument("--base-model", default=DEFAULTS.base_model)
    parser.add_argument("--renderer", default=DEFAULTS.renderer,
                        help="a tinker-cookbook renderer name, or gemma3 (default: the model's own chat format)")
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: the model's)")
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps)
    parser.add_argument("--questions-per-step", type=int, default=DEFAULTS.questions_per_step)
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens)
    parser.add_argument("--temperature", type=float, default=DEFAULTS.temperature, help="the training samples'")
    parser.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every, help="steps between held-out evals")
    parser.add_argument("--data-seed", type=int, default=DEFAULTS.data_seed)
    parser.add_argument("--families", default=",".join(DEFAULTS.families), help="comma-separated question families")
    parser.add_argument("--heldout-fraction", type=float, default=DEFAULTS.heldout_fraction,
                        help="of each family's questions, held out")


def _job_config(args: argparse.Namespace, log_path: Path, **overrides) -> SqlTrainConfig:
    fields = dict(
        base_url=args.url, api_key=args.api_key, base_model=args.base_model, renderer=args.renderer,
        tokenizer=args.tokenizer, steps=args.steps, questions_per_step=args.questions_per_step,
        max_tokens=args.max_tokens, temperature=args.temperature, eval_every=args.eval_every, data_seed=args.data_seed,
        families=tuple(args.families.split(",")), heldout_fraction=args.heldout_fraction, log_path=log_path,
    )
    fields.update(overrides)
    return SqlTrainConfig(**fields)


def _print_record(record: LogRecord) -> None:
    if isinstance(record, EvalRecord):
        print(f"eval step {record.step:3d}  heldout_accuracy {record.accuracy:.3f}  t {record.elapsed_s:.0f}s",
              flush=True)
    elif isinstance(record, DoneRecord):
        print(f"job done: {record.steps} steps, {record.tokens} tokens, {record.wall_s:.0f}s", flush=True)
    else:
        print(f"step {record.step:3d}  mean_reward {record.mean_reward:.3f}  correct {record.correct_fraction:.3f}  "
              f"rollout_tokens {record.tokens}  step_s {record.step_s:.1f}", flush=True)


def main_train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m recipes.sql train", description="one text-to-SQL RL job")
    _add_job_args(parser)
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate)
    parser.add_argument("--lora-rank", type=int, default=DEFAULTS.lora_rank)
    parser.add_argument("--group-size", type=int, default=DEFAULTS.group_size)
    parser.add_argument("--loss", choices=LOSSES, default=DEFAULTS.loss)
    parser.add_argument("--reward", choices=tuple(REWARDS), default=DEFAULTS.reward)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--out", type=Path, default=Path("sql_out"), help="directory for the JSONL log")
    args = parser.parse_args(argv)
    config = _job_config(args, args.out / "log.jsonl", learning_rate=args.learning_rate, lora_rank=args.lora_rank,
                         group_size=args.group_size, loss=args.loss, reward=args.reward, seed=args.seed)
    records = train(config, on_record=_print_record)
    evals = [r for r in records if isinstance(r, EvalRecord)]
    done = records[-1]
    assert isinstance(done, DoneRecord)
    print(f"done: heldout accuracy {evals[0].accuracy:.3f} -> {evals[-1].accuracy:.3f} after {done.steps} steps, "
          f"{done.tokens} tokens, {done.wall_s:.0f}s; log {config.log_path}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    if argv[:1] == ["train"]:
        return main_train(argv[1:])
    if argv[:1] == ["sweep"]:
        from recipes.sql.sweep import main_sweep

        return main_sweep(argv[1:], _add_job_args, _job_config)
    print("usage: python -m recipes.sql {train|sweep} [options]  (--help after either for its options)")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
