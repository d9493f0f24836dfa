"""The client of bench/long_context.py: the real tinker SDK in a process of its own.

`python bench/_sdk_long_steps.py URL MODEL DAEMON_PID VOCAB STEPS TOKENS...` creates one LoRA
training client (rank 8) and, for each length, resets the daemon's peak RSS
(/proc/PID/clear_refs), runs STEPS SFT steps of one datum of that many tokens (forward_backward
with cross_entropy, then optim_step), and prints one JSON line: the last step's seconds and the
daemon's peak RSS since the reset (VmHWM). It never imports openrld.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import tinker
from tinker import types


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def main(url: str, model: str, pid: int, vocab: int, steps: int, lengths: list[int]) -> None:
    service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
    training = service.create_lora_training_client(base_model=model, rank=8)
    for tokens in lengths:
        ids = [(7 * i) % (vocab - 10) + 5 for i in range(tokens + 1)]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:]}
        )
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak RSS
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            training.forward_backward([datum], "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            seconds.append(time.perf_counter() - start)
        print(json.dumps({"tokens": tokens, "step_s": seconds[-1], "peak_bytes": peak_rss(pid)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), [int(n) for n in sys.argv[6:]])
