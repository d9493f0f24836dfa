"""Questions with their gold SQL, drawn from the databases' rows, and the train/held-out split.

Four families, easiest first:
- `filter`: one table, one condition, asking for whole rows ("Show all
  customers who live in Paris.": SELECT *), one column ("List the names of
  customers who live in Paris.") or a count. Greedy SmolLM2-135M-Instruct gets
  about a quarter of them right before training (mostly the one-column form
  over a column named in the question); it writes out invented column lists
  for whole rows and filters on made-up ids, which RL has to unlearn. Each
  template is asked of every value, so held-out questions share their
  templates with train questions, and the held-out set is large enough
  for the sweep's paired test (half of the family: 64 questions at seed 0).
- `join`: two or three tables joined on their keys.
- `group`: GROUP BY, with COUNT/AVG/SUM or HAVING.
- `order`: ORDER BY with LIMIT ("the 3 most expensive products, most
  expensive first"); the only family where row order is part of the answer.

Values in the questions are taken from the rows (a city only where someone
lives, a price bound only where a product lies beyond it), so every gold
query returns rows, whatever the seed. The split is stratified: each family
gives `heldout_fraction` of its questions (rounded up) to the held-out set,
after a seeded shuffle. Pure functions of the schemas and the seed; no I/O.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import msgspec

from recipes.sql.databases import AIRLINES, CATEGORIES, CITIES, SUBJECTS, Schema

FAMILIES = ("filter", "join", "group", "order")


class Question(msgspec.Struct, frozen=True):
    id: str  # "<schema>/<family>/<n>", stable for a seed
    schema: str  # the database it is asked of
    family: str  # one of FAMILIES
    text: str
    gold_sql: str

    @property
    def is_ordered(self) -> bool:
        """Whether row order is part of the answer: only when the gold query orders its rows."""
        return "ORDER BY" in self.gold_sql.upper()


class QuestionSplit(msgspec.Struct, frozen=True):
    train: tuple[Question, ...]
    heldout: tuple[Question, ...]


def _shop(schema: Schema) -> Iterator[tuple[str, str, str]]:
    customer_cities = {row[2] for row in schema.table("customers").rows}
    for city in (c for c in CITIES if c in customer_cities):
        yield "filter", f"Show all customers who live in {city}.", f"SELECT * FROM customers WHERE city = '{city}'"
        yield "filter", f"List the names of customers who live in {city}.", \
            f"SELECT name FROM customers WHERE city = '{city}'"
        yield "filter", f"How many customers live in {city}?", f"SELECT COUNT(*) FROM customers WHERE city = '{city}'"
    for category in CATEGORIES:
        yield "filter", f"Show all products in the category '{category}'.", \
            f"SELECT * FROM products WHERE category = '{category}'"
        yield "filter", f"List the names of products in the category '{category}'.", \
            f"SELECT name FROM products WHERE category = '{category}'"
    for category in CATEGORIES:
        yield "filter", f"How many products are in the category '{category}'?", \
            f"SELECT COUNT(*) FROM products WHERE category = '{category}'"
    prices = [row[3] for row in schema.table("products").rows]
    for price in range(20, 101, 10):
        if max(prices) > price:
            yield "filter", f"List the names of products that cost more than {price}.", \
                f"SELECT name FROM products WHERE price > {price}"
        if min(prices) < price:
            yield "filter", f"List the names of products that cost less than {price}.", \
                f"SELECT name FROM products WHERE price < {price}"
    ordered_products = {row[2] for row in schema.table("orders").rows}
    ordering_customers = {row[1] for row in schema.table("orders").rows}
    for pid, name, _category, _price in schema.table("products").rows:
        if pid in ordered_products:
            yield "join", f"List the names of customers who ordered the product '{name}'.", (
                "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
                f"JOIN products p ON p.id = o.product_id WHERE p.name = '{name}'")
    for cid, name, _city in schema.table("customers").rows:
        if cid in ordering_customers:
            yield "join", f"List the names of products ordered by the customer '{name}'.", (
                "SELECT DISTINCT p.name FROM products p JOIN orders o ON o.product_id = p.id "
                f"JOIN customers c ON c.id = o.customer_id WHERE c.name = '{name}'")
    yield "group", "For each city, how many customers live there?", \
        "SELECT city, COUNT(*) FROM customers GROUP BY city"
    yield "group", "For each category, how many products are there?", \
        "SELECT category, COUNT(*) FROM products GROUP BY category"
    yield "group", "What is the average price of the products in each category?", \
        "SELECT category, AVG(price) FROM products GROUP BY category"
    yield "group", "For each product id, what is the total quantity ordered?", \
        "SELECT product_id, SUM(quantity) FROM orders GROUP BY product_id"
    for k in range(1, 6):
        yield "order", f"List the names of the {k} most expensive products, most expensive first.", \
            f"SELECT name FROM products ORDER BY price DESC LIMIT {k}"
        yield "order", f"List the names of the {k} cheapest products, cheapest first.", \
            f"SELECT name FROM products ORDER BY price ASC LIMIT {k}"


def _school(schema: Schema) -> Iterator[tuple[str, str, str]]:
    for grade in range(9, 13):
        yield "filter", f"Show all students in grade {grade}.", f"SELECT * FROM students WHERE grade = {grade}"
        yield "filter", f"List the names of students in grade {grade}.", \
            f"SELECT name FROM students WHERE grade = {grade}"
        yield "filter", f"How many students are in grade {grade}?", \
            f"SELECT COUNT(*) FROM students WHERE grade = {grade}"
    student_cities = {row[3] for row in schema.table("students").rows}
    for city in (c for c in CITIES if c in student_cities):
        yield "filter", f"Show all students who live in {city}.", f"SELECT * FROM students WHERE city = '{city}'"
        yield "filter", f"List the names of students who live in {city}.", \
            f"SELECT name FROM students WHERE city = '{city}'"
        yield "filter", f"How many students live in {city}?", f"SELECT COUNT(*) FROM students WHERE city = '{city}'"
    for teacher in sorted({row[2] for row in schema.table("courses").rows}):
        yield "filter", f"List the titles of the courses taught by {teacher}.", \
            f"SELECT title FROM courses WHERE teacher = '{teacher}'"
    for subject in SUBJECTS:
        yield "filter", f"Which teacher teaches the course '{subject}'?", \
            f"SELECT teacher FROM courses WHERE title = '{subject}'"
        yield "join", f"List the names of students enrolled in the course '{subject}'.", (
            "SELECT s.name FROM students s JOIN enrollments e ON e.student_id = s.id "
            f"JOIN courses c ON c.id = e.course_id WHERE c.title = '{subject}'")
    yield "group", "For each grade, how many students are there?", \
        "SELECT grade, COUNT(*) FROM students GROUP BY grade"
    yield "group", "For each course id, what is the average score?", \
        "SELECT course_id, AVG(score) FROM enrollments GROUP BY course_id"
    yield "group", "For each teacher, how many courses do they teach?", \
        "SELECT teacher, COUNT(*) FROM courses GROUP BY teacher"


def _flights(schema: Schema) -> Iterator[tuple[str, str, str]]:
    for airline in AIRLINES:
        yield "filter", f"Show all flights operated by {airline}.", f"SELECT * FROM flights WHERE airline = '{airline}'"
        yield "filter", f"List the ids of flights operated by {airline}.", \
            f"SELECT id FROM flights WHERE airline = '{airline}'"
        yield "filter", f"How many flights does {airline} operate?", \
            f"SELECT COUNT(*) FROM flights WHERE airline = '{airline}'"
    for code, city, _country in schema.table("airports").rows:
        yield "filter", f"Show all flights that depart from {code}.", f"SELECT * FROM flights WHERE origin = '{code}'"
        yield "filter", f"List the ids of flights that depart from {code}.", \
            f"SELECT id FROM flights WHERE origin = '{code}'"
        yield "filter", f"How many flights depart from {code}?", f"SELECT COUNT(*) FROM flights WHERE origin = '{code}'"
        yield "filter", f"List the ids of flights that arrive at {code}.", \
            f"SELECT id FROM flights WHERE destination = '{code}'"
        yield "join", f"List the ids of flights that arrive in the city {city}.", \
            f"SELECT f.id FROM flights f JOIN airports a ON a.code = f.destination WHERE a.city = '{city}'"
    yield "group", "For each airline, how many flights does it operate?", \
        "SELECT airline, COUNT(*) FROM flights GROUP BY airline"
    yield "group", "For each origin airport, what is the average flight distance?", \
        "SELECT origin, AVG(distance_km) FROM flights GROUP BY origin"
    for n in (8, 10):
        yield "group", f"Which airlines operate more than {n} flights?", \
            f"SELECT airline FROM flights GROUP BY airline HAVING COUNT(*) > {n}"
    for k in range(1, 6):
        yield "order", f"List the ids of the {k} longest flights, longest first.", \
            f"SELECT id FROM flights ORDER BY distance_km DESC LIMIT {k}"
        yield "order", f"List the ids of the {k} shortest flights, shortest first.", \
            f"SELECT id FROM flights ORDER BY distance_km ASC LIMIT {k}"


TEMPLATES = {"shop": _shop, "school": _school, "flights": _flights}


def make_questions(schemas: tuple[Schema, ...]) -> list[Question]:
    """Every question of every schema, in template order, each with its stable id."""
    questions: list[Question] = []
    for schema in schemas:
        counts: dict[str, int] = {}
        for family, text, gold in TEMPLATES[schema.name](schema):
            n = counts.get(family, 0)
            counts[family] = n + 1
            questions.append(Question(f"{schema.name}/{family}/{n}", schema.name, family, text, gold))
    return questions


def split_questions(
    questions: list[Question], seed: int, *, heldout_fraction: float = 0.25, families: tuple[str, ...] = FAMILIES,
) -> QuestionSplit:
    """A seeded, per-family split of `questions` (only those in `families`) into train and held-out."""
    rng = random.Random(f"{seed}:split")
    train: list[Question] = []
    heldout: list[Question] = []
    for family in families:
        members = [q for q in questions if q.family == family]
        rng.shuffle(members)
        n_heldout = math.ceil(len(members) * heldout_fraction)
        heldout += members[:n_heldout]
        train += members[n_heldout:]
    return QuestionSplit(train=tuple(train), heldout=tuple(sorted(heldout, key=lambda q: q.id)))
