"""Builders of the engines for a model on a device, handed to the actors.

The actors never import torch; the daemon gives them this factory, whose
builders run in the actor's worker thread and return a ready engine: the
built-in engine itself (inproc), or a worker hosting the same engine elsewhere
(`hosting.py` says where: a process, the vLLM environment, a job's container
image). Both paths build through `builtin.build`, from the same `Start`, so a job
trains and samples bit-identically under either.

An engine in this process stands behind the same edge as one in a worker: the weights
a worker's trainer sends come as a `WirePayload` (`values.py`), and `InprocSampler`
decodes them for the sampler engine, as a worker's server does for its own (the engines
of `gpu/` take torch tensors and weight deltas only, and import nothing of `worker/`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from openrld.batches import LoraSpec
from openrld.engine_types import SamplerEngine, TrainerEngine, WeightPayload
from openrld.gpu.devices import group_device
from openrld.gpu.models import pick_dtype
from openrld.model_catalog import ModelEntry
from openrld.worker import builtin
from openrld.worker.hosting import WorkerHosting
from openrld.worker.launchers.torchrun import SpanRendezvous
from openrld.worker.protocol import Role, Scalar, Start
from openrld.worker.values import local_payload

if TYPE_CHECKING:
    # Types only: the gguf package is the daemon's, not in a worker's environment (.venv-automodel).
    from openrld.gpu.gguf_convert import GgufConverter
    from openrld.gpu.vllm_sampler import VllmSamplerConfig


class TorchEngineFactory:
    def __init__(
        self,
        device: torch.device,
        *,
        max_batch_tokens: int,
        activation_budget_bytes: int = 0,
        converter: GgufConverter | None = None,
        vllm: VllmSamplerConfig | None = None,
        cpu_threads: int | None = None,
        hosting: WorkerHosting | None = None,
        prefix_cache_bytes: int | None = None,
        packed_weights: bool = True,
    ) -> None:
        self.device = device
        self.vllm = vllm  # set: LoRA groups sample with vLLM (sampler_backend = "vllm"), else with torch
        self.max_batch_tokens = max_batch_tokens  # the node config's limit, reported by /openrl/v1/info
        # What a trainer's micro-batch may keep before it checkpoints (0: the device's default).
        self.trainer_options: dict[str, Scalar] = {
            "max_batch_tokens": max_batch_tokens, "activation_budget_bytes": activation_budget_bytes,
        }
        # A GGUF base model is converted on first use; whichever engine builds first converts it.
        self.converter = converter
        self.cpu_threads = cpu_threads  # a worker's torch threads, as this process has
        self.hosting = hosting or WorkerHosting.inproc()
        # A torch sampler's prefix KV cache (None: the engine's default), and whether it packs its weights.
        self.sampler_options: dict[str, Scalar] = {"packed_weights": packed_weights}
        if prefix_cache_bytes is not None:
            self.sampler_options["prefix_cache_bytes"] = prefix_cache_bytes

    def on(self, device: str) -> TorchEngineFactory:
        """This factory, building its engines on `device` (a label of the node's inventory)."""
        from openrld.gpu.devices import resolve_device

        bound = copy.copy(self)
        bound.device = resolve_device(device)
        return bound

    def trainer(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], TrainerEngine]:
        """The LoRA trainer of `model`'s group; with `image`, of one job's group, from its image.

        Where this node samples with vLLM and vLLM takes no LoRA on `model`'s lm_head, the
        trainer refuses an adapter that trains it, at creation (`unembed_refusal`)."""

        def build() -> TrainerEngine:
            options: dict[str, Scalar] = dict(self.trainer_options)
            refusal = self._unembed_refusal(model)
            if refusal is not None:
                options["unembed_refusal"] = refusal
            return self._build("trainer", "lora_trainer", model, options, image=image, job=job)

        return build

    def sampler(self, model: ModelEntry, image: str | None = None, job: str | None = None) -> Callable[[], SamplerEngine]:
        """The sampler of `model`'s LoRA group; with `image`, of one job's group, from its image
        (which is told to build the kind this node would)."""
        if self.vllm is not None:
            options = {k: v for k, v in msgspec.to_builtins(self.vllm).items() if v is not None}
            return lambda: self._build("sampler", "vllm_sampler", model, options, image=image, job=job)
        return lambda: self._build("sampler", "torch_sampler", model, self.sampler_options, image=image, job=job)

    def full_trainer(
        self, model: ModelEntry, weight_sync: str, image: str | None = None, job: str | None = None
    ) -> Callable[[], TrainerEngine]:
        """A trainer for one full fine-tuning job; `weight_sync` is "delta" or "full"."""
        options = {**self.trainer_options, "weight_sync": weight_sync}
        return lambda: self._build("trainer", "full_trainer", model, options, image=image, job=job)

    def full_sampler(
        self, model: ModelEntry, image: str | None = None, job: str | None = None
    ) -> Callable[[], SamplerEngine]:
        """A sampler for one full fine-tuning job's weight versions: on a vLLM node, vLLM with the
        versions patched into its weights (`vllm_weights`), else the torch engine."""
        if self.vllm is None:
            return lambda: self._build("sampler", "full_sampler", model, self.sampler_options, image=image, job=job)

        vllm = self.vllm
        return lambda: self._build(
            "sampler", "vllm_full_sampler", model, vllm_full_options(vllm, self.device), image=image, job=job
        )

    def automodel_trainer(
        self, model: ModelEntry, *, devices: tuple[str, ...], fine_tuning: str, weight_sync: str, cp: int,
        job: str | None = None, span: SpanRendezvous | None = None,
    ) -> Callable[[], TrainerEngine]:
        """NeMo Automodel's FSDP2 trainer for one job (gpu/automodel_trainer.py): a torchrun group in the
        Automodel environment, one rank per device of `devices` (labels of the node's inventory, in rank
        order), context parallel over `cp` of them; `fine_tuning` is "lora" or "full". With `span`, these
        are this node's ranks of a group over several nodes, global rank 0 among them."""
        # The node's trainer options (max_batch_tokens, activation_budget_bytes), as the LoRA trainer's.
        options: dict[str, Scalar] = {
            **self.trainer_options, "fine_tuning": fine_tuning, "cp": cp, "weight_sync": weight_sync,
        }

        def build() -> TrainerEngine:
            if self.converter is not None:
                self.converter.ensure(model)
            refusal = self._unembed_refusal(model) if fine_tuning == "lora" else None
            if refusal is not None:  # as the LoRA trainer: vLLM samples here and takes no LoRA on lm_head
                options["unembed_refusal"] = refusal
            return self.hosting.start(
                self.hosting.automodel_launcher(len(devices), span), role="trainer", kind="automodel_trainer",
                model_name=model.name, model_dir=model.directory, device=group_device(devices),
                threads=self.cpu_threads, options=options, job=job,
            )

        return build

    def _unembed_refusal(self, model: ModelEntry) -> str | None:
        """Why an adapter on lm_head cannot be sampled here (None: it can)."""
        if self.vllm is None:
            return None
        from openrld.gpu.vllm_mapping import unembed_lora_refusal

        if self.converter is not None:
            self.converter.ensure(model)
        config = Path(model.directory) / "config.json"
        architectures = json.loads(config.read_text()).get("architectures") if config.is_file() else None
        return unembed_lora_refusal([str(a) for a in architectures or []])

    def _build(
        self, role: Role, kind: str, model: ModelEntry, options: dict[str, Scalar], *,
        image: str | None = None, job: str | None = None,
    ) -> Any:
        if self.converter is not None:
            self.converter.ensure(model)
        launcher = self.hosting.launcher_for(kind, image)
        if launcher is None:
            engine = builtin.build(Start(kind, model.directory, str(self.device), options=options))
            return InprocSampler(engine) if role == "sampler" else engine
        return self.hosting.start(
            launcher, role=role, kind=kind, model_name=model.name, model_dir=model.directory,
            device=str(self.device), threads=self.cpu_threads, options=options, image=image, job=job,
        )


