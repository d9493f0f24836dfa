"""`python -m recipes.agentic --url URL`: agentic RL in sandboxes; writes the JSONL log and the PNG curve.

It logs which sandbox backend it uses (bubblewrap here, agent-sandbox in the GKE
Job), prints each record (the run, each held-out evaluation as it comes, then the
cookbook loop's steps), and a final summary of held-out success from the first
evaluation to the last; it exits 0.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from recipes.agentic.backends import BACKENDS
from recipes.agentic.plot import write_curve_png
from recipes.agentic.tasks import Family
from recipes.agentic.train import AgenticConfig, EvalRecord, LogRecord, RunRecord, StepRecord, train

DEFAULTS = AgenticConfig(base_url="")


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
    parser.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every)
    parser.add_argument("--max-turns", type=int, default=DEFAULTS.max_turns)
    parser.add_argument("--max-generation-tokens", type=int, default=DEFAULTS.max_generation_tokens)
    parser.add_argument("--max-trajectory-tokens", type=int, default=DEFAULTS.max_trajectory_tokens)
    parser.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate)
    parser.add_argument("--lora-rank", type=int, default=DEFAULTS.lora_rank)
    parser.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--sandbox", choices=BACKENDS, default=DEFAULTS.sandbox)
    parser.add_argument("--judge-model", default=None,
                        help="a base model on the same service to judge held-out deliverables (reports agreement)")
    parser.add_argument("--no-tool-call-prefill", dest="tool_call_prefill", action="store_false",
                        help="let the model begin its replies itself (default: each begins as a tool call)")
    parser.add_argument("--tokenizer", default=None, help="a local tokenizer directory (default: the model's)")
    parser.add_argument("--out", type=Path, default=Path("agentic_out"), help="directory for the log and PNG")
    args = parser.parse_args(argv)
    config = AgenticConfig(
        base_url=args.url, api_key=args.api_key, base_model=args.base_model,
        families=tuple(Family(name) for name in args.families.split(",")), steps=args.steps,
        groups_per_step=args.groups_per_step, group_size=args.group_size, train_tasks=args.train_tasks,
        held_out_tasks=args.held_out_tasks, eval_every=args.eval_every, max_turns=args.max_turns,
        max_generation_tokens=args.max_generation_tokens, max_trajectory_tokens=args.max_trajectory_tokens,
        learning_rate=args.learning_rate, lora_rank=args.lora_rank, temperature=args.temperature, seed=args.seed,
        sandbox=args.sandbox, tokenizer=args.tokenizer, judge_model=args.judge_model,
        tool_call_prefill=args.tool_call_prefill,
        log_path=args.out / "records.jsonl",
    )
    return config, args.out / "held_out_success.png"


def _print_record(record: LogRecord) -> None:
    if isinstance(record, RunRecord):
        line = f"sandbox {record.sandbox_backend}  model {record.base_model}  families {','.join(record.families)}"
    elif isinstance(record, EvalRecord):
        judged = "" if record.judge_agreement is None else f"  judge_agreement {record.judge_agreement:.3f}"
        line = f"eval after {record.step:3d} steps  held_out_success {record.held_out_success:.3f}{judged}  " \
               f"t {record.elapsed_s:.0f}s"
    else:
        line = f"step {record.step:3d}  mean_reward {record.mean_reward:.3f}  success {record.success_rate:.3f}  " \
               f"step_time {record.elapsed_s:.0f}s"
    print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config, png_path = parse_args(argv)
    records = train(config, on_record=_print_record)
    families = ", ".join(config.families)
    write_curve_png(records, png_path, title=f"{config.base_model}: {families}, LoRA RL in sandboxes")
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
