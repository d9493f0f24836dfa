"""The trainer engine for one resident base model and many LoRA adapters (one per job).

What it does: it loads the base model once (frozen, eval mode: no dropout), adds and drops
peft LoRA adapters by name (each wrapped linear adds its term in one `addmm_`:
`gpu/lora_addmm.py`), and for one adapter at a time runs `forward_backward`
(Tinker losses over the target-token log-probabilities, `gpu/losses.py`), or
`forward_backward_many` for several requests of that adapter in one pass, `optim_step`
(the adapter's optimizer family, AdamW or Dimuon, fixed when it is added: `gpu/optim.py`),
and saving and loading of its state.

Guarantees:
- a request is validated whole before any compute; a failed request (bad input or a
  non-finite loss) leaves the adapter's accumulated gradients exactly as they were;
- gradients accumulate per adapter until that adapter's `optim_step`; `forward_only`
  neither adds to nor clears them. Adapters never share weights, gradients or optimizer
  state, and clipping and the gradient norm cover one adapter only;
- datums run as right-padded micro-batches of at most `max_batch_tokens` padded tokens,
  never one at a time, and the datums of several requests share micro-batches.
  lp = log_softmax(logits in fp32)[target] is computed over chunks of positions, with the
  output layer recomputed in backward, so full fp32 logits for every position never exist at
  once (nor, unless `chunked_head` is off, full logits at all);
  a micro-batch over the activation budget recomputes its decoder layers in backward too;
- an optim_step of the other family than the adapter's is refused and keeps the gradient;
- adapter tensors use the keys of `peft.get_peft_model_state_dict(..., adapter_name=name,
  save_embedding_layers=False)`, which is what the sampler loads with
  `peft.set_peft_model_state_dict`.

The forward pass, micro-batching, chunked log-probs and backward are `gpu/scoring.py`'s
`BatchScorer`, and the training calls over it (`forward_backward*`, `optim_step` and its
family check) are `gpu/train_steps.py`'s `TrainsInPasses`, both shared with the full
fine-tuning trainer (`gpu/full_trainer.py`).

What it does not do: ordering, queueing, locking (the caller makes one call at a time),
request ids or futures, trio. Device and dtype are explicit arguments.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path

import msgspec
import peft
import torch

from openrld.batches import LoraSpec, SyncStats
from openrld.engine_types import StateSnapshot
from openrld.errors import BadRequest, Conflict, NotFound
from openrld.gpu import checkpoint, lora_addmm, lora_io, offload, state_snapshot, train_steps
from openrld.gpu.long_attention import use_long_attention
from openrld.gpu.models import load_causal_lm, lora_config
from openrld.gpu.optim import Optimizer, optimizer_for
from openrld.gpu.peft_export import save_peft_adapter
from openrld.gpu.scoring import TrainerConfig, plan_micro_batches

__all__ = ["TorchTrainer", "TrainerConfig", "TrainerStatistics", "plan_micro_batches"]

logger = logging.getLogger(__name__)


class TrainerStatistics(msgspec.Struct, frozen=True):
    adapters: int
    optim_steps: int  # AdamW steps applied, summed over the resident adapters
    forward_backward_calls: int
    tokens: int  # model-input tokens run through forward_backward


class _Adapter:
    """One job's adapter: its shape, its trainable tensors and its own optimizer."""

    def __init__(self, spec: LoraSpec, params: dict[str, torch.nn.Parameter], family: str) -> None:
        self.spec = spec
        self.params = params  # peft state-dict key (no adapter name) -> parameter
        self.family = family  # fixed for the adapter's life
        self.optimizer = optimizer_for(family, params, spec.rank)
        self.snapshot_layouts = state_snapshot.Layouts()  # kept between auto-saves' snapshots


