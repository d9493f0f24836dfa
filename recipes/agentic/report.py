"""`python -m recipes.agentic.report RECORDS.jsonl`: a run's held-out figures and paired tests, as a table.

For each family (and over all tasks), at each evaluation: success, mean rubric
reward and mean turns; then each stage against the one before it (`train.comparisons`),
and the judge's agreement with the exact checks where a judge ran, at each
evaluation and over them all. It reads the
run's JSONL log only, so it also reports a run that has not finished.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from recipes.agentic.compare import figures
from recipes.agentic.judge import Agreement
from recipes.agentic.plot import eval_label
from recipes.agentic.train import ALL_FAMILIES, EvalRecord, LogRecord, comparisons


def read_records(path: Path) -> list[LogRecord]:
    return [msgspec.json.decode(line, type=LogRecord) for line in path.read_text().splitlines() if line]


def report(records: list[LogRecord]) -> list[str]:
    evals = [r for r in records if isinstance(r, EvalRecord)]
    lines = [f"{'family':18} {'stage':11} {'episodes':>8} {'success':>8} {'reward':>7} {'turns':>6}"]
    for family in [*dict.fromkeys(f for r in evals for f in r.families), ALL_FAMILIES]:
        for record in evals:
            rows = [i for i, f in enumerate(record.families) if family in (f, ALL_FAMILIES)]
            stage = figures(family, record.stage, [record.successes[i] for i in rows],
                            [record.scores[i] for i in rows], [record.turns[i] for i in rows])
            lines.append(f"{family:18} {eval_label(record):11} {stage.episodes:8d} {stage.success:8.3f} "
                         f"{stage.mean_reward:7.3f} {stage.mean_turns:6.2f}")
    for c in comparisons(evals) if len(evals) > 1 else []:
        lines.append(f"{c.family}: {c.before} -> {c.after} on {c.episodes} episode pairs: success +{c.success.job_only}/"
                     f"-{c.success.base_only} (exact McNemar p {c.success.p_value:.3g}); reward "
                     f"{c.reward.mean_difference:+.3f} (exact paired permutation p {c.reward.p_value:.3g})"
                     f"{', real' if c.is_real else ''}")
    judged = [(eval_label(r), r.judge_counts) for r in evals if r.judge_counts is not None]
    if len(judged) > 1:
        judged.append(("every evaluation", total_agreement([j for _, j in judged])))
    for label, j in judged:
        lines.append(f"judge at {label}: agrees on {j.agreed}/{j.episodes} ({j.rate:.3f}); "
                     f"judge passed {j.judge_passed}, exact passed {j.exact_passed}")
    return lines


def total_agreement(counts: list[Agreement]) -> Agreement:
    """The judge's verdicts over several evaluations' episodes together."""
    return Agreement(sum(j.episodes for j in counts), sum(j.agreed for j in counts),
                     sum(j.judge_passed for j in counts), sum(j.exact_passed for j in counts))


def main(argv: list[str] | None = None) -> int:
    [path] = sys.argv[1:] if argv is None else argv
    print("\n".join(report(read_records(Path(path)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
