"""The LoRA versions loaded on one base model, as peft adapters, and the adapters kept for reuse.

What it owns: the peft wrapper of a sampler's model, which adapter holds which
immutable weight version, and the adapters of dropped versions, kept by shape
(rank and target modules) so that the next version of that shape is copied into
one instead of making a new adapter: peft makes one by walking every module of
the model (~0.45 s on SmolLM2), a copy takes ~5 ms.

Guarantees: a version's tensors are loaded exactly or not at all (a refused
version leaves no adapter behind); a version never changes once loaded; the
base weights are never written. Peft's own loader (`set_peft_model_state_dict`)
is not used: it remaps every key, ~0.35 s a version on SmolLM2, where the copy
here names each parameter directly.

It knows nothing of requests, caches or scheduling (gpu/torch_sampler.py), never
imports trio, and is not thread-safe.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import peft
import torch

from openrld.batches import LoraSpec
from openrld.engine_types import WeightPayload
from openrld.gpu import lora_io, models
from openrld.gpu.fused_forward import BASE_ADAPTER

logger = logging.getLogger(__name__)

MAX_FREE_ADAPTERS = 4  # adapters of dropped versions kept for reuse (each the size of one version)
_LORA_WEIGHT = re.compile(r"\.(lora_[AB])\.weight$")  # a trainer's key -> the adapter's own parameter

Shape = tuple[int, bool, bool, bool]


def shape_of(spec: LoraSpec) -> Shape:
    """What makes two versions' adapters interchangeable: their rank and target modules (the seed
    only initialises, and every tensor is overwritten)."""
    return spec.rank, spec.train_attn, spec.train_mlp, spec.train_unembed


class LoraVersions:
    """Weight versions by name, each in a peft adapter of `model`.

    `on_adapters_changed` runs after peft has added or deleted an adapter (a fused forward
    binds to peft's linears and their adapters then).
    """

    def __init__(self, model: torch.nn.Module, on_adapters_changed: Callable[[], None] = lambda: None) -> None:
        self._model = model
        self._on_adapters_changed = on_adapters_changed
        self.peft: peft.PeftModel | None = None  # wraps the model once the first version loads
        self._adapters: dict[str, str] = {}  # version -> peft adapter name (versions may hold ':' and '/')
        self._made = 0
        self._reused = 0
        self._free: dict[Shape, list[str]] = {}  # adapters of dropped versions, by shape
        self._shapes: dict[str, Shape] = {}  # adapter name -> its shape
        self._parameters: dict[str, torch.nn.Parameter] | None = None  # by name; None after peft changes

    def __contains__(self, version: str) -> bool:
        return version in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def adapter(self, version: str) -> str:
        """The peft adapter that holds `version` (KeyError when it is not loaded)."""
        return self._adapters[version]

    @property
    def made(self) -> int:
        return self._made

    @property
    def reused(self) -> int:
        return self._reused

    @property
    def free(self) -> int:
        return sum(len(names) for names in self._free.values())

    def load(self, version: str, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> str:
        """Load `version` from the trainer's `get_peft_model_state_dict` tensors; its adapter's name.

        Raises:
            ValueError: `version` is already loaded, a LoRA tensor is missing, unexpected or
                misshapen, or a base-weight tensor differs from the base weights.
        """
        if version in self._adapters:
            raise ValueError(f"weight version {version!r} is already loaded; versions are immutable")
        free = self._free.get(shape_of(spec))
        if free:
            adapter = free.pop()
            self._reused += 1
        else:
            adapter = self._new_adapter(spec)
        self._copy_into(version, adapter, tensors, spec)
        self._adapters[version] = adapter
        logger.info("loaded weight version=%s adapter=%s rank=%d", version, adapter, spec.rank)
        return adapter

    def drop(self, version: str) -> str:
        """Free `version`; the name of the adapter that held it (KeyError when it is not loaded)."""
        adapter = self._adapters.pop(version)
        if self.free < MAX_FREE_ADAPTERS:
            self._free.setdefault(self._shapes[adapter], []).append(adapter)  # its weights stay until reused
        else:
            self._delete(adapter)
        logger.info("dropped weight version=%s adapter=%s", version, adapter)
        return adapter

    def run_as(self, adapter: str, **inputs: object):
        """One forward of the whole batch under `adapter` ("__base__": none), made the active
        adapter rather than named per row."""
        assert self.peft is not None, "no version is loaded"
        if adapter == BASE_ADAPTER:
            with self.peft.disable_adapter():
                return self.peft(**inputs)
        if self.peft.active_adapter != adapter:
            self.peft.set_adapter(adapter)
        return self.peft(**inputs)

    def _new_adapter(self, spec: LoraSpec) -> str:
        """A new peft adapter of `spec`'s shape, its weights still peft's initial ones."""
        adapter = f"v{self._made}"
        self._made += 1
        # peft initialises lora_A randomly; fork so that loading never moves the global RNG.
        with torch.random.fork_rng(devices=[]):
            if self.peft is None:
                self.peft = peft.get_peft_model(self._model, models.lora_config(spec), adapter_name=adapter)
            else:
                self.peft.add_adapter(adapter, models.lora_config(spec))
        self._parameters = None
        self._shapes[adapter] = shape_of(spec)
        # New LoRA modules start in training mode, and peft refuses a mixed-batch forward in it.
        self.peft.eval()
        if self.peft.active_adapter not in self.peft.peft_config:
            # peft keeps naming a deleted adapter active when it was the last one, and its
            # forward looks that name up even with per-row adapter_names.
            self.peft.set_adapter(adapter)
        self._on_adapters_changed()
        return adapter

    def _copy_into(self, version: str, adapter: str, tensors: dict[str, torch.Tensor], spec: LoraSpec) -> None:
        """Copy a version's tensors into `adapter`, a new or a free adapter of `spec`'s shape.

        The tensors must name exactly the adapter's LoRA parameters, each in its shape, and any
        base tensor among them must equal the base; if not, the adapter is deleted (it may be
        half written) and the version refused.
        """
        try:
            lora = self._lora_tensors(tensors)
        except ValueError as e:
            self._delete(adapter)
            raise ValueError(f"weight version {version!r}: {e}") from e
        params = self._named_parameters()
        own = {name for name in params if "lora_" in name and f".{adapter}." in name}
        names = {key: _LORA_WEIGHT.sub(rf".\1.{adapter}.weight", key) for key in lora}
        missing = sorted(own - set(names.values()))
        unexpected = sorted(key for key, name in names.items() if name not in own)
        misshapen = sorted(key for key, name in names.items() if name in own and params[name].shape != lora[key].shape)
        if missing or unexpected or misshapen:
            self._delete(adapter)
            raise ValueError(
                f"weight version {version!r}: tensors do not match LoraSpec {spec}: "
                f"missing {missing[:4]}, unexpected {unexpected[:4]}, misshapen {misshapen[:4]}"
            )
        with torch.no_grad():
            for key, name in names.items():
                params[name].copy_(lora[key])

    def _lora_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The LoRA tensors, the base-weight ones split off (peft saves lm_head's base weight when
        it is a target). Those are not loaded, since the base is shared by every version; they
        must equal it, or the version would not be what the trainer trained."""
        params = self._named_parameters()
        lora = {}
        for key, tensor in tensors.items():
            if "lora_" in key:
                lora[key] = tensor
                continue
            base = params.get(key)
            if base is None:
                raise ValueError(f"tensor {key!r} names no parameter of the model")
            if not torch.equal(tensor.to(base.device, base.dtype), base):
                raise ValueError(f"tensor {key!r} differs from the shared base weight")
        return lora

    def _named_parameters(self) -> dict[str, torch.nn.Parameter]:
        assert self.peft is not None
        if self._parameters is None:
            self._parameters = dict(self.peft.named_parameters())
        return self._parameters

    def _delete(self, adapter: str) -> None:
        assert self.peft is not None
        self.peft.delete_adapter(adapter)
        self._shapes.pop(adapter, None)
        self._parameters = None
        self._on_adapters_changed()


class ServesLoraVersions:
    """`load_checkpoint` and the in-use refusal of a sampler that serves LoRA versions (the torch and
    the vLLM sampler): a mixin with no state of its own, over the sampler's `load_version` and
    `versions_in_use`, so that what a saved adapter is and when a version may go is written once."""

    def load_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None:
        raise NotImplementedError  # the sampler's own

    def versions_in_use(self) -> set[str]:
        raise NotImplementedError  # the sampler's own

    def load_checkpoint(self, version: str, directory: Path) -> None:
        """Load the LoRA adapter a trainer saved in `directory` (lora_io format) as `version`.

        Raises:
            BadRequest: not a LoRA adapter, or malformed files.  ValueError: as `load_version`.
        """
        tensors, spec = lora_io.load_adapter(directory)
        self.load_version(version, tensors, spec)

    def _refuse_in_use(self, version: str) -> None:
        """Raises ValueError if a live request samples from `version`."""
        if version in self.versions_in_use():
            raise ValueError(f"weight version {version!r} is in use by a live request")