class InprocSampler:
    """A sampler engine in this process, behind the worker's edge: a payload from a worker's
    trainer is decoded here (`values.local_payload`), never in the engine. Every other call,
    and what the engine has besides its Protocol (`statistics`), is the engine's own."""

    def __init__(self, engine: SamplerEngine) -> None:
        self.engine = engine

    def load_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None:
        self.engine.load_version(version, local_payload(payload), spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


def vllm_full_options(config: VllmSamplerConfig, device: torch.device) -> dict[str, Scalar]:
    """The vLLM engine options of a full fine-tuning job's sampler on `device`: the node's, in the
    trainer's dtype (`models.pick_dtype`) where the node leaves it "auto" -- a sync is bit for bit,
    and "auto" would take the checkpoint's dtype (bf16 for an fp32 one)."""
    options = {k: v for k, v in msgspec.to_builtins(config).items() if v is not None}
    if options.get("dtype") == "auto":
        options["dtype"] = str(pick_dtype(device)).removeprefix("torch.")
    return options


def build_lora_trainer(model_dir: Path | str, device: torch.device, max_batch_tokens: int) -> TrainerEngine:
    """A LoRA trainer engine on `device`, as a group's trainer is built."""
    from openrld.gpu.torch_trainer import TorchTrainer, TrainerConfig

    return TorchTrainer(model_dir, device, config=TrainerConfig(max_batch_tokens=max_batch_tokens))
