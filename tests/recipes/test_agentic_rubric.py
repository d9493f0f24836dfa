"""The agentic rubric: exact checks on right, wrong, partial and missing deliverables."""

from __future__ import annotations

from recipes.agentic.rubric import grade
from recipes.agentic.tasks import CsvAnswer, JsonAnswer, TextAnswer

DATE = TextAnswer(text="2027-07-22")
TERMS = JsonAnswer(fields={"termination_date": "2027-07-22", "notice_period_days": 30})
PAYMENTS = CsvAnswer(header=["invoice_id", "amount"], rows=[["INV-1", "8409"], ["INV-2", "6347"]])


def test_text_right_with_surrounding_whitespace_scores_one():
    result = grade(DATE, "  2027-07-22\n")
    assert (result.score, result.success) == (1.0, True)


def test_text_wrong_scores_half_for_the_written_file():
    result = grade(DATE, "2027-07-21")
    assert (result.score, result.success) == (0.5, False)


def test_a_missing_deliverable_scores_zero():
    assert [grade(e, None).score for e in (DATE, TERMS, PAYMENTS)] == [0.0, 0.0, 0.0]


def test_json_right_scores_one_and_extra_fields_are_ignored():
    result = grade(TERMS, '{"termination_date": "2027-07-22", "notice_period_days": 30, "note": "x"}')
    assert (result.score, result.success) == (1.0, True)


def test_json_with_the_notice_period_as_a_string_misses_that_field():
    result = grade(TERMS, '{"termination_date": "2027-07-22", "notice_period_days": "30"}')
    assert [c.passed for c in result.checks] == [True, True, False]
    assert result.score == 2 / 3


def test_json_that_does_not_parse_passes_nothing():
    assert grade(TERMS, "termination_date: 2027-07-22").score == 0.0


def test_csv_rows_match_as_a_set_in_any_order():
    result = grade(PAYMENTS, "invoice_id,amount\nINV-2, 6347\nINV-1,8409\n")
    assert (result.score, result.success) == (1.0, True)


def test_csv_with_a_missing_row_passes_file_and_header_only():
    result = grade(PAYMENTS, "invoice_id,amount\nINV-1,8409\n")
    assert [c.passed for c in result.checks] == [True, True, False]


def test_csv_with_an_extra_row_fails_the_rows():
    result = grade(PAYMENTS, "invoice_id,amount\nINV-1,8409\nINV-2,6347\nINV-3,100\n")
    assert [c.name for c in result.checks if not c.passed] == ["rows as a set"]


def test_csv_with_the_wrong_header_fails_the_header():
    result = grade(PAYMENTS, "id,amount\nINV-1,8409\nINV-2,6347\n")
    assert [c.name for c in result.checks if not c.passed] == ["header"]
