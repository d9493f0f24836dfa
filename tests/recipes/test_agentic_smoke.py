"""The agentic recipe's code path, end to end on the tiny model in bubblewrap: two steps, the JSONL log, the PNG."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from recipes.agentic.__main__ import main
from recipes.agentic.sandbox import bwrap_works
from recipes.agentic.train import StepRecord

pytest.importorskip("matplotlib", reason="the recipe's PNG needs matplotlib (pip install -e '.[recipes]')")
pytestmark = pytest.mark.skipif(not bwrap_works(), reason="bubblewrap is missing or cannot make namespaces here "
                                                          "(apt-get install bubblewrap)")


def test_two_steps_write_two_records_with_held_out_success_judge_agreement_and_a_png(
    shared_daemon, tiny_llama: Path, tmp_path: Path, capsys,
):
    argv = [
        "--url", shared_daemon.url, "--api-key", "tml-test", "--base-model", "tiny-llama",
        "--tokenizer", str(tiny_llama), "--steps", "2", "--groups-per-step", "2", "--group-size", "2",
        "--held-out-tasks", "2", "--max-turns", "2", "--max-generation-tokens", "8", "--sandbox", "bwrap",
        "--judge-model", "tiny-llama",
        "--out", str(tmp_path),
    ]
    assert main(argv) == 0
    records = [msgspec.json.decode(line, type=StepRecord) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert [r.step for r in records] == [0, 1]
    assert [r.sandbox_backend for r in records] == ["bwrap", "bwrap"]
    # Evaluated at the first and the last step, over the 2 held-out tasks.
    assert [r.held_out_success in (0.0, 0.5, 1.0) for r in records] == [True, True]
    assert [r.judge_agreement in (0.0, 0.5, 1.0) for r in records] == [True, True]
    assert all(0.0 <= r.mean_reward <= 1.0 and 1.0 <= r.mean_turns <= 2.0 for r in records)
    assert (tmp_path / "held_out_success.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "done: 2 steps" in capsys.readouterr().out
