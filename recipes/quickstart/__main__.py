"""`python -m recipes.quickstart --url URL`: train, write the JSONL log and the PNG curve, print a summary.

The defaults are the run shown in the README. The CLI prints one line per
step and a final summary (first and last steps' mean reward), and exits 0.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from recipes.quickstart.plot import write_reward_png
from recipes.quickstart.train import QuickstartConfig, StepRecord, train

DEFAULTS = QuickstartConfig(base_url="")


def parse_args(argv: list[str] | None = None) -> tuple[QuickstartConfig, Path]:
    parser = argparse.ArgumentParser(prog="python -m recipes.quickstart", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the openrld node")
    parser.add_argument("--api-key", default=DEFAULTS.api_key)
    parser.add_argument("--base-model", default=DEFAULTS.base_model)
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps)
    parser.add_argument("--problems-per-step", type=int, default=DEFAULTS.problems_per_step)
    parser.add_argument("--group-size", type=int, default=DEFAULTS.group_size)
    parser.add_argument("--max-tokens", type=int, default=DEFAULTS.max_tokens)
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate)
    parser.add_argument("--lora-rank", type=int, default=DEFAULTS.lora_rank)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: the model's)")
    parser.add_argument("--time-limit-s", type=float, default=None, help="stop after the step that crosses it")
    parser.add_argument("--out", type=Path, default=Path("quickstart_out"), help="directory for the log and PNG")
    args = parser.parse_args(argv)
    config = QuickstartConfig(
        base_url=args.url, api_key=args.api_key, base_model=args.base_model, steps=args.steps,
        problems_per_step=args.problems_per_step, group_size=args.group_size, max_tokens=args.max_tokens,
        learning_rate=args.learning_rate, lora_rank=args.lora_rank, seed=args.seed,
        time_limit_s=args.time_limit_s, tokenizer=args.tokenizer, log_path=args.out / "rewards.jsonl",
    )
    return config, args.out / "reward_curve.png"


def _print_step(record: StepRecord) -> None:
    print(
        f"step {record.step:3d}  mean_reward {record.mean_reward:.3f}  full_marks {record.full_marks_fraction:.3f}  "
        f"reply_tokens {record.mean_reply_tokens:.1f}  groups {record.groups_used}  t {record.elapsed_s:.0f}s",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config, png_path = parse_args(argv)
    records = train(config, on_step=_print_step)
    write_reward_png(records, png_path, title=f"{config.base_model}: single-digit addition, LoRA RL on CPU")
    first, last = records[0], records[-1]
    print(
        f"done: {len(records)} steps in {last.elapsed_s:.0f}s; mean reward {first.mean_reward:.3f} -> "
        f"{last.mean_reward:.3f}; log {config.log_path}; curve {png_path}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
