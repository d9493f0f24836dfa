"""The recipe's SQLite databases: three small schemas, their rows drawn from a seed, written to files.

`shop` (customers, products, orders), `school` (students, courses,
enrollments) and `flights` (airports, flights). Rows come from a
`random.Random(seed)` and nothing else, so the same seed writes the same rows
in the same order; the questions (`questions.py`) are drawn from these rows.
Each schema also has a one-line-per-table description for prompts, shorter
than its CREATE statements because a 135M model's prompt should be spent on
the question.

This module writes files and never runs a query on behalf of a model: that is
`sandbox.py`'s job, in a process of its own.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import msgspec

FIRST_NAMES = ("Ana", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira", "Liam")
CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna")
CATEGORIES = ("toys", "books", "garden", "kitchen", "music")
PRODUCT_WORDS = ("lamp", "kite", "novel", "spade", "kettle", "drum", "puzzle", "atlas", "rake", "whisk", "flute")
SUBJECTS = ("math", "history", "art", "biology", "music", "chemistry")
TEACHERS = ("Ms Reed", "Mr Okafor", "Ms Lind", "Mr Silva")
AIRPORTS = (("CDG", "Paris", "France"), ("BER", "Berlin", "Germany"), ("MAD", "Madrid", "Spain"),
            ("FCO", "Rome", "Italy"), ("LIS", "Lisbon", "Portugal"), ("VIE", "Vienna", "Austria"))
AIRLINES = ("Skyway", "Blue Air", "Nordjet", "Sunwing")


class Table(msgspec.Struct, frozen=True):
    name: str
    columns: tuple[str, ...]  # "name TYPE", in CREATE order
    rows: tuple[tuple[int | float | str, ...], ...]

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.split()[0] for c in self.columns)


class Schema(msgspec.Struct, frozen=True):
    name: str
    tables: tuple[Table, ...]

    def table(self, name: str) -> Table:
        return next(t for t in self.tables if t.name == name)

    def prompt_text(self) -> str:
        """One line per table, e.g. `products(id, name, category, price)`."""
        return "\n".join(f"{t.name}({', '.join(t.column_names)})" for t in self.tables)


def _shop(rng: random.Random) -> Schema:
    customers = tuple((i, f"{rng.choice(FIRST_NAMES)} {chr(65 + i % 26)}.", rng.choice(CITIES)) for i in range(1, 21))
    # Distinct prices, so that "the k most expensive" has one answer.
    prices = rng.sample(range(3, 120), 25)
    products = tuple(
        (i, f"{rng.choice(PRODUCT_WORDS)} {i}", rng.choice(CATEGORIES), float(price))
        for i, price in enumerate(prices, start=1)
    )
    orders = tuple(
        (i, rng.randint(1, len(customers)), rng.randint(1, len(products)), rng.randint(1, 5),
         f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}")
        for i in range(1, 61)
    )
    return Schema("shop", (
        Table("customers", ("id INTEGER PRIMARY KEY", "name TEXT", "city TEXT"), customers),
        Table("products", ("id INTEGER PRIMARY KEY", "name TEXT", "category TEXT", "price REAL"), products),
        Table("orders", ("id INTEGER PRIMARY KEY", "customer_id INTEGER", "product_id INTEGER", "quantity INTEGER",
                         "order_date TEXT"), orders),
    ))


def _school(rng: random.Random) -> Schema:
    students = tuple((i, f"{rng.choice(FIRST_NAMES)} {chr(65 + i % 26)}.", rng.randint(9, 12), rng.choice(CITIES))
                     for i in range(1, 25))
    courses = tuple((i, subject, rng.choice(TEACHERS)) for i, subject in enumerate(SUBJECTS, start=1))
    pairs = sorted({(rng.randint(1, len(students)), rng.randint(1, len(courses))) for _ in range(60)})
    enrollments = tuple((s, c, rng.randint(40, 100)) for s, c in pairs)
    return Schema("school", (
        Table("students", ("id INTEGER PRIMARY KEY", "name TEXT", "grade INTEGER", "city TEXT"), students),
        Table("courses", ("id INTEGER PRIMARY KEY", "title TEXT", "teacher TEXT"), courses),
        Table("enrollments", ("student_id INTEGER", "course_id INTEGER", "score INTEGER"), enrollments),
    ))


def _flights(rng: random.Random) -> Schema:
    codes = [a[0] for a in AIRPORTS]
    distances = rng.sample(range(300, 2500), 40)  # distinct, so that "the k longest" has one answer
    flights = []
    for i, distance in enumerate(distances, start=1):
        origin, destination = rng.sample(codes, 2)
        flights.append((i, origin, destination, rng.choice(AIRLINES), distance, rng.randint(5, 22)))
    return Schema("flights", (
        Table("airports", ("code TEXT PRIMARY KEY", "city TEXT", "country TEXT"), AIRPORTS),
        Table("flights", ("id INTEGER PRIMARY KEY", "origin TEXT", "destination TEXT", "airline TEXT",
                          "distance_km INTEGER", "departure_hour INTEGER"), tuple(flights)),
    ))


def make_schemas(seed: int) -> tuple[Schema, ...]:
    """The three schemas with their rows; each draws from its own stream, so one's size never shifts another's."""
    return tuple(build(random.Random(f"{seed}:{build.__name__}")) for build in (_shop, _school, _flights))


def write_database(schema: Schema, directory: Path) -> Path:
    """Write `schema` as `<directory>/<name>.sqlite` (replacing any older file); returns the path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{schema.name}.sqlite"
    path.unlink(missing_ok=True)
    with sqlite3.connect(path) as connection:
        for table in schema.tables:
            connection.execute(f"CREATE TABLE {table.name} ({', '.join(table.columns)})")
            marks = ", ".join("?" * len(table.columns))
            connection.executemany(f"INSERT INTO {table.name} VALUES ({marks})", table.rows)
    connection.close()
    return path


def write_databases(schemas: tuple[Schema, ...], directory: Path) -> dict[str, Path]:
    """Every schema's file under `directory`, by schema name."""
    return {schema.name: write_database(schema, directory) for schema in schemas}
