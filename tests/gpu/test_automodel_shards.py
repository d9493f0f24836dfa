"""The pure parts of the Automodel trainer, which run without its environment: which rows of a
sharded tensor each rank holds, the options a `Start` of kind "automodel_trainer" takes, and
the node settings the engine factory puts in it. The trainer itself is tested in its
environment, in test_automodel_trainer.py."""

from __future__ import annotations

import pytest
import torch

from openrld.errors import BadRequest
from openrld.gpu.automodel_shards import local_rows
from openrld.gpu.automodel_trainer import AutomodelOptions
from openrld.model_catalog import ModelEntry
from openrld.worker.builtin import _automodel_options
from openrld.worker.engines import TorchEngineFactory
from openrld.worker.hosting import WorkerHosting


@pytest.mark.parametrize(
    ("rows", "world", "expected"),
    [
        (8, 2, [(0, 4), (4, 8)]),
        (5, 3, [(0, 2), (2, 4), (4, 5)]),  # ceil(5/3) = 2 rows each, the last rank what is left
        (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)]),  # the last rank holds none
        (1, 2, [(0, 1), (1, 1)]),
    ],
    ids=["even", "uneven", "an-empty-rank", "one-row"],
)
def test_each_rank_holds_the_rows_torch_chunk_gives_it(rows, world, expected):
    assert [local_rows(rows, rank, world) for rank in range(world)] == expected
    chunks = torch.arange(rows).chunk(world)  # FSDP2's split of dim 0
    sizes = [len(chunk) for chunk in chunks] + [0] * (world - len(chunks))
    assert [stop - start for start, stop in expected] == sizes


def test_a_starts_options_become_the_trainers():
    options = {"fine_tuning": "full", "cp": 2, "weight_sync": "full", "max_batch_tokens": 4096, "activation_budget_bytes": 1}
    assert _automodel_options(options) == AutomodelOptions("full", 2, "full", 4096, activation_budget_bytes=1)
    assert _automodel_options({}) == AutomodelOptions()


def test_a_negative_activation_budget_is_refused_naming_it():
    from openrld.gpu.automodel_trainer import _check_options

    with pytest.raises(BadRequest, match=r"^activation_budget_bytes must be >= 0; got -1$") as refused:
        _check_options(AutomodelOptions(activation_budget_bytes=-1))
    assert refused.value.key == "activation_budget_bytes"


def test_an_unknown_option_is_refused_naming_it():
    with pytest.raises(BadRequest, match=r"^automodel_trainer has no option 'gpus'; it takes fine_tuning, cp, "):
        _automodel_options({"gpus": 2})


class StartRecorder(WorkerHosting):
    """Keeps the options a worker would be started with, and starts none (launching is the edge)."""

    def __init__(self) -> None:
        super().__init__(automodel_python="python")
        self.options: dict | None = None

    def start(self, launcher, **start):
        self.options = start["options"]


def test_the_nodes_trainer_settings_reach_the_automodel_trainers_start():
    hosting = StartRecorder()
    factory = TorchEngineFactory(torch.device("cpu"), max_batch_tokens=64, activation_budget_bytes=12345, hosting=hosting)
    model = ModelEntry(name="tiny-llama", directory="/models/tiny-llama", arch="llama", max_context=1024)
    factory.automodel_trainer(model, devices=("cpu:0", "cpu:1"), fine_tuning="lora", weight_sync="delta", cp=1)()
    assert hosting.options == {
        "max_batch_tokens": 64, "activation_budget_bytes": 12345, "fine_tuning": "lora", "cp": 1, "weight_sync": "delta",
    }
