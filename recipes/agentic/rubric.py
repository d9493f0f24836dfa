"""Grading a deliverable against its task's rubric: exact checks, each worth the same.

The checks for each kind of expected answer:
- `TextAnswer`: the file exists; its stripped text equals the answer.
- `JsonAnswer`: the file is a JSON object; then one check per expected field, exact
  equality of value and type (the string "30" is not the integer 30).
- `CsvAnswer`: the file exists; its header is the expected header; its rows, as a set
  (order and duplicates ignored, cells stripped), equal the expected rows.

`score` is the fraction of checks passed, the reward; `success` is all of them,
the success rate the recipe reports. A file that was never written passes nothing.
"""

from __future__ import annotations

import csv
import io
import json

import msgspec

from recipes.agentic.tasks import CsvAnswer, Expected, JsonAnswer, TextAnswer


class Check(msgspec.Struct, frozen=True):
    name: str
    passed: bool


class Grade(msgspec.Struct, frozen=True):
    checks: list[Check]

    @property
    def score(self) -> float:
        return sum(c.passed for c in self.checks) / len(self.checks)

    @property
    def success(self) -> bool:
        return all(c.passed for c in self.checks)


def _grade_text(expected: TextAnswer, content: str | None) -> list[Check]:
    return [
        Check("file written", content is not None),
        Check("text equals the answer", content is not None and content.strip() == expected.text),
    ]


def _grade_json(expected: JsonAnswer, content: str | None) -> list[Check]:
    try:
        value = json.loads(content) if content is not None else None
    except json.JSONDecodeError:
        value = None
    found = value if isinstance(value, dict) else {}
    checks = [Check("a JSON object", isinstance(value, dict))]
    for field, want in expected.fields.items():
        got = found.get(field)
        checks.append(Check(f"field {field}", type(got) is type(want) and got == want))
    return checks


def _grade_csv(expected: CsvAnswer, content: str | None) -> list[Check]:
    rows = [[cell.strip() for cell in row] for row in csv.reader(io.StringIO(content or "")) if row]
    header, body = (rows[0], rows[1:]) if rows else ([], [])
    return [
        Check("file written", content is not None),
        Check("header", header == expected.header),
        Check("rows as a set", {tuple(r) for r in body} == {tuple(r) for r in expected.rows}),
    ]


def grade(expected: Expected, content: str | None) -> Grade:
    """Grade the deliverable's `content` (None: never written) against `expected`."""
    if isinstance(expected, TextAnswer):
        return Grade(_grade_text(expected, content))
    if isinstance(expected, JsonAnswer):
        return Grade(_grade_json(expected, content))
    return Grade(_grade_csv(expected, content))
