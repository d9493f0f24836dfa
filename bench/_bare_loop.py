"""The baseline of the throughput benches: the loop a researcher writes with transformers and peft,
in a process of its own.

`python bench/_bare_loop.py MODEL_DIR` loads the model with transformers' defaults (no dtype,
thread or attention setting: the checkpoint's float32, torch's own thread count and wait
policy), adds a LoRA with peft (rank 8, alpha 32 as Tinker's, no dropout) on the attention and
MLP projections and lm_head, and makes torch.optim.AdamW (the SDK's betas and eps, otherwise
torch's defaults) over the LoRA's weights. Then it answers requests (bench/_lines.py):

- sft_steps {rows, tokens, count}: that many SFT steps on the rows of `_workload.batch_tokens`:
  forward, summed cross-entropy (`F.cross_entropy(..., reduction="sum")`), backward, AdamW;
  their seconds;
- sample: `model.generate` of 8 x 32 tokens from `_workload.prompt` at temperature 1, do_sample,
  exactly 32 new tokens each, with the scores for the sampling logprobs; its seconds;
- rl_iteration: that sample, then an importance-sampling step on the 8 sequences (advantages
  spread over [-1, 1]) and AdamW; its seconds.

It never imports openrld, not even through a helper.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import peft
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _lines import serve
from _workload import ADAM_BETAS, ADAM_EPS, LR, PROMPT_TOKENS, RANK, batch_tokens, prompt

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
SAMPLES, NEW_TOKENS = 8, 32  # rl_throughput.py's sample


class BareLoop:
    """One peft model that trains and generates, no server."""

    def __init__(self, model_dir: str | Path) -> None:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
        self.vocab = model.config.vocab_size
        config = peft.LoraConfig(r=RANK, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
        self.model = peft.get_peft_model(model, config)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)
        self.prompt = torch.tensor([prompt(self.vocab)])  # (1, PROMPT_TOKENS)

    def _step(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def steps(self, batch: int, seq_len: int, count: int) -> list[float]:
        """Seconds of each of `count` SFT steps on a (batch, seq_len) batch."""
        tokens = torch.from_numpy(batch_tokens(batch, seq_len, self.vocab))
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        times = []
        for _ in range(count):
            start = time.perf_counter()
            logits = self.model(input_ids=inputs).logits  # (B, T, V)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
            self._step(loss)
            times.append(time.perf_counter() - start)
        return times

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(8, 32) sampled tokens and their logprobs under the sampling distribution."""
        ids = self.prompt.expand(SAMPLES, -1)
        with torch.no_grad():  # not inference_mode: the RL step trains on these tensors
            out = self.model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[:, PROMPT_TOKENS:]  # (8, 32)
        scores = torch.stack(out.scores, dim=1).float()  # (8, 32, V), processed logits at T=1
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        return new, logprobs

    def rl_iteration(self) -> None:
        new, sampling_logprobs = self.sample()
        sequences = torch.cat([self.prompt.expand(SAMPLES, -1), new], dim=1)
        advantages = torch.linspace(-1.0, 1.0, SAMPLES).unsqueeze(1)  # (8, 1)
        logits = self.model(input_ids=sequences[:, :-1]).logits.float()[:, PROMPT_TOKENS - 1:]  # (8, 32, V)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        self._step(-(torch.exp(logprobs - sampling_logprobs) * advantages).sum())


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(model_dir: str) -> None:
    loop = BareLoop(model_dir)
    serve({
        "sft_steps": lambda rows, tokens, count: loop.steps(rows, tokens, count),
        "sample": lambda: seconds(loop.sample),
        "rl_iteration": lambda: seconds(loop.rl_iteration),
    })


if __name__ == "__main__":
    main(sys.argv[1])
