"""What tinker-cookbook's own training loop needs to run offline, for the recipes built on it.

The cookbook loads a model's tokenizer by its Hugging Face name, from the Hub,
which an offline machine cannot reach; so the model's local tokenizer (a
directory, or the packaged SmolLM2 GGUF's) is registered under that name first
(`tokenizer_utils.register_tokenizer`). It reads the API key from
`TINKER_API_KEY` alone, so the recipes set that. Nothing here is specific to
openrld: any Tinker service will do.
"""

from __future__ import annotations

import os

# Resolved here, at import, in the main thread: transformers resolves its names lazily, and a
# sweep's job threads reaching `transformers.AutoTokenizer` first at once failed with an
# AttributeError in all but one of them.
from transformers import AutoTokenizer  # noqa: F401
from tinker_cookbook import tokenizer_utils

from recipes.quickstart.train import load_tokenizer


def prepare_cookbook(base_model: str, tokenizer_dir: str | None, api_key: str):
    """Register `base_model`'s local tokenizer for the cookbook and set its API key; returns the
    tokenizer, or None when there is no local one (the cookbook then asks the Hub)."""
    os.environ["TINKER_API_KEY"] = api_key
    from openrld.model_catalog import find_packaged_gguf

    if tokenizer_dir is None and find_packaged_gguf(base_model) is None:
        return None
    tokenizer = load_tokenizer(None, base_model, tokenizer_dir)  # the training client is needed only without both
    tokenizer_utils.register_tokenizer(base_model, lambda: tokenizer)
    return tokenizer
