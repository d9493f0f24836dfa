"""An example custom trainer: openrld's LoRA trainer, with a log line of its own per step.

It shows the shape every custom trainer has (docs/custom-images.md): a class built on
`openrld.worker.base.TrainerWorker`, made from the daemon's `Start`, and `serve`,
which connects to the daemon's socket, says hello, builds the engine and answers
calls until the daemon says Bye. A trainer of your own replaces the engine below
with your framework's, and keeps the methods' types (openrld.batches).

Here each call goes to openrld's own `TorchTrainer`, so a job trains exactly as it
would on the built-in trainer; the log line (`custom-trainer: ...`, on stderr, which
the container runtime keeps: `podman logs <container>`) is what is custom.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import torch

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, LoraSpec, OptimParams, OptimResult
from openrld.engine_types import WeightPayload
from openrld.errors import NotSupportedYet
from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig
from openrld.worker import base, server
from openrld.worker.protocol import Start

logger = logging.getLogger("custom-trainer")


class LoggedLoraTrainer(base.TrainerWorker):
    """LoRA only: a full fine-tuning job (Start.kind "full_trainer") is refused at build."""

    def __init__(self, start: Start) -> None:
        if start.kind != "lora_trainer":
            raise NotSupportedYet(f"this image trains LoRA adapters only; the daemon asked for {start.kind}")
        if start.threads:
            torch.set_num_threads(start.threads)
        config = TrainerConfig(max_batch_tokens=int(start.options.get("max_batch_tokens", 8192)))
        # start.device is the device as this container sees it: "cpu", or "cuda:0" (its one GPU).
        self.engine = TorchTrainer(Path(start.model_dir), torch.device(start.device), config=config)
        logger.info("custom-trainer: ready model=%s device=%s", start.model_dir, start.device)

    def add_adapter(self, name: str, spec: LoraSpec | None, optimizer: str) -> None:
        self.engine.add_adapter(name, spec, optimizer)

    def drop_adapter(self, name: str) -> None:
        self.engine.drop_adapter(name)

    def has_adapter(self, name: str) -> bool:
        return self.engine.has_adapter(name)

    def forward_backward(self, name: str, batch: ForwardBackwardBatch) -> ForwardBackwardResult:
        return self.forward_backward_many(name, [batch])[0]

    def forward_backward_many(self, name: str, batches: list[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        results = self.engine.forward_backward_many(name, batches)
        tokens = sum(len(datum.tokens) for batch in batches for datum in batch.data)
        logger.info("custom-trainer: forward_backward adapter=%s batches=%d tokens=%d metrics=%s",
                    name, len(batches), tokens, [result.metrics for result in results])
        return results

    def optim_step(self, name: str, params: OptimParams) -> OptimResult:
        result = self.engine.optim_step(name, params)
        logger.info("custom-trainer: optim_step adapter=%s metrics=%s", name, result.metrics)
        return result

    def sampler_payload(self, name: str, version: str) -> WeightPayload:
        return self.engine.sampler_payload(name, version)

    def adapter_tensors(self, name: str) -> WeightPayload:
        return self.engine.adapter_tensors(name)

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        return self.engine.export_adapter(name, directory, base_model)

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        return self.engine.sampler_checkpoint(name, directory)

    def save_state(self, name: str, directory: Path, with_optimizer: bool) -> int:
        return self.engine.save_state(name, directory, with_optimizer)

    def load_state(self, name: str, directory: Path, spec: LoraSpec | None, with_optimizer: bool, optimizer: str) -> None:
        self.engine.load_state(name, directory, spec, with_optimizer, optimizer)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    server.serve(LoggedLoraTrainer, role="trainer", engine="custom-trainer-example:1")
