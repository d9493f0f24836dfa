"""Untrusted SQL in the query workers: gold queries score 1, wrong ones 0, hostile ones 0 and change nothing."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from recipes.sql.databases import make_schemas, write_databases
from recipes.sql.questions import make_questions
from recipes.sql.reward import REWARDS, execution_reward
from recipes.sql.sandbox import KILL_GRACE_S, QueryLimits, QueryPool

TIME_LIMIT_S = 0.5
LIMITS = QueryLimits(time_limit_s=TIME_LIMIT_S, max_rows=1000)


@pytest.fixture(scope="module")
def databases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_databases(make_schemas(0), tmp_path_factory.mktemp("sql"))


@pytest.fixture(scope="module")
def pool():
    with QueryPool(2, LIMITS) as pool:
        yield pool


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_gold_query_scores_one_against_itself(databases, pool):
    questions = make_questions(make_schemas(0))
    for q in questions:
        result = pool.run(databases[q.schema], q.gold_sql)
        assert result.status == "ok", q.id
        assert execution_reward(result.rows, pool.run(databases[q.schema], q.gold_sql), ordered=q.is_ordered) == 1.0


def test_a_wrong_query_scores_zero_under_execution_and_its_overlap_under_partial(databases, pool):
    gold = pool.run(databases["shop"], "SELECT name FROM customers WHERE city = 'Paris'").rows
    wrong = pool.run(databases["shop"], "SELECT name FROM customers")
    assert wrong.status == "ok"
    assert REWARDS["execution"](gold, wrong, ordered=False) == 0.0
    # every Paris name is among all 20 names: F1 = 2 * len(gold) / (len(gold) + 20), capped at 0.5
    assert REWARDS["partial"](gold, wrong, ordered=False) == 0.5 * 2 * len(gold) / (len(gold) + 20)


HOSTILE = {
    "attach": ("ATTACH DATABASE '{dir}/stolen.sqlite' AS stolen", "refused"),
    "pragma": ("PRAGMA table_info(customers)", "refused"),
    "pragma-writable-schema": ("PRAGMA writable_schema = ON", "refused"),
    "insert": ("INSERT INTO customers VALUES (99, 'Mallory', 'Paris')", "refused"),
    "update": ("UPDATE products SET price = 0", "refused"),
    "delete": ("DELETE FROM orders", "refused"),
    "drop": ("DROP TABLE customers", "refused"),
    "create-temp": ("CREATE TEMP TABLE t (x)", "refused"),
    "begin": ("BEGIN IMMEDIATE", "refused"),
    "vacuum-into": ("VACUUM INTO '{dir}/copy.sqlite'", "refused"),
    "two-statements": ("SELECT 1; DROP TABLE customers", "error"),
    "cross-join": ("SELECT * FROM orders a, orders b, orders c", "too_many_rows"),
}


@pytest.mark.parametrize(("sql", "status"), list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_sql_scores_zero_and_leaves_the_database_unchanged(databases, pool, sql: str, status: str):
    db = databases["shop"]
    before = _digest(db)
    files_before = sorted(p.name for p in db.parent.iterdir())
    result = pool.run(db, sql.format(dir=db.parent))
    assert result.status == status
    assert [REWARDS[name]([[1]], result, ordered=False) for name in ("execution", "partial")] == [0.0, 0.0]
    assert _digest(db) == before
    assert sorted(p.name for p in db.parent.iterdir()) == files_before


def test_a_runaway_recursive_cte_is_stopped_within_its_time_limit(databases, pool):
    runaway = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    started = time.monotonic()
    result = pool.run(databases["flights"], runaway)
    elapsed = time.monotonic() - started
    assert result.status == "timeout"
    # the progress handler stops it at the limit; the kill at limit + grace is the backstop, and 0.5 s covers
    # replacing a killed worker on a busy machine
    assert TIME_LIMIT_S <= elapsed < TIME_LIMIT_S + KILL_GRACE_S + 0.5
    assert pool.run(databases["flights"], "SELECT COUNT(*) FROM airports").rows == [[6]]


def test_a_worker_that_stops_answering_is_killed_and_replaced(databases):
    with QueryPool(1, LIMITS) as pool:
        worker_pid = pool._idle.queue[0].process.pid
        os.kill(worker_pid, signal.SIGSTOP)  # a query the progress handler cannot interrupt looks like this
        started = time.monotonic()
        result = pool.run(databases["shop"], "SELECT 1")
        assert result.status == "timeout"
        assert time.monotonic() - started < TIME_LIMIT_S + KILL_GRACE_S + 0.5
        assert pool.killed_workers == 1
        assert pool._idle.queue[0].process.pid != worker_pid
        assert pool.run(databases["shop"], "SELECT 1").rows == [[1]]
