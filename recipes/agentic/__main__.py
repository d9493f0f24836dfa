"""`python -m recipes.agentic --url URL`: agentic RL in sandboxes; writes the JSONL log and the PNG curve.

It logs which sandbox backend it uses (bubblewrap here, agent-sandbox in the GKE
Job), prints each record (the run, each held-out evaluation as it comes, the warm
start, then the cookbook loop's steps and the paired tests between stages), and a
final summary of held-out success from the first evaluation to the last; it exits 0.
With no sandbox, with an --out that holds an earlier run, or with a model whose chat
format it does not render (it renders ChatML and Gemma 3's), it says so and exits 2,
before it touches the service.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from recipes.agentic.backends import BACKENDS, NoSandbox
from recipes.agentic.compare import Comparison
from recipes.agentic.plot import write_curve_png
from recipes.agentic.tasks import Family
from recipes.agentic.train import AgenticConfig, EvalRecord, LogRecord, RunRecord, StepRecord, train
from recipes.agentic.warm_start import WarmStartRecord
from recipes.chat_formats import UnknownChatFormat
from recipes.cookbook_offline import LOSSES

DEFAULTS = AgenticConfig(base_url="")


def _at_least_one(text: str) -> int:
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {count}")
    return count


def parse_args(argv: list[str] | None = None) -> tuple[AgenticConfig, Path]:
    parser = argparse.ArgumentParser(prog="python -m recipes.agentic", description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the Tinker-API service")
    parser.add_argument("--api-key", default=DEFAULTS.api_key)
    parser.add_argument("--base-model", default=DEFAULTS.base_model)
    parser.add_argument("--families", default=",".join(DEFAULTS.families),
                        help=f"comma-separated, of {', '.join(f.value for f in Family)}")
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps)
    parser.add_argument("--groups-per-step", type=int, default=DEFAULTS.groups_per_step)
    parser.add_argument("--group-size", type=int, default=DEFAULTS.group_size)
    parser.add_argument("--train-tasks", type=int, default=DEFAULTS.train_tasks)
    parser.add_argument("--held-out-tasks", type=int, default=DEFAULTS.held_out_tasks)
    parser.add_argument("--held-out-episodes", type=_at_least_one, default=DEFAULTS.held_out_episodes,
                        help="episodes of each held-out task at each evaluation, paired across stages")
    parser.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every)
    parser.add_argument("--max-turns", type=int, default=DEFAULTS.max_turns)
    parser.add_argument("--max-generation-tokens", type=int, default=DEFAULTS.max_generation_tokens)
    parser.add_argument("--max-trajectory-tokens", type=int, default=DEFAULTS.max_trajectory_tokens)
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate)
    parser.add_argument("--loss", choices=LOSSES, default=DEFAULTS.loss_fn)
    parser.add_argument("--lora-rank", type=int, default=DEFAULTS.lora_rank)
    parser.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--sandbox", choices=BACKENDS, default=DEFAULTS.sandbox)
    parser.add_argument("--judge-model", default=None,
                        help="a base model on the same service to judge held-out deliverables (reports agreement)")
    parser.add_argument("--no-tool-call-prefill", dest="tool_call_prefill", action="store_false",
                        help="let the model begin its replies itself (default: each begins as a tool call)")
    parser.add_argument("--warm-start", type=int, default=DEFAULTS.warm_start, metavar="N",
                        help="train on N expert demonstrations (train tasks) with cross_entropy before RL; 0: none")
    parser.add_argument("--warm-start-steps", type=int, default=DEFAULTS.warm_start_steps)
    parser.add_argument("--warm-start-batch", type=int, default=DEFAULTS.warm_start_batch)
    parser.add_argument("--warm-start-lr", type=float, default=DEFAULTS.warm_start_learning_rate)
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: the model's)")
    parser.add_argument("--out", type=Path, default=Path("agentic_out"), help="directory for the log and PNG")
    args = parser.parse_args(argv)
    config = AgenticConfig(
        base_url=args.url, api_key=args.api_key, base_model=args.base_model,
        families=tuple(Family(name) for name in args.families.split(",")), steps=args.steps,
        groups_per_step=args.groups_per_step, group_size=args.group_size, train_tasks=args.train_tasks,
        held_out_tasks=args.held_out_tasks, held_out_episodes=args.held_out_episodes, eval_every=args.eval_every,
        max_turns=args.max_turns, loss_fn=args.loss,
        max_generation_tokens=args.max_generation_tokens, max_trajectory_tokens=args.max_trajectory_tokens,
        learning_rate=args.learning_rate, lora_rank=args.lora_rank, temperature=args.temperature, seed=args.seed,
        sandbox=args.sandbox, tokenizer=args.tokenizer, judge_model=args.judge_model,
        tool_call_prefill=args.tool_call_prefill, warm_start=args.warm_start,
        warm_start_steps=args.warm_start_steps, warm_start_batch=args.warm_start_batch,
        warm_start_learning_rate=args.warm_start_lr,
        log_path=args.out / "records.jsonl",
    )
    return config, args.out / "held_out_success.png"


def _print_record(record: LogRecord) -> None:
    if isinstance(record, RunRecord):
        line = f"sandbox {record.sandbox_backend}  model {record.base_model}  families {','.join(record.families)}  " \
               f"episode budget {record.max_trajectory_tokens} tokens (context {record.max_context})"
    elif isinstance(record, EvalRecord):
        judged = "" if record.judge_agreement is None else f"  judge_agreement {record.judge_agreement:.3f}"
        reward = sum(record.scores) / len(record.scores) if record.scores else 0.0
        line = f"eval {record.stage} after {record.step:3d} RL steps  held_out_success {record.held_out_success:.3f}  " \
               f"mean_reward {reward:.3f}{judged}  t {record.elapsed_s:.0f}s"
    elif isinstance(record, WarmStartRecord):
        line = f"warm start: {record.demonstrations} demonstrations, {record.steps} steps of {record.batch_size}, " \
               f"loss/token {record.losses[0]:.3f} -> {record.losses[-1]:.3f}, {record.demo_s:.0f}s demos + " \
               f"{record.train_s:.0f}s training"
    elif isinstance(record, Comparison):
        line = f"{record.family}: {record.before} -> {record.after} on {record.episodes} episode pairs: success " \
               f"+{record.success.job_only}/-{record.success.base_only} (McNemar p {record.success.p_value:.3g}), " \
               f"reward {record.reward.mean_difference:+.3f} (paired permutation p {record.reward.p_value:.3g})" \
               f"{'  real' if record.is_real else ''}"
    else:
        line = f"step {record.step:3d}  mean_reward {record.mean_reward:.3f}  success {record.success_rate:.3f}  " \
               f"step_time {record.elapsed_s:.0f}s"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config, png_path = parse_args(argv)
    try:
        records = train(config, on_record=_print_record)
    except (NoSandbox, FileExistsError, UnknownChatFormat) as refusal:
        print(f"refused: {refusal}", file=sys.stderr, flush=True)
        return 2
    families = ", ".join(config.families)
    write_curve_png(records, png_path, title=f"{config.base_model}: {families}")
    [run] = [r for r in records if isinstance(r, RunRecord)]
    evals = [r for r in records if isinstance(r, EvalRecord)]
    steps = [r for r in records if isinstance(r, StepRecord)]
    print(
        f"done: {len(steps)} steps in {evals[-1].elapsed_s:.0f}s on {run.sandbox_backend}; held-out success "
        f"{evals[0].held_out_success:.3f} -> {evals[-1].held_out_success:.3f}; log {config.log_path}; "
        f"curve {png_path}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
