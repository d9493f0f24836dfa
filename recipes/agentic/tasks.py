"""Tasks in the shape of Harvey's Legal Agent Benchmark, generated offline from a seed.

Each task is a workspace of documents (contracts, board minutes, invoices)
built from templates with planted facts, an instruction, and the deliverable
the instruction asks for together with its expected content. Families, from
easiest to hardest:

- `termination_date`: one short contract; write its termination date to `answer.txt`.
  One fact, one fixed file, and the two calls spelled out in the instruction, so that
  SmolLM2-135M-Instruct can reach it and RL has signal.
- `contract_terms`: a contract and board minutes that mention other dates; write the
  termination date and the notice period to `answer.json`.
- `payments_over`: several invoices; list every invoice above a threshold in `payments.csv`.

Generation is a pure function of (seed, split, family, index): a task's own
`random.Random` is seeded with a string naming all four, so the same arguments give
the same task on every machine and Python run. Train and held-out tasks come from
disjoint index ranges, so no held-out task is ever trained on.
"""

from __future__ import annotations

import datetime as dt
import enum
import random
from collections.abc import Sequence

import msgspec


class Family(enum.StrEnum):
    TERMINATION_DATE = "termination_date"
    CONTRACT_TERMS = "contract_terms"
    PAYMENTS_OVER = "payments_over"


class Split(enum.StrEnum):
    TRAIN = "train"
    HELD_OUT = "held_out"


class TextAnswer(msgspec.Struct, frozen=True, tag="text"):
    """The file holds exactly `text` (surrounding whitespace ignored)."""

    text: str


class JsonAnswer(msgspec.Struct, frozen=True, tag="json"):
    """The file is a JSON object with these fields at these values (other fields ignored)."""

    fields: dict[str, str | int]


class CsvAnswer(msgspec.Struct, frozen=True, tag="csv"):
    """The file is a CSV with this header and exactly these rows, in any order."""

    header: list[str]
    rows: list[list[str]]


Expected = TextAnswer | JsonAnswer | CsvAnswer


class Task(msgspec.Struct, frozen=True):
    task_id: str  # "<split>/<family>/<index>"
    family: Family
    instruction: str
    documents: dict[str, str]  # path inside the workspace -> text
    deliverable: str  # path inside the scratch directory
    expected: Expected


# The planted facts' vocabulary. Party names are invented.
PARTIES = [
    "Alder Logistics Ltd", "Birchwood Analytics LLC", "Cobalt Marine Inc", "Dunmore Foods plc",
    "Elmstead Robotics GmbH", "Fairhaven Clinics LLP", "Granite Peak Mining Co", "Harbor Lane Textiles SA",
]
AGREEMENTS = ["Master Services Agreement", "Supply Agreement", "Software License Agreement", "Consulting Agreement"]
NOTICE_DAYS = [15, 30, 45, 60, 90]
# Held-out indices start here, far past any train index a run uses.
HELD_OUT_OFFSET = 1_000_000


def _date(rng: random.Random, start_year: int, end_year: int) -> dt.date:
    first = dt.date(start_year, 1, 1).toordinal()
    last = dt.date(end_year, 12, 31).toordinal()
    return dt.date.fromordinal(rng.randint(first, last))


def _two_parties(rng: random.Random) -> tuple[str, str]:
    a, b = rng.sample(PARTIES, 2)
    return a, b


def _contract(rng: random.Random, *, termination: dt.date, notice_days: int) -> str:
    client, vendor = _two_parties(rng)
    effective = termination - dt.timedelta(days=rng.randint(365, 3 * 365))
    return (
        f"{rng.choice(AGREEMENTS).upper()}\n"
        f"This agreement is made on {effective.isoformat()} between {client} (the Client) "
        f"and {vendor} (the Vendor).\n"
        f"1. Term. This agreement terminates on {termination.isoformat()}.\n"
        f"2. Notice. Either party may end it early on {notice_days} days' written notice.\n"
        f"3. Law. This agreement is governed by the laws of England and Wales.\n"
    )


