"""Builders of the torch engines for a model on a device, handed to the actors.

The actors never import torch; the daemon gives them this factory, whose
builders run in the actor's worker thread and return a ready engine.
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from openrld.engine_types import SamplerEngine, TrainerEngine
from openrld.gpu.gguf_convert import GgufConverter
from openrld.model_catalog import ModelEntry

if TYPE_CHECKING:
    from openrld.gpu.vllm_sampler import VllmSamplerConfig


class TorchEngineFactory:
    def __init__(
        self,
        device: torch.device,
        *,
        max_batch_tokens: int,
        converter: GgufConverter | None = None,
        vllm: VllmSamplerConfig | None = None,
        trainer_process: bool = False,
        cpu_threads: int | None = None,
    ) -> None:
        self.device = device
        self.vllm = vllm  # set: LoRA groups sample with vLLM (sampler_backend = "vllm"), else with torch
        self.max_batch_tokens = max_batch_tokens  # the node config's limit, reported by /openrl/v1/info
        # A GGUF base model is converted on first use; whichever engine builds first converts it.
        self.converter = converter
        # set: each LoRA trainer runs in a process of its own (gpu/engine_process.py), with
        # `cpu_threads` torch threads, as this process has
        self.trainer_process = trainer_process
        self.cpu_threads = cpu_threads

    def on(self, device: str) -> TorchEngineFactory:
        """This factory, building its engines on `device` (a label of the node's inventory)."""
        from openrld.gpu.devices import resolve_device

        bound = copy.copy(self)
        bound.device = resolve_device(device)
        return bound

    def _ensure_files(self, model: ModelEntry) -> None:
        if self.converter is not None:
            self.converter.ensure(model)

    def trainer(self, model: ModelEntry) -> Callable[[], TrainerEngine]:
        def build() -> TrainerEngine:
            self._ensure_files(model)
            if not self.trainer_process:
                return build_lora_trainer(model.directory, self.device, self.max_batch_tokens)
            from openrld.gpu.engine_process import TrainerProcess

            return TrainerProcess(
                partial(build_lora_trainer, model.directory, self.device, self.max_batch_tokens),
                threads=self.cpu_threads, name=f"openrld-trainer {model.name}",
            )

        return build

    def sampler(self, model: ModelEntry) -> Callable[[], SamplerEngine]:
        def build() -> SamplerEngine:
            self._ensure_files(model)
            if self.vllm is not None:
                from openrld.gpu.vllm_sampler import VllmSampler

                return VllmSampler(model.directory, self.device, self.vllm)
            from openrld.gpu.torch_sampler import TorchSampler

            return TorchSampler(model.directory, self.device)

        return build

    def full_trainer(self, model: ModelEntry, weight_sync: str) -> Callable[[], TrainerEngine]:
        """A trainer for one full fine-tuning job; `weight_sync` is "delta" or "full"."""

        def build() -> TrainerEngine:
            from openrld.gpu.full_trainer import FullTrainer
            from openrld.gpu.torch_trainer import TrainerConfig

            self._ensure_files(model)
            config = TrainerConfig(max_batch_tokens=self.max_batch_tokens)
            return FullTrainer(model.directory, self.device, config=config, weight_sync=weight_sync)

        return build

    def full_sampler(self, model: ModelEntry) -> Callable[[], SamplerEngine]:
        """A sampler for one full fine-tuning job's weight versions."""

        def build() -> SamplerEngine:
            from openrld.gpu.full_sampler import FullSampler

            self._ensure_files(model)
            return FullSampler(model.directory, self.device)

        return build


def build_lora_trainer(model_dir: Path, device: torch.device, max_batch_tokens: int) -> TrainerEngine:
    """A LoRA trainer engine; module-level, so that a trainer process can be handed it, pickled."""
    from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig

    return TorchTrainer(model_dir, device, config=TrainerConfig(max_batch_tokens=max_batch_tokens))
