"""The reward: does the model's SQL return what the gold SQL returns, run on the same database?

Extraction (`extract_sql`): the first ```sql fenced block if there is one,
else from the first SELECT (or WITH ... AS, a CTE) to the first `;` or the end
of the reply.
Nothing found scores 0.

Scoring compares result sets, never query text:
- rows are compared as multisets (order ignored) unless the gold query has
  ORDER BY, then as sequences; floats are rounded to 6 decimals first, so
  AVG computed two ways still matches; column names never matter;
- a query that the sandbox refused, timed out, overran the row limit or
  failed scores 0.

Two variants, chosen by name (`REWARDS`):
- `execution`: 1.0 on a match, else 0.0 (the metric held-out accuracy uses).
- `partial`: 1.0 on a match; for a query that ran but did not match,
  0.5 x the F1 of the two results' cells taken as multisets (every value in
  every row, flattened), so `SELECT *` where `SELECT name` was asked, or the
  right rows in the wrong order, earn part of the way; a failed query scores
  0. The 0.5 cap keeps any near miss below a match.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable

from recipes.sql.sql_worker import QueryResult

FENCED = re.compile(r"```(?:sql|sqlite)?\s*\n?(.*?)(?:```|$)", re.IGNORECASE | re.DOTALL)
# SELECT, or a WITH that opens a common table expression ("WITH [RECURSIVE] name [(cols)] AS ("), not prose's "with".
STATEMENT_START = re.compile(r"\b(SELECT\b|WITH\s+(RECURSIVE\s+)?\w+\s*(\([^)]*\))?\s*AS\s*\()", re.IGNORECASE)
PARTIAL_CAP = 0.5  # the most a non-matching query can earn under `partial`


def extract_sql(reply: str) -> str | None:
    """The SQL statement in a model's reply, without its trailing `;`; None when there is none."""
    fenced = FENCED.search(reply)
    text = fenced.group(1) if fenced else reply
    start = STATEMENT_START.search(text)
    if start is None:
        return None
    statement = text[start.start():].split(";", 1)[0].strip()
    return statement or None


def _normal_cell(cell):
    return round(cell, 6) if isinstance(cell, float) else cell


def _normal_rows(rows: list[list]) -> list[tuple]:
    return [tuple(_normal_cell(c) for c in row) for row in rows]


def results_match(gold: list[list], predicted: list[list], *, ordered: bool) -> bool:
    """Whether two result sets are the same rows: as sequences if `ordered`, else as multisets."""
    gold_rows, predicted_rows = _normal_rows(gold), _normal_rows(predicted)
    if ordered:
        return gold_rows == predicted_rows
    return Counter(gold_rows) == Counter(predicted_rows)


def cell_f1(gold: list[list], predicted: list[list]) -> float:
    """F1 of the two results' cells as multisets: 2|G ∩ P| / (|G| + |P|); 0.0 when both are empty."""
    gold_cells = Counter(_normal_cell(c) for row in gold for c in row)
    predicted_cells = Counter(_normal_cell(c) for row in predicted for c in row)
    total = sum(gold_cells.values()) + sum(predicted_cells.values())
    if total == 0:
        return 0.0
    return 2 * sum((gold_cells & predicted_cells).values()) / total


def execution_reward(gold: list[list], result: QueryResult, *, ordered: bool) -> float:
    return 1.0 if result.status == "ok" and results_match(gold, result.rows, ordered=ordered) else 0.0


def partial_reward(gold: list[list], result: QueryResult, *, ordered: bool) -> float:
    if result.status != "ok":
        return 0.0
    if results_match(gold, result.rows, ordered=ordered):
        return 1.0
    return PARTIAL_CAP * cell_f1(gold, result.rows)


RewardFn = Callable[..., float]
REWARDS: dict[str, RewardFn] = {"execution": execution_reward, "partial": partial_reward}