class TorchTrainer(offload.ParksInSlot, train_steps.TrainsInPasses):
    """Many LoRA adapters over one frozen base model; one call at a time."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        config: TrainerConfig = TrainerConfig(),
        unembed_refusal: str | None = None,
    ) -> None:
        self.device = device
        self.config = config
        # Set when this group's sampler cannot serve a LoRA on lm_head (vLLM, for some
        # architectures): why, as the 400 that refuses such an adapter at creation.
        self._unembed_refusal = unembed_refusal
        self._model = load_causal_lm(model_dir, device, dtype)  # peft injects its layers into this object
        # Sliding layers attend in O(tokens × window), not over a dense tokens² mask: long datums fit.
        use_long_attention(self._model)
        self._peft: peft.PeftModel | None = None  # created with the first adapter
        self._adapters: dict[str, _Adapter] = {}
        self._active: str | None = None
        self._passes = train_steps.TrainingPasses(self._model, device, config)
        # Parked while the time-slicer gives the device to another.
        self._slot = offload.ParkSlot("trainer", device, self._device_state, drop_caches=self._drop_snapshot_layouts)

    # ------------------------------------------------------------ adapters

    def add_adapter(self, name: str, spec: LoraSpec | None, optimizer: str = "adamw") -> None:
        """Add a fresh adapter with a fresh `optimizer` ("adamw" or "dimuon"). peft
        initialises B to zero, so it equals the base model; A's random init is seeded with
        `spec.seed` when given (reproducible).

        Raises:
            Conflict: `name` exists.  BadRequest: no spec, a name peft cannot key, rank < 1,
            an unknown optimizer family, or train_unembed where this node's sampler cannot
            serve it (`unembed_refusal`).
        """
        spec = _require_spec(spec)
        self._check_unembed(spec)
        optimizer_for(optimizer, {}, spec.rank)  # refuse an unknown family before peft changes
        self._require_resident("add_adapter")  # peft would create the new tensors on the host
        if name in self._adapters:
            raise Conflict(f"adapter {name!r} already exists")
        if not name or "." in name:
            raise BadRequest(f"adapter name {name!r} cannot key torch modules (empty, or contains '.')")
        if spec.rank < 1:
            raise BadRequest(f"LoRA rank must be >= 1; got {spec.rank}", key="rank")
        # fork_rng keeps a seeded init from moving the process's global RNG; peft draws A on the CPU.
        seeded = torch.random.fork_rng(devices=[]) if spec.seed is not None else contextlib.nullcontext()
        with seeded:
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self._peft is None:
                self._peft = peft.get_peft_model(self._model, lora_config(spec), adapter_name=name)
            else:
                self._peft.add_adapter(name, lora_config(spec))
        lora_addmm.fuse(self._model)  # the linears peft wrapped for this adapter, if new
        self._active = None  # peft may have switched the active adapter
        self._adapters[name] = _Adapter(spec, self._adapter_parameters(name), optimizer)
        logger.info("adapter added adapter=%s rank=%d optimizer=%s", name, spec.rank, optimizer)

    def drop_adapter(self, name: str) -> None:
        """Delete the adapter, its gradients and its optimizer state. Raises NotFound."""
        self._get(name)
        assert self._peft is not None
        others = [other for other in self._adapters if other != name]
        if others and name in self._peft.active_adapters:
            # peft warns each time it must pick a new active adapter itself; pick one first.
            self._peft.set_adapter(others[0])
        self._peft.delete_adapter(name)
        del self._adapters[name]
        self._active = None
        logger.info("adapter dropped adapter=%s", name)

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    def adapter_names(self) -> list[str]:
        return list(self._adapters)

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Detached CPU clones, keyed as `peft.get_peft_model_state_dict` keys them."""
        self._get(name)
        state = peft.get_peft_model_state_dict(self._peft, adapter_name=name, save_embedding_layers=False)
        return {key: tensor.detach().to("cpu").clone() for key, tensor in state.items()}

    def sampler_payload(self, name: str, version: str) -> dict[str, torch.Tensor]:
        """What a new in-memory sampler version carries: the adapter tensors (CPU clones)."""
        return self.adapter_tensors(name)

    def adapter_gradients(self, name: str) -> dict[str, torch.Tensor]:
        """The accumulated gradients as CPU clones (tensors without one are left out);
        for diagnostics and tests."""
        adapter = self._get(name)
        return {key: p.grad.detach().to("cpu").clone() for key, p in adapter.params.items() if p.grad is not None}

    # ------------------------------------------------------------ training

    # forward_backward, forward_backward_many, forward_backward_then_step, optim_step:
    # train_steps.TrainsInPasses, over the adapter these name.
    def _trainable(self, name: str) -> Iterable[torch.nn.Parameter]:
        """The adapter's tensors, with it made the one adapter in the forward pass.
        Raises NotFound for an unknown adapter."""
        adapter = self._get(name)
        self._require_resident("forward_backward")
        self._activate(name)
        return adapter.params.values()

    def _stepper(self, name: str) -> tuple[str, Optimizer]:
        """The adapter's optimizer family (fixed when it was added) and its optimizer."""
        adapter = self._get(name)
        self._require_resident("optim_step")
        return adapter.family, adapter.optimizer

    # ------------------------------------------------------------ checkpoints

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        """Write the adapter a sampler loads (lora_io format) into the empty `directory`."""
        return lora_io.save_adapter(directory, self.adapter_tensors(name), self._get(name).spec)

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        """Write the adapter in the Hugging Face PEFT format (`external_weights`), naming
        `base_model`, into the empty `directory`; returns bytes written."""
        return save_peft_adapter(directory, self.adapter_tensors(name), self._get(name).spec, base_model)

    def save_state(self, name: str, directory: Path, with_optimizer: bool = True) -> int:
        """Write the adapter (lora_io format), `optimizer.safetensors` when `with_optimizer`,
        and `state.json` (`checkpoint`) into the existing, empty `directory`; every file fsynced.

        Returns:
            Total bytes written.
        """
        adapter = self._get(name)
        size = lora_io.save_adapter(directory, self.adapter_tensors(name), adapter.spec)
        state = checkpoint.lora_state(adapter.spec, adapter.family, adapter.optimizer.steps_done, with_optimizer)
        optimizer_state = adapter.optimizer.state_tensors() if with_optimizer else None
        return size + checkpoint.write_beside(directory, state, optimizer_state)

    def snapshot_state(self, name: str, with_optimizer: bool = True) -> StateSnapshot:
        """The files `save_state` writes, copied to host memory now (`state_snapshot`): the
        adapter's tensors and its optimizer's, one copy each, for a writer off the engine thread."""
        adapter = self._get(name)
        files = [
            adapter.snapshot_layouts.tensors_file(lora_io.ADAPTER_WEIGHTS, adapter.params),  # peft's state-dict keys
            state_snapshot.json_file(lora_io.ADAPTER_META, lora_io.adapter_meta(adapter.spec)),
        ]
        if with_optimizer:
            optimizer_state = dict(adapter.optimizer.state_items())
            files.append(adapter.snapshot_layouts.tensors_file(checkpoint.OPTIMIZER_FILE, optimizer_state))
        state = checkpoint.lora_state(adapter.spec, adapter.family, adapter.optimizer.steps_done, with_optimizer)
        files.append(state_snapshot.json_file(checkpoint.STATE_FILE, state))
        return StateSnapshot(files)

    def load_state(
        self, name: str, directory: Path, spec: LoraSpec | None, with_optimizer: bool, optimizer: str = "adamw"
    ) -> None:
        """Restore the adapter from `directory` (a state or sampler-weights checkpoint),
        adding it with `spec` and `optimizer` if absent. Without `with_optimizer` the
        optimizer starts fresh. Accumulated gradients are dropped. On failure nothing changes.

        Raises:
            BadRequest: "checkpoint has no optimizer state"; a spec that differs from the
                checkpoint's (rank or trained modules); tensors of another shape; an
                `optimizer` that differs from the resident adapter's, or (with optimizer
                state) from the checkpoint's.
        """
        spec = _require_spec(spec)
        self._check_unembed(spec)
        self._require_resident("load_state")
        resident = self._adapters.get(name)
        if resident is not None:
            checkpoint.check_family(name, resident.family, optimizer)
        tensors, stored = lora_io.load_adapter(directory)
        checkpoint.check_lora_spec(directory.name, stored, spec)
        optimizer_state = None
        if with_optimizer:
            path = checkpoint.optimizer_file(directory, optimizer, weights="adapter weights")
            optimizer_state = checkpoint.read_tensors(path)
        is_new = name not in self._adapters
        if is_new:
            self.add_adapter(name, spec, optimizer)
        try:
            adapter = self._adapters[name]
            checkpoint.check_same_tensors(directory.name, adapter.params, tensors, fits="adapter")
            if optimizer_state is None:
                adapter.optimizer.reset()
            else:
                adapter.optimizer.load_state_tensors(optimizer_state)
        except BaseException:
            if is_new:
                self.drop_adapter(name)
            raise
        with torch.no_grad():
            for key, param in adapter.params.items():
                param.copy_(tensors[key])
        adapter.optimizer.zero_grad()
        logger.info("adapter loaded adapter=%s checkpoint=%s with_optimizer=%s", name, directory, with_optimizer)

    # ------------------------------------------------------------ time-slicing

    # park, resume, is_parked: offload.ParksInSlot, over what this names.
    def _device_state(self) -> list[torch.Tensor]:
        """The base model, every adapter, its gradients and its optimizer state."""
        state = offload.module_tensors(self._model)  # peft's LoRA layers live inside this module
        for adapter in self._adapters.values():
            state += adapter.optimizer.live_state()
        return state

    def _drop_snapshot_layouts(self) -> int:
        """Before a park: the snapshot layouts' views would keep the moved tensors' device memory
        alive. On the CPU a park moves nothing, so they stay. Frees no bytes of its own."""
        if self.device.type != "cpu":
            for adapter in self._adapters.values():
                adapter.snapshot_layouts.clear()
        return 0

    def _check_unembed(self, spec: LoraSpec) -> None:
        if spec.train_unembed and self._unembed_refusal is not None:
            raise BadRequest(self._unembed_refusal, key="lora_config.train_unembed")

    def _require_resident(self, operation: str) -> None:
        self._slot.require_resident(operation)

    @property
    def last_sync(self) -> SyncStats | None:
        """Always None: a LoRA version is the adapter tensors, with no sync to account for."""
        return None

    def close(self) -> None:
        """Nothing to free beyond what garbage collection takes: the engine holds no process or file."""

    # ------------------------------------------------------------ observability

    def statistics(self) -> TrainerStatistics:
        return TrainerStatistics(
            adapters=len(self._adapters),
            optim_steps=sum(a.optimizer.steps_done for a in self._adapters.values()),
            forward_backward_calls=self._passes.calls,
            tokens=self._passes.tokens,
        )

    # ------------------------------------------------------------ internals

    def _get(self, name: str) -> _Adapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise NotFound(f"no adapter {name!r} on this trainer")
        return adapter

    def _activate(self, name: str) -> None:
        """Make `name` the one adapter in the forward pass; peft also makes only its tensors
        require grad, so no other adapter can receive a gradient."""
        if self._active != name:
            assert self._peft is not None
            self._peft.set_adapter(name)
            self._active = name

    def _adapter_parameters(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's LoRA tensors, keyed like peft's state dict (adapter name removed)."""
        assert self._peft is not None
        params: dict[str, torch.nn.Parameter] = {}
        for key, param in self._peft.named_parameters():
            for part in ("lora_A", "lora_B"):
                marker = f".{part}.{name}."
                if marker in key:
                    params[key.replace(marker, f".{part}.")] = param
        assert params, f"peft created no LoRA tensors for adapter {name!r}"
        return params


def _require_spec(spec: LoraSpec | None) -> LoraSpec:
    if spec is None:
        raise BadRequest("a LoRA trainer needs the adapter's LoraSpec; got none (a full fine-tuning job?)")
    return spec
