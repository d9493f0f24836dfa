"""The baseline of bench/long_prompt_sampling.py: Hugging Face `generate` over one long prompt, in a process of its own.

`python bench/_hf_long_prefill.py MODEL_DIR LENGTH` loads the model with transformers'
defaults, generates one token after a LENGTH-token prompt (the same prompt the sampler
gets) at temperature 1 (so the call is the prefill: one forward over the whole prompt),
and prints one JSON line: peak RSS after loading and after generating (VmHWM, MiB), and
the call's time. It never imports openrld.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import transformers


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main(model_dir: str, length: int) -> None:
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    load_mb = vm_hwm_mb()
    ids = torch.tensor([[(7 * i + 1) % 300 + 3 for i in range(length)]])
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(input_ids=ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        prefill_s = time.perf_counter() - start
    peak_mb = vm_hwm_mb()
    print(json.dumps({
        "load_mb": round(load_mb), "peak_mb": round(peak_mb), "request_mb": round(peak_mb - load_mb),
        "prefill_s": round(prefill_s, 2),
    }), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