def _termination_date(rng: random.Random) -> tuple[str, dict[str, str], str, Expected]:
    termination = _date(rng, 2026, 2031)
    contract = _contract(rng, termination=termination, notice_days=rng.choice(NOTICE_DAYS))
    # The calls are spelled out, so that finding the date is the whole task: at temperature 1
    # SmolLM2-135M wrote no tool call in 12 episodes given the tools one line each and an
    # example call (nor in 16 given the renderer's full JSON schemas).
    instruction = (
        "Read contract.txt and write its termination date to answer.txt, then call finish. First:\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "contract.txt"}}\n</tool_call>\n'
        "then, with the date you read in place of YYYY-MM-DD:\n"
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "YYYY-MM-DD"}}\n</tool_call>'
    )
    return instruction, {"contract.txt": contract}, "answer.txt", TextAnswer(text=termination.isoformat())


def _minutes(rng: random.Random, *, meeting: dt.date, renewal: dt.date) -> str:
    company = rng.choice(PARTIES)
    return (
        f"MINUTES OF THE BOARD OF DIRECTORS OF {company.upper()}\n"
        f"Held on {meeting.isoformat()}.\n"
        f"1. The board approved the annual budget.\n"
        f"2. The board noted that the office lease comes up for renewal on {renewal.isoformat()}.\n"
        f"3. There being no further business, the meeting closed.\n"
    )


def _contract_terms(rng: random.Random) -> tuple[str, dict[str, str], str, Expected]:
    termination = _date(rng, 2026, 2031)
    notice_days = rng.choice(NOTICE_DAYS)
    documents = {
        "contracts/agreement.txt": _contract(rng, termination=termination, notice_days=notice_days),
        # Distractor dates: the renewal date is not the termination date.
        "minutes/board-minutes.txt": _minutes(rng, meeting=_date(rng, 2024, 2025), renewal=_date(rng, 2026, 2031)),
    }
    instruction = (
        "The workspace holds an agreement and board minutes. Write answer.json with the agreement's "
        '"termination_date" (YYYY-MM-DD) and "notice_period_days" (an integer), then call finish.'
    )
    expected = JsonAnswer(fields={"termination_date": termination.isoformat(), "notice_period_days": notice_days})
    return instruction, documents, "answer.json", expected


def _invoice(number: str, issued: dt.date, payer: str, payee: str, amount: int) -> str:
    return (
        f"INVOICE {number}\n"
        f"Date: {issued.isoformat()}\n"
        f"From: {payee}\nTo: {payer}\n"
        f"Amount due: USD {amount}\n"
        f"Payment terms: 30 days.\n"
    )


def _payments_over(rng: random.Random) -> tuple[str, dict[str, str], str, Expected]:
    threshold = rng.choice([5_000, 10_000, 20_000])
    payer, payee = _two_parties(rng)
    documents: dict[str, str] = {}
    above: list[list[str]] = []
    for k in range(rng.randint(3, 6)):
        number = f"INV-{rng.randint(1000, 9999)}-{k}"
        # Never exactly the threshold: "above" must not hinge on reading > as >=.
        amount = rng.choice([rng.randint(threshold // 10, threshold - 1), rng.randint(threshold + 1, threshold * 3)])
        documents[f"invoices/{number.lower()}.txt"] = _invoice(number, _date(rng, 2025, 2026), payer, payee, amount)
        if amount > threshold:
            above.append([number, str(amount)])
    instruction = (
        f"List every invoice in invoices/ whose amount is above USD {threshold} in payments.csv, "
        "with the header invoice_id,amount and one row per invoice, then call finish."
    )
    return instruction, documents, "payments.csv", CsvAnswer(header=["invoice_id", "amount"], rows=above)


BUILDERS = {
    Family.TERMINATION_DATE: _termination_date,
    Family.CONTRACT_TERMS: _contract_terms,
    Family.PAYMENTS_OVER: _payments_over,
}


def make_task(seed: int, split: Split, family: Family, index: int) -> Task:
    """The task with this seed, split, family and index; the same every time."""
    absolute = index + (HELD_OUT_OFFSET if split is Split.HELD_OUT else 0)
    rng = random.Random(f"openrld-agentic:{seed}:{family.value}:{absolute}")
    instruction, documents, deliverable, expected = BUILDERS[family](rng)
    return Task(
        task_id=f"{split.value}/{family.value}/{index}", family=family, instruction=instruction,
        documents=documents, deliverable=deliverable, expected=expected,
    )


def make_tasks(seed: int, split: Split, families: Sequence[Family], count: int) -> list[Task]:
    """`count` tasks, the families taken in turn (index i has family i % len(families))."""
    return [make_task(seed, split, families[i % len(families)], i) for i in range(count)]
