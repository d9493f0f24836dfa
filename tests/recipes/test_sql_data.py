"""The SQL recipe's data: schemas, rows, questions and the split are functions of the seed alone."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from recipes.sql.databases import make_schemas, write_databases
from recipes.sql.questions import FAMILIES, make_questions, split_questions


def test_the_same_seed_gives_the_same_rows_questions_and_split():
    first, second = make_schemas(7), make_schemas(7)
    assert first == second
    assert make_questions(first) == make_questions(second)
    assert split_questions(make_questions(first), 7) == split_questions(make_questions(second), 7)


def test_another_seed_gives_other_rows():
    assert make_schemas(0) != make_schemas(1)


def test_seed_0_has_214_questions_split_160_train_54_heldout_with_every_family_in_both():
    split = split_questions(make_questions(make_schemas(0)), 0)
    assert (len(split.train), len(split.heldout)) == (160, 54)
    # ceil(n/4) per family: filter 127 -> 32, join 56 -> 14, group 11 -> 3, order 20 -> 5
    assert [sum(q.family == f for q in split.heldout) for f in FAMILIES] == [32, 14, 3, 5]
    assert not {q.id for q in split.train} & {q.id for q in split.heldout}


@pytest.mark.parametrize("seed", range(10))
def test_every_gold_query_returns_rows_whatever_the_seed(seed: int, tmp_path: Path):
    schemas = make_schemas(seed)
    paths = write_databases(schemas, tmp_path)
    empty = []
    for question in make_questions(schemas):
        with sqlite3.connect(paths[question.schema]) as connection:
            if not connection.execute(question.gold_sql).fetchall():
                empty.append(question.text)
        connection.close()
    assert empty == []


def test_written_database_holds_the_schemas_rows(tmp_path: Path):
    schemas = make_schemas(0)
    paths = write_databases(schemas, tmp_path)
    shop = next(s for s in schemas if s.name == "shop")
    with sqlite3.connect(paths["shop"]) as connection:
        rows = connection.execute("SELECT * FROM products ORDER BY id").fetchall()
    assert rows == list(shop.table("products").rows)


def test_only_order_questions_compare_row_order():
    questions = make_questions(make_schemas(0))
    assert {q.family for q in questions if q.is_ordered} == {"order"}
    assert all(q.is_ordered for q in questions if q.family == "order")
