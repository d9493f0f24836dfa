"""Builders of the torch engines for a model on a device, handed to the actors.

The actors never import torch; the daemon gives them this factory, whose
builders run in the actor's worker thread and return a ready engine.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from openrld.model_catalog import ModelEntry


class TorchEngineFactory:
    def __init__(self, device: torch.device, *, max_batch_tokens: int) -> None:
        self.device = device
        self.max_batch_tokens = max_batch_tokens  # the node config's limit, reported by /openrl/v1/info

    def trainer(self, model: ModelEntry) -> Callable[[], Any]:
        def build() -> Any:
            from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig

            config = TrainerConfig(max_batch_tokens=self.max_batch_tokens)
            return TorchTrainer(model.directory, self.device, config=config)

        return build

    def sampler(self, model: ModelEntry) -> Callable[[], Any]:
        def build() -> Any:
            from openrld.gpu.torch_sampler import TorchSampler

            return TorchSampler(model.directory, self.device)

        return build
