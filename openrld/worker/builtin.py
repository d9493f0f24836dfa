"""The built-in engines, built in a worker from the daemon's `Start`.

`python -m openrld.worker` serves these: the same classes the daemon runs in its
own process (inproc), so a job trains and samples bit-identically under either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from openrld.worker.protocol import Start

if TYPE_CHECKING:
    from openrld.gpu.torch_sampler import SamplerOptions

KINDS = ("lora_trainer", "full_trainer", "automodel_trainer", "torch_sampler", "full_sampler", "vllm_sampler", "vllm_full_sampler")


def build(start: Start) -> Any:
    from openrld.gpu.devices import apply_cpu_threads, resolve_device

    apply_cpu_threads(start.threads)
    device = resolve_device(start.device)
    options = start.options
    match start.kind:
        case "lora_trainer":
            from openrld.gpu.torch_trainer import TorchTrainer

            config = _trainer_config(options)
            refusal = options.get("unembed_refusal")  # the node's vLLM sampler takes no LoRA on lm_head here
            return TorchTrainer(start.model_dir, device, config=config, unembed_refusal=None if refusal is None else str(refusal))
        case "full_trainer":
            from openrld.gpu.full_trainer import FullTrainer

            config = _trainer_config(options)
            return FullTrainer(start.model_dir, device, config=config, weight_sync=str(options.get("weight_sync", "delta")))
        case "automodel_trainer":
            # NeMo Automodel's FSDP2 trainer: one rank of a torchrun group (or a group of one), in the
            # Automodel environment (`make automodel-env`); nemo_automodel is imported in the engine only.
            from openrld.gpu.automodel_trainer import AutomodelTrainer

            return AutomodelTrainer(start.model_dir, device, _automodel_options(options))
        case "torch_sampler":
            from openrld.gpu.torch_sampler import TorchSampler

            return TorchSampler(start.model_dir, device, **_sampler_options(options))
        case "full_sampler":
            from openrld.gpu.full_sampler import FullSampler

            return FullSampler(start.model_dir, device, **_sampler_options(options))
        case "vllm_sampler":
            import msgspec

            from openrld.gpu.vllm_sampler import VllmSampler, VllmSamplerConfig

            return VllmSampler(start.model_dir, device, msgspec.convert(dict(options), VllmSamplerConfig))
        case "vllm_full_sampler":  # a full fine-tuning job's versions, patched into vLLM's weights
            import msgspec

            from openrld.gpu.vllm_sampler import VllmSamplerConfig
            from openrld.gpu.vllm_weights import vllm_full_sampler

            return vllm_full_sampler(start.model_dir, device, msgspec.convert(dict(options), VllmSamplerConfig))
    raise ValueError(f"no built-in engine {start.kind!r}; this worker builds {', '.join(KINDS)}")


def _trainer_config(options: dict) -> Any:
    """A LoRA or full trainer's TrainerConfig from its options (max_batch_tokens, activation_budget_bytes)."""
    from openrld.gpu.scoring import TrainerConfig

    return TrainerConfig(
        max_batch_tokens=int(options.get("max_batch_tokens", 8192)),
        activation_budget_bytes=int(options.get("activation_budget_bytes", 0)),
    )


def _automodel_options(options: dict) -> Any:
    """The Automodel trainer's options: fine_tuning, cp, weight_sync, max_batch_tokens,
    activation_budget_bytes, unembed_refusal; others refused."""
    from openrld.errors import BadRequest
    from openrld.gpu.automodel_trainer import AutomodelOptions

    known = ("fine_tuning", "cp", "weight_sync", "max_batch_tokens", "activation_budget_bytes", "unembed_refusal")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise BadRequest(f"automodel_trainer has no option {unknown[0]!r}; it takes {', '.join(known)}")
    refusal = options.get("unembed_refusal")
    return AutomodelOptions(
        fine_tuning=str(options.get("fine_tuning", "lora")),
        cp=int(options.get("cp", 1)),
        weight_sync=str(options.get("weight_sync", "delta")),
        max_batch_tokens=int(options.get("max_batch_tokens", 8192)),
        activation_budget_bytes=int(options.get("activation_budget_bytes", 0)),
        unembed_refusal=None if refusal is None else str(refusal),
    )


def ready_info(engine: Any) -> dict:
    """What a built-in engine adds to Ready: the Automodel trainer's group (ranks, devices); {} for the rest."""
    info = getattr(engine, "ready_info", None)
    return info() if callable(info) else {}


def _sampler_options(options: dict) -> SamplerOptions:
    """A torch sampler's settings from the node's: its prefix cache's bytes and whether it packs
    its weights, when set."""
    out: SamplerOptions = {}
    if "prefix_cache_bytes" in options:
        out["prefix_cache_bytes"] = int(options["prefix_cache_bytes"])
    if "packed_weights" in options:
        out["packed_weights"] = bool(options["packed_weights"])
    return out
