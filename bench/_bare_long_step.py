"""The baseline of bench/long_context.py: one long datum's SFT step as a researcher writes it, in a process of its own.

`python bench/_bare_long_step.py MODEL_DIR TOKENS` loads the model with transformers'
defaults (the checkpoint's float32, torch's threads, no attention or checkpointing
setting), adds a LoRA of rank 8 with peft on the attention and MLP projections and
lm_head (alpha 32, as Tinker's), and runs two steps on one datum of TOKENS tokens:
`model(input_ids, labels=...)` (transformers' own summed loss over full logits),
backward, AdamW. It prints one JSON line: the second step's seconds and the process's
peak RSS. It never imports openrld.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import peft
import torch
import transformers


def main(model_dir: str, tokens: int) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    config = peft.LoraConfig(
        r=8, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"],
    )
    model = peft.get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    vocab = model.config.get_text_config().vocab_size
    ids = (torch.arange(tokens) * 7 % (vocab - 10) + 5)[None]  # the client's ids (bench/_sdk_long_steps.py)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss * (tokens - 1)  # summed, as Tinker's cross_entropy
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"step_s": seconds[-1], "peak_bytes": peak}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
