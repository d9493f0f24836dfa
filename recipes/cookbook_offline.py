"""What tinker-cookbook's own training loop needs to run offline, for the recipes built on it,
and what the recipes pass it and read back from it alike.

The cookbook loads a model's tokenizer by its Hugging Face name, from the Hub,
which an offline machine cannot reach; so the model's local tokenizer (a
directory, or the packaged SmolLM2 GGUF's) is registered under that name first
(`tokenizer_utils.register_tokenizer`). It reads the API key from
`TINKER_API_KEY` alone, so the recipes set that. Nothing here is specific to
openrld: any Tinker service will do.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import chz
import msgspec
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.eval.evaluators import SamplingClientEvaluator
from tinker_cookbook.rl import train as cookbook_train
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder

# Resolved here, at import, in the main thread: transformers resolves its names lazily, and a
# sweep's job threads reaching `transformers.AutoTokenizer` first at once failed with an
# AttributeError in all but one of them.
from transformers import AutoTokenizer  # noqa: F401

from recipes.quickstart.train import load_tokenizer

# A sweep's jobs start in threads at once; loading a GGUF tokenizer imports transformers' gguf
# module, and two first imports at once left one thread a half-made module (an ImportError). So
# one thread loads, the others wait and share the tokenizer.
_loading = threading.Lock()
_loaded: dict[tuple[str, str | None], object] = {}


# The cookbook loop's RL losses the recipes offer, each a loss the service runs.
LOSSES = ("importance_sampling", "ppo", "cispo")


def prepare_cookbook(base_model: str, tokenizer_dir: str | None, api_key: str):
    """Register `base_model`'s local tokenizer for the cookbook and set its API key; returns the
    tokenizer, or None when there is no local one (the cookbook then asks the Hub)."""
    os.environ["TINKER_API_KEY"] = api_key
    from openrld.model_catalog import is_packaged

    if tokenizer_dir is None and not is_packaged(base_model):
        return None
    with _loading:
        key = (base_model, tokenizer_dir)
        if key not in _loaded:
            # The training client is needed only without both a directory and a packaged GGUF.
            _loaded[key] = load_tokenizer(None, base_model, tokenizer_dir)
            tokenizer = _loaded[key]
            tokenizer_utils.register_tokenizer(base_model, lambda: tokenizer)
        return _loaded[key]


@chz.chz
class PrebuiltDatasetBuilder(RLDatasetBuilder):
    """Hands the cookbook a dataset built beforehand: the recipes' group builders hold what the
    cookbook's thunks cannot (a renderer, a grader, a sandbox factory)."""

    dataset: RLDataset

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        return self.dataset, None


def cookbook_config(
    dataset: RLDataset, evaluator: SamplingClientEvaluator, log_dir: Path, *, steps: int, **settings: Any
) -> cookbook_train.Config:
    """The cookbook loop's config for `steps` steps over `dataset`, evaluated by `evaluator` every
    `eval_every` steps; `settings` are the recipe's own (learning_rate, model_name, loss_fn, ...).
    No checkpoints of the loop's own and no rollout logs: the recipes keep their own records."""
    return cookbook_train.Config(
        dataset_builder=PrebuiltDatasetBuilder(dataset=dataset), log_path=str(log_dir), save_every=0,
        evaluator_builders=[lambda: evaluator], remove_constant_reward_groups=True, num_groups_to_log=0,
        rollout_json_export=False, max_steps=steps, num_epochs=max(1, math.ceil(steps / len(dataset))), **settings,
    )


def rollout_rows(metrics_path: Path) -> Iterator[dict[str, Any]]:
    """The rows of the loop's `metrics.jsonl` that report a training step's rollouts."""
    for line in metrics_path.read_text().splitlines():
        row = msgspec.json.decode(line)
        if "env/all/reward/total" in row:
            yield row
