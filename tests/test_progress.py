"""The progress board: latest report per key, fractions that never go back, final states kept."""

from __future__ import annotations

from openrld.progress import Progress, ProgressBoard, Stage


class StepClock:
    """A wall clock that advances one second per reading."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_the_latest_report_is_what_get_returns():
    board = ProgressBoard(clock=StepClock())
    board.report("m", "gguf_conversion", Stage.READING, 0.0, "reading")
    board.report("m", "gguf_conversion", Stage.CONVERTING, 0.15, "dequantizing")
    assert board.get("m") == Progress(
        key="m", operation="gguf_conversion", stage=Stage.CONVERTING, fraction=0.15,
        message="dequantizing", started_at=1001.0, updated_at=1002.0,
    )


def test_an_unknown_key_has_no_progress():
    assert ProgressBoard().get("nothing") is None


def test_a_lower_fraction_within_one_operation_keeps_the_higher_one():
    board = ProgressBoard(clock=StepClock())
    board.report("m", "gguf_conversion", Stage.WRITING, 0.75, "writing")
    board.report("m", "gguf_conversion", Stage.FAILED, 0.0, "disk full")
    failed = board.get("m")
    assert (failed.stage, failed.fraction, failed.message, failed.is_final) == (Stage.FAILED, 0.75, "disk full", True)


def test_a_new_operation_after_a_final_report_starts_from_zero_with_a_new_clock():
    board = ProgressBoard(clock=StepClock())
    board.report("m", "gguf_conversion", Stage.FAILED, 0.5, "failed")
    again = board.report("m", "gguf_conversion", Stage.READING, 0.0, "again")
    assert (again.fraction, again.started_at) == (0.0, 1002.0)


def test_fractions_are_clamped_to_zero_and_one():
    board = ProgressBoard(clock=StepClock())
    assert board.report("a", "op", Stage.CONVERTING, 1.5, "").fraction == 1.0
    assert board.report("b", "op", Stage.CONVERTING, -0.5, "").fraction == 0.0


def test_statistics_lists_every_key_in_order():
    board = ProgressBoard(clock=StepClock())
    board.report("b", "op", Stage.READY, 1.0, "")
    board.report("a", "op", Stage.QUEUED, 0.0, "")
    assert [p.key for p in board.statistics()] == ["a", "b"]


def test_each_report_is_logged_with_key_stage_and_fraction(caplog):
    board = ProgressBoard(clock=StepClock())
    with caplog.at_level("INFO", logger="openrld.progress"):
        board.report("SmolLM2", "gguf_conversion", Stage.CONVERTING, 0.15, "dequantizing weights")
    assert caplog.messages == [
        "progress operation=gguf_conversion key=SmolLM2 stage=converting fraction=0.15 elapsed_s=0.0 dequantizing weights"
    ]
