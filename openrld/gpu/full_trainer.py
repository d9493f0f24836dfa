"""The trainer engine for one full fine-tuning job: every weight of the model trains.

What it does: it loads the model (eval mode: no dropout) with every parameter
trainable, and for its one job runs `forward_backward` / `forward_backward_many`
(the shared `gpu/scoring.py` pass: the same micro-batching, chunked log-probs and
Tinker losses as the LoRA trainer), `optim_step` (AdamW, `gpu/optim.py`, over every
parameter; these training calls are the LoRA trainer's, `gpu/train_steps.py`'s
`TrainsInPasses`), and saving and loading of its state as full-model safetensors
(`gpu/full_io.py`). It is a `TrainerEngine` (`openrld/engine_types.py`) so that the
same actor, queues and ordering serve it: `name` is the job's model id, and the
LoRA spec those calls carry is ignored (there is no adapter).

Guarantees:
- the same as `torch_trainer` for one adapter: a failed request adds no gradient,
  gradients accumulate until `optim_step`, `forward_only` leaves them alone, and an
  optim_step of another family than the job's is refused with the gradient kept;
- Dimuon is refused at creation: it is defined on LoRA matrices
  ("dimuon needs a LoRA model");
- checkpoints hold the full weights (`model.safetensors`), and with optimizer state
  the AdamW moments and step counts, so a resume continues the run exactly; their tensor
  files are streamed, a tensor at a time, as the Automodel trainer's are;
- weights narrower than fp32 (bf16 on a GPU) train through fp32 master copies that AdamW
  keeps with its moments (and saves with them): a step smaller than a bf16 rounding step is
  kept, not rounded away, and the weights are the master rounded, as the CPU's fp32 run
  would be up to the bf16 forward's own rounding.

What it does not do: serve more than one job (a full job gets its own group),
ordering, queueing, locking, request ids, trio. Device and dtype are explicit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import msgspec
import torch

from openrld.batches import LoraSpec
from openrld.engine_types import StateSnapshot
from openrld.errors import BadRequest, Conflict, NotFound, NotSupportedYet
from openrld.gpu import checkpoint, delta, full_io, offload, safetensors_stream, train_steps
from openrld.gpu.long_attention import use_long_attention
from openrld.gpu.models import load_causal_lm
from openrld.gpu.optim import AdamW, Optimizer
from openrld.gpu.scoring import TrainerConfig

logger = logging.getLogger(__name__)

DIMUON_REFUSAL = "dimuon needs a LoRA model: openrl.fine_tuning_type=full trains with AdamW only"


class FullTrainerStatistics(msgspec.Struct, frozen=True):
    job: str | None
    parameters: int  # trainable elements
    optim_steps: int
    forward_backward_calls: int
    tokens: int  # model-input tokens run through forward_backward
    weight_sync: str  # "delta" or "full"
    synced_version: str | None  # the version the last sampler payload made
    last_sync: delta.SyncStats | None


class FullTrainer(offload.ParksInSlot, train_steps.TrainsInPasses):
    """Every weight of one model trains, for one job; one call at a time."""

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        dtype: torch.dtype | None = None,
        *,
        config: TrainerConfig = TrainerConfig(),
        weight_sync: str = "delta",
        sampler_dtype: torch.dtype | None = None,
    ) -> None:
        assert weight_sync in ("delta", "full"), f"weight_sync is 'delta' or 'full', got {weight_sync!r}"
        self.device = device
        self.config = config
        self._model = load_causal_lm(model_dir, device, dtype)
        # Sliding layers attend in O(tokens × window), not over a dense tokens² mask: long datums fit.
        use_long_attention(self._model)
        # named_parameters() lists a tied weight once: it is one tensor, trained once.
        self._params = dict(self._model.named_parameters())
        self._passes = train_steps.TrainingPasses(self._model, device, config)
        self._weight_sync = weight_sync
        # The dtype the job's sampler holds its weights in (None: the trainer's own). A sampler in
        # bfloat16 under fp32 master weights is the usual RL setting: a sync sends the sampler's
        # weights, that is the master weights rounded to its dtype, and only where the rounded bits
        # changed -- most AdamW steps move an fp32 element by less than a bf16 rounding step.
        self._sampler_dtype = sampler_dtype
        # What the job's sampler holds: it starts on the same base weights. Only delta needs
        # the copy, to compare against; it lives on the trainer's device (a comparison across
        # devices is refused) and parks with the weights.
        self._shadow = delta.clone_weights(self.sampler_tensors(None)) if weight_sync == "delta" else None
        self._synced_version: str | None = None  # None: the base model
        self._last_sync: delta.SyncStats | None = None
        self._job: str | None = None
        self._optimizer = AdamW(self._params)
        # Parked while the time-slicer gives the device to another: the weights, the AdamW state
        # (with any fp32 master copies) and the weight-sync shadow.
        self._slot = offload.ParkSlot("trainer", device, self._device_state)

    # ------------------------------------------------------------ the job

    def add_adapter(self, name: str, spec: LoraSpec | None = None, optimizer: str = "adamw") -> None:
        """Open the engine's one job, starting from the loaded weights with fresh AdamW state.

        Raises:
            Conflict: a job is already open.  BadRequest: `optimizer` is not "adamw".
        """
        _require_adamw(optimizer)
        if self._job is not None:
            raise Conflict(f"this full fine-tuning trainer already serves model {self._job}; it serves one job")
        for param in self._params.values():
            param.requires_grad_(True)
        self._job = name
        logger.info("full job opened model_id=%s parameters=%d", name, self._numel())

    def drop_adapter(self, name: str) -> None:
        """Close the job: its gradients and AdamW state go. The weights stay where its training
        left them (no copy of the base is kept); a full trainer's group ends with its job.

        Raises:
            NotFound: `name` is not the open job.
        """
        self._get(name)
        self._optimizer.zero_grad()
        self._optimizer.reset()
        self._job = None
        logger.info("full job closed model_id=%s", name)

    def has_adapter(self, name: str) -> bool:
        return name == self._job

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Every parameter as a detached CPU clone, keyed by `named_parameters()` name."""
        self._get(name)
        return {key: p.detach().to("cpu").clone() for key, p in self._params.items()}

    def live_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The parameters themselves (detached views, not copies): for weight sync,
        which reads them between steps and must not keep them."""
        self._get(name)
        return {key: p.detach() for key, p in self._params.items()}

    def sampler_tensors(self, name: str | None) -> dict[str, torch.Tensor]:
        """The weights as the sampler holds them: `live_tensors` in the sampler's dtype (views
        when it is the trainer's, new tensors otherwise). `name` None skips the job check
        (the base weights, before a job opens)."""
        if name is not None:
            self._get(name)
        live = {key: p.detach() for key, p in self._params.items()}
        if self._sampler_dtype is None:
            return live
        return {key: t.to(self._sampler_dtype) for key, t in live.items()}

    def sampler_payload(self, name: str, version: str) -> delta.WeightDelta:
        """The change that takes the sampler from its version to these weights, as `version`.

        Under weight_sync "delta", the elements whose bits changed since the last payload
        (or since the base model); under "full", every tensor. Either carries the digest
        of these weights, which the sampler checks after patching. Payloads chain: each one
        applies to the version of the one before, so they must reach the sampler in order.
        With a `sampler_dtype`, the payload is of the weights rounded to it (`sampler_tensors`).
        The payload's tensors are host copies: the sampler actor keeps versions, and none of
        them may hold the trainer's device memory.
        """
        current = self.sampler_tensors(name)
        if self._shadow is None:
            change = delta.full_update(current, self._synced_version)
        else:
            change = delta.compute_delta(current, self._shadow, self._synced_version)
            delta.apply_delta(self._shadow, change)  # the shadow is again what the sampler holds
        change = change.to_host()
        self._synced_version = version
        self._last_sync = change.stats()
        logger.info(
            "weight sync model_id=%s version=%s mode=%s changed_fraction=%.4f bytes=%d of %d",
            name, version, change.mode, self._last_sync.changed_fraction, change.bytes_moved, change.full_bytes,
        )
        return change

    def adapter_gradients(self, name: str) -> dict[str, torch.Tensor]:
        """The accumulated gradients as CPU clones (tensors without one are left out)."""
        self._get(name)
        return {key: p.grad.detach().to("cpu").clone() for key, p in self._params.items() if p.grad is not None}

    # ------------------------------------------------------------ training

    # forward_backward, forward_backward_many, forward_backward_then_step, optim_step:
    # train_steps.TrainsInPasses, over every weight of the model and its one AdamW.
    def _trainable(self, name: str) -> Iterable[torch.nn.Parameter]:
        self._get(name)
        return self._params.values()

    def _stepper(self, name: str) -> tuple[str, Optimizer]:
        self._get(name)
        return "adamw", self._optimizer

    # ------------------------------------------------------------ checkpoints

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        """Write the weights a sampler loads (full_io format) into the empty `directory`, streamed."""
        self._get(name)
        return self._save_streamed(directory, with_optimizer=False)

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        """Refused: a full fine-tuning job has no adapter to write in the PEFT format.

        Raises:
            NotSupportedYet: always (the job table refuses it first; this is the engine's own word).
        """
        raise NotSupportedYet(
            "save_weights_external is not supported yet for full fine-tuning; save_weights_for_sampler with a "
            "name writes the full weights as safetensors (model.safetensors)"
        )

    def save_state(self, name: str, directory: Path, with_optimizer: bool = True) -> int:
        """Write the weights, `optimizer.safetensors` when `with_optimizer`, and `state.json`
        (`checkpoint`) into the existing, empty `directory`; every file fsynced, the tensor files
        streamed (`_save_streamed`).

        Returns:
            Total bytes written.
        """
        self._get(name)
        size = self._save_streamed(directory, with_optimizer)
        state = checkpoint.full_state(self._optimizer.steps_done, with_optimizer)
        return size + checkpoint.write_beside(directory, state, None)

    def _save_streamed(self, directory: Path, with_optimizer: bool) -> int:
        """The weights, the AdamW state (`with_optimizer`) and full_model.json into the empty `directory`,
        each tensor file written a tensor at a time (`safetensors_stream`): the host holds one tensor's
        copy at a time, never the model (and twice it again for AdamW) as the dict path's bytes would.
        The files are that path's, byte for byte. Bytes written.

        Raises:
            FileExistsError: `directory` is not empty.  OSError: a write failed.
        """
        writes = safetensors_stream.StreamedWrites()
        writes.precondition(lambda: checkpoint.require_empty(directory))
        weights = {key: param.detach() for key, param in self._params.items()}
        entries = safetensors_stream.entries_of(weights)
        writes.write(directory / full_io.FULL_WEIGHTS, entries, safetensors_stream.taken_from(weights))
        if with_optimizer:
            moments = dict(self._optimizer.state_items())  # the live state: each copied as it is written
            writes.write(
                directory / checkpoint.OPTIMIZER_FILE, safetensors_stream.entries_of(moments),
                safetensors_stream.taken_from(moments),
            )
        size = sum(written.bytes for written in writes.finish())
        size += full_io.write_meta(directory, [entry.dtype for entry in entries])
        checkpoint.fsync_directory(directory)
        return size

    def snapshot_state(self, name: str, with_optimizer: bool = True) -> StateSnapshot | None:
        """None: a copy of the state is the whole model and twice it again (AdamW's moments), too
        much to hold twice; an auto-save writes it with `save_state`, at the job's interval."""
        self._get(name)
        return None

    def load_state(
        self, name: str, directory: Path, spec: LoraSpec | None, with_optimizer: bool, optimizer: str = "adamw"
    ) -> None:
        """Take the weights of `directory` (a full state or sampler-weights checkpoint),
        opening the job `name` if it is not open. Without `with_optimizer` the optimizer
        starts fresh. Accumulated gradients are dropped. On failure nothing changes.

        Raises:
            BadRequest: not full-model weights; tensors missing, unexpected or of another
                shape; "checkpoint has no optimizer state"; `optimizer` is not "adamw".
            Conflict: another job is open.
        """
        _require_adamw(optimizer)
        if self._job is not None and self._job != name:
            raise Conflict(f"this full fine-tuning trainer already serves model {self._job}; it serves one job")
        tensors = full_io.load_full(directory)
        checkpoint.check_same_tensors(directory.name, self._params, tensors)
        restored = AdamW(self._params)
        if with_optimizer:  # checked before anything changes
            restored.load_state_tensors(checkpoint.read_tensors(checkpoint.optimizer_file(directory, optimizer)))
        if self._job is None:
            self.add_adapter(name, spec, optimizer)
        with torch.no_grad():
            for key, param in self._params.items():
                param.copy_(tensors[key])
        self._optimizer = restored
        self._optimizer.zero_grad()
        logger.info("full job loaded model_id=%s checkpoint=%s with_optimizer=%s", name, directory, with_optimizer)

    # ------------------------------------------------------------ time-slicing

    # park, resume, is_parked: offload.ParksInSlot, over the weights and the AdamW state.

    @property
    def last_sync(self) -> delta.SyncStats | None:
        """The trainer side of the last weight sync (None before the first)."""
        return self._last_sync

    def close(self) -> None:
        """Nothing to free beyond what garbage collection takes: the engine holds no process or file."""

    # ------------------------------------------------------------ observability

    def statistics(self) -> FullTrainerStatistics:
        return FullTrainerStatistics(
            job=self._job,
            parameters=self._numel(),
            optim_steps=self._optimizer.steps_done,
            forward_backward_calls=self._passes.calls,
            tokens=self._passes.tokens,
            weight_sync=self._weight_sync,
            synced_version=self._synced_version,
            last_sync=self._last_sync,
        )

    # ------------------------------------------------------------ internals

    def _get(self, name: str) -> None:
        if name != self._job:
            raise NotFound(f"no model {name!r} on this full fine-tuning trainer")
        self._slot.require_resident(f"model {name}")

    def _device_state(self) -> list[torch.Tensor]:
        shadow = list(self._shadow.values()) if self._shadow is not None else []
        return offload.module_tensors(self._model) + self._optimizer.live_state() + shadow

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master copy of each parameter narrower than fp32 that has stepped (the
        tensors themselves; empty for fp32 weights): what the bf16 weights are rounded from."""
        return self._optimizer.master_tensors()

    def _numel(self) -> int:
        return sum(p.numel() for p in self._params.values())


def _require_adamw(optimizer: str) -> None:
    if optimizer != "adamw":
        raise BadRequest(f"{DIMUON_REFUSAL}; got optimizer {optimizer!r}", key="optimizer_config")
