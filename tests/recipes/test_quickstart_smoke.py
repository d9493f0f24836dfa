"""The quickstart's code path, end to end on the tiny model: two steps, the JSONL log and the PNG."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from recipes.quickstart.__main__ import main
from recipes.quickstart.train import StepRecord

pytest.importorskip("matplotlib", reason="the recipe's PNG needs matplotlib (pip install -e '.[recipes]')")


def test_two_steps_write_two_records_and_a_png(shared_daemon, tiny_llama: Path, tmp_path: Path, capsys):
    argv = [
        "--url", shared_daemon.url, "--api-key", "tml-test", "--base-model", "tiny-llama",
        "--tokenizer", str(tiny_llama), "--steps", "2", "--problems-per-step", "2", "--group-size", "2",
        "--max-tokens", "3", "--out", str(tmp_path),
    ]
    assert main(argv) == 0
    lines = (tmp_path / "rewards.jsonl").read_text().splitlines()
    records = [msgspec.json.decode(line, type=StepRecord) for line in lines]
    assert [r.step for r in records] == [0, 1]
    assert all(0.0 <= r.mean_reward <= 1.0 and 1.0 <= r.mean_reply_tokens <= 3.0 for r in records)
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "done: 2 steps" in capsys.readouterr().out
