"""The scripted expert: it solves every train task of the families it covers, from what the tools show it.

The decision tests feed `next_call` the tools' answers as the documents give them
(read_file prints a file whole, list_files one path a line, write_file says what it
wrote), for every train task the recipe draws by default; the rubric then grades
what it wrote. The episodes it plays through the recipe's own Env, renderer and
bubblewrap sandbox are in test_agentic_warm_start.py.
"""

from __future__ import annotations

import pytest

from recipes.agentic import rubric
from recipes.agentic.expert import COVERED, ExpertCompleter, ToolCall, call_text, next_call, tool_outputs
from recipes.agentic.tasks import Family, Split, Task, make_tasks
from recipes.agentic.train import AgenticConfig

TRAIN_TASKS = AgenticConfig(base_url="").train_tasks  # the train tasks a run draws by default (200)


def _answer(task: Task, call: ToolCall, written: dict[str, str]) -> str:
    """What the tool answers to `call` in `task`'s workspace (tools.WorkspaceTools' text)."""
    if call.name == "list_files":
        return "\n".join(sorted(task.documents))
    if call.name == "read_file":
        return task.documents.get(call.arguments["path"], "error: sed: can't read the file")
    assert call.name == "write_file", call
    written[call.arguments["path"]] = call.arguments["content"]
    return f"wrote {len(call.arguments['content'].encode())} bytes to /scratch/{call.arguments['path']}"


def _play(task: Task, max_turns: int) -> tuple[list[ToolCall], str | None]:
    """The expert's calls on `task` until it finishes (or `max_turns`), and the deliverable it left."""
    outputs: list[str] = []
    calls: list[ToolCall] = []
    written: dict[str, str] = {}
    while len(calls) < max_turns:
        calls.append(next_call(task.family, outputs))
        if calls[-1].name == "finish":
            break
        outputs.append(_answer(task, calls[-1], written))
    return calls, written.get(task.deliverable)


@pytest.mark.parametrize("family", COVERED, ids=[f.value for f in COVERED])
def test_the_expert_solves_every_train_task_of_its_family_within_the_recipe_s_turns(family: Family):
    tasks = make_tasks(0, Split.TRAIN, [family], TRAIN_TASKS)
    graded = {task.task_id: rubric.grade(task.expected, _play(task, AgenticConfig(base_url="").max_turns)[1])
              for task in tasks}
    assert [task_id for task_id, grade in graded.items() if not grade.success] == []


def test_on_contract_terms_it_lists_reads_the_agreement_writes_and_finishes():
    [task] = make_tasks(0, Split.TRAIN, [Family.CONTRACT_TERMS], 1)
    calls, content = _play(task, 10)
    assert [c.name for c in calls] == ["list_files", "read_file", "write_file", "finish"]
    assert calls[1].arguments == {"path": "contracts/agreement.txt"}  # not the board minutes
    # Train task 0 of seed 0: the agreement's own date and notice, not the minutes' renewal date.
    assert content == '{"termination_date": "2029-06-10", "notice_period_days": 30}'


def test_it_never_reads_the_expected_answer():
    # The same workspace with another date planted: the expert writes what the documents say.
    [task] = make_tasks(0, Split.TRAIN, [Family.TERMINATION_DATE], 1)
    altered = Task(task.task_id, task.family, task.instruction,
                   {"contract.txt": task.documents["contract.txt"].replace("2027-07-22", "2030-01-02")},
                   task.deliverable, task.expected)
    assert _play(altered, 10)[1] == "2030-01-02"


def test_a_family_it_does_not_cover_is_refused():
    with pytest.raises(ValueError, match="not payments_over"):
        next_call(Family.PAYMENTS_OVER, [])


def test_a_call_is_written_as_the_renderer_writes_one():
    assert call_text(ToolCall("read_file", {"path": "contract.txt"})) == \
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "contract.txt"}}\n</tool_call>'


def test_the_tools_answers_are_read_out_of_a_rendered_conversation():
    rendered = ("<|im_start|>system\nCall read_file on contract.txt<|im_end|>\n<|im_start|>user\n<tool_response>\n"
                "a.txt\nb.txt\n</tool_response><|im_end|>\n<|im_start|>user\n<tool_response>\nwrote 3 bytes to "
                "/scratch/x\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert tool_outputs(rendered) == ["a.txt\nb.txt", "wrote 3 bytes to /scratch/x"]


def test_the_expert_completer_refuses_a_family_it_does_not_cover():
    with pytest.raises(ValueError, match="not payments_over"):
        ExpertCompleter(Family.PAYMENTS_OVER, renderer=None)  # type: ignore[arg-type]
