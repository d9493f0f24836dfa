"""The baseline of bench/gemma3_sampling.py: Hugging Face `generate` as a researcher runs it, in a process of its own.

`python bench/_hf_generate.py MODEL_DIR` loads the model with transformers' defaults
(no dtype, thread or attention setting: the converted checkpoint's float32, torch's
thread count) and prints "ready". Then each line it reads is a JSON request
{"prompt": [ids], "batch": B, "new_tokens": N}; it samples B continuations of the
prompt at temperature 1 with the KV cache, exactly N new tokens each (no EOS ends
one early), and prints {"tokens_per_s": ...}. It never imports openrld.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import transformers


def main(model_dir: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        batch, new = request["batch"], request["new_tokens"]
        ids = torch.tensor([request["prompt"]] * batch)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new, min_new_tokens=new,
            )
        seconds = time.perf_counter() - start
        assert out.shape == (batch, ids.shape[1] + new), out.shape
        print(json.dumps({"tokens_per_s": batch * new / seconds}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
