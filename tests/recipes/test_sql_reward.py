"""The SQL reward's pure parts: extracting the query, comparing results, and the partial-credit values."""

from __future__ import annotations

import pytest

from recipes.sql.reward import cell_f1, execution_reward, extract_sql, partial_reward, results_match
from recipes.sql.sql_worker import QueryResult


@pytest.mark.parametrize(("reply", "sql"), [
    ("```sql\nSELECT name FROM t WHERE x = 1\n```\nThis returns...", "SELECT name FROM t WHERE x = 1"),
    ("```sql\nSELECT name FROM t;\nDROP TABLE t;\n```", "SELECT name FROM t"),
    ("Sure: select a from b; and more", "select a from b"),
    ("```sql\nWITH c AS (SELECT 1) SELECT * FROM c", "WITH c AS (SELECT 1) SELECT * FROM c"),
    ("I cannot help with that.", None),
], ids=["fenced", "first-statement-only", "bare", "unclosed-fence-with-cte", "none"])
def test_extract_sql(reply: str, sql: str | None):
    assert extract_sql(reply) == sql


def test_unordered_results_match_as_multisets():
    assert results_match([["a"], ["b"], ["b"]], [["b"], ["a"], ["b"]], ordered=False)
    assert not results_match([["a"], ["b"], ["b"]], [["a"], ["b"]], ordered=False)  # a duplicate counts


def test_ordered_results_must_keep_the_gold_order():
    assert not results_match([["a"], ["b"]], [["b"], ["a"]], ordered=True)
    assert results_match([["a"], ["b"]], [["a"], ["b"]], ordered=True)


def test_floats_match_to_six_decimals():
    assert results_match([[1 / 3]], [[0.3333333]], ordered=False)
    assert not results_match([[1 / 3]], [[0.33333]], ordered=False)


def test_execution_reward_is_one_on_a_match_and_zero_otherwise():
    gold = [["Ana"], ["Ben"]]
    assert execution_reward(gold, QueryResult("ok", [["Ben"], ["Ana"]]), ordered=False) == 1.0
    assert execution_reward(gold, QueryResult("ok", [["Ana"]]), ordered=False) == 0.0
    assert execution_reward(gold, QueryResult("refused", message="not authorized"), ordered=False) == 0.0


def test_cell_f1_counts_cells_as_multisets():
    # gold cells {a, b}, predicted {a, c, d}: 2 * 1 / (2 + 3)
    assert cell_f1([["a"], ["b"]], [["a", "c"], ["d"]]) == 0.4
    assert cell_f1([], []) == 0.0


def test_partial_reward_values():
    gold = [["Ana"], ["Ben"]]
    # SELECT * where SELECT name was asked: cells {Ana, Ben} against {1, Ana, Paris, 2, Ben, Rome}: F1 = 2*2/8
    star = QueryResult("ok", [[1, "Ana", "Paris"], [2, "Ben", "Rome"]])
    assert partial_reward(gold, star, ordered=False) == 0.5 * 0.5
    assert partial_reward(gold, QueryResult("ok", [["Ben"], ["Ana"]]), ordered=False) == 1.0
    # the right rows in the wrong order, where order counts: all cells shared, F1 = 1, capped at 0.5
    assert partial_reward(gold, QueryResult("ok", [["Ben"], ["Ana"]]), ordered=True) == 0.5
    assert partial_reward(gold, QueryResult("timeout"), ordered=False) == 0.0
