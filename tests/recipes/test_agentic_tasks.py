"""Agentic task generation: deterministic from the seed, held-out apart from train, facts planted in the documents."""

from __future__ import annotations

import csv
import io

import msgspec

from recipes.agentic.tasks import CsvAnswer, Family, JsonAnswer, Split, TextAnswer, make_task, make_tasks

ALL = list(Family)


def test_the_same_seed_gives_byte_identical_tasks():
    first = msgspec.json.encode(make_tasks(7, Split.TRAIN, ALL, 30))
    again = msgspec.json.encode(make_tasks(7, Split.TRAIN, ALL, 30))
    assert first == again


def test_the_first_termination_date_task_of_seed_0_is_pinned():
    # Pinned so that a change in generation (and so in every recorded run) is seen.
    task = make_task(0, Split.TRAIN, Family.TERMINATION_DATE, 0)
    assert task.expected == TextAnswer(text="2027-07-22")
    assert list(task.documents) == ["contract.txt"]
    assert task.deliverable == "answer.txt"


def test_another_seed_gives_other_tasks():
    assert make_tasks(0, Split.TRAIN, ALL, 9) != make_tasks(1, Split.TRAIN, ALL, 9)


def test_held_out_tasks_share_no_id_and_no_workspace_with_train():
    train = make_tasks(0, Split.TRAIN, ALL, 300)
    held_out = make_tasks(0, Split.HELD_OUT, ALL, 30)
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}
    train_workspaces = {msgspec.json.encode(t.documents) for t in train}
    assert not [t.task_id for t in held_out if msgspec.json.encode(t.documents) in train_workspaces]


def test_families_are_taken_in_turn():
    assert [t.family for t in make_tasks(0, Split.TRAIN, ALL, 6)] == ALL + ALL


def test_the_termination_date_is_in_the_contract_and_other_dates_are_not_it():
    for task in make_tasks(3, Split.TRAIN, [Family.TERMINATION_DATE], 20):
        [contract] = task.documents.values()
        assert f"terminates on {task.expected.text}." in contract


def test_contract_terms_plant_both_fields_in_the_agreement():
    for task in make_tasks(3, Split.TRAIN, [Family.CONTRACT_TERMS], 20):
        assert isinstance(task.expected, JsonAnswer)
        agreement = task.documents["contracts/agreement.txt"]
        assert f"terminates on {task.expected.fields['termination_date']}." in agreement
        assert f"on {task.expected.fields['notice_period_days']} days' written notice" in agreement


def test_payment_rows_are_exactly_the_invoices_above_the_threshold():
    for task in make_tasks(3, Split.TRAIN, [Family.PAYMENTS_OVER], 20):
        assert isinstance(task.expected, CsvAnswer)
        threshold = int(task.instruction.split("above USD ")[1].split()[0])
        amounts = {}
        for text in task.documents.values():
            lines = text.splitlines()
            amounts[lines[0].removeprefix("INVOICE ")] = int(lines[4].removeprefix("Amount due: USD "))
        assert sorted(task.expected.rows) == sorted([k, str(v)] for k, v in amounts.items() if v > threshold)
        assert threshold not in amounts.values()
        # The expected rows round-trip through the csv module as the grader reads them.
        text = "invoice_id,amount\n" + "".join(f"{a},{b}\n" for a, b in task.expected.rows)
        assert list(csv.reader(io.StringIO(text)))[1:] == task.expected.rows
