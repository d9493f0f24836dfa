"""The trainer engine for one job on several devices: NeMo Automodel's FSDP2 path.

What it does: on every rank of a torchrun group (`worker/ranks.py`; or alone, a group
of one), it loads the model with `NeMoAutoModelForCausalLM.from_pretrained`, sharded by
FSDP2 over a `DistributedSetup` of `ParallelismSizes(dp_size=world/cp, cp_size=cp)`, in
one of two modes (option `fine_tuning`):
- "lora": Automodel's `PeftConfig` LoRA on the modules the job's `LoraSpec` names
  (alpha 32 whatever the rank, no dropout, as `models.lora_config`); the model is built
  when the job's adapter is added, since Automodel puts LoRA in before sharding;
- "full": every weight trains; the model is built with the engine.
It then runs the job's `forward_backward*` (`automodel_passes`: the built-in losses of
`gpu/losses.py`, the datums split over the data-parallel ranks), `optim_step` (the
optimizers of the single-device trainers, `gpu/optim.py`: AdamW over each rank's shards,
clipped by the global norm over all shards; Dimuon, LoRA only, over whole matrices
gathered at each step, since it is not elementwise), weight sync, and saving and loading
of its state.

Guarantees:
- the job's losses, metrics, log-probabilities and weights are the one-process ones up
  to float summation order: the datums' gradients are summed over the ranks (FSDP's
  divide factor is 1; every loss is a sum over datums), and AdamW is elementwise;
- LoRA A is drawn as a whole tensor from a generator seeded with `spec.seed` (a seed
  broadcast from rank 0 when it has none), then each rank keeps its rows: N ranks start
  exactly where one does (a DTensor's own random init on a CPU mesh gives every shard
  the same numbers);
- files are the single-device trainers' formats, written by rank 0: LoRA state and
  sampler weights in `lora_io` form, with `torch_trainer`'s state.json and optimizer
  file (`checkpoint`), and `export_adapter` in HF-PEFT form by Automodel's `Checkpointer`
  (peft loads it, bit-identical to `adapter_tensors`); full fine-tuning in `full_io` form with
  `full_trainer`'s state.json. Either trainer loads the other's;
- full fine-tuning's files (weights, AdamW state) are streamed (`safetensors_stream`):
  rank 0 writes each header from the tensors' names, dtypes and global shapes, then the
  tensors as every rank gathers them, one at a time; the files are byte for byte what the
  dict path (`safetensors.torch.save`) writes. LoRA keeps that dict path: adapters are small;
- full fine-tuning's weight sync is computed where the shards are (`automodel_shards`):
  no rank holds more than one whole tensor on its device at a time.

Context parallelism (option `cp` = C > 1, C dividing the group's size): each micro-batch's
datums are packed into one sequence split over the C ranks of a cp group
(`automodel_cp`: Automodel's block-diagonal CP, the K/V all-gathered over the group in
every attention layer), so activation memory no longer caps the context length on one
device; `max_batch_tokens` bounds each rank's part of a pack. The guarantee above holds
(each cp rank backpropagates 1/C of the loss they share; `automodel_passes`). On a CPU it
runs the dense attention kernel over gloo (what the tests run); on a GPU the same path runs
over NCCL, with FlashAttention's varlen kernel when flash-attn is installed and the dtype
is bf16/fp16, else the dense one: that path cannot be run here, so no test covers it.

Refused, by name: a second job (one job per engine: its devices are its own); Dimuon for
full fine-tuning (as `full_trainer`); a cp that does not divide the group's size; compute,
a new job or a load while parked, a second park and a resume when not parked
(`automodel_park.StorageSlot`).

Activation checkpointing: a round of the passes whose largest micro-batch would keep more
activations than `activation_budget_bytes` (per rank) recomputes each decoder layer in
backward, on every rank of the group alike (`automodel_passes` says why per round).

Time-slicing: `park` empties every rank's device storages (shards, gradients, buffers,
optimizer state, the delta sync's shadow) to host memory and `resume` refills them bit
for bit (`automodel_park`), on every device type alike.

The pieces: `automodel_model` (loading through Automodel, the seeded LoRA init, the
HF-PEFT export), `automodel_park` (parking), `automodel_passes` (the training passes over the ranks),
`automodel_cp` (a cp group scoring one packed micro-batch together),
`automodel_optim` (AdamW and Dimuon over shards), `automodel_shards` (gathers, reads and
the weight sync), `automodel_shims` (Automodel's CUDA assumptions on a CPU).

What it does not do: import trio; anything but rank 0's return values reach the daemon.
nemo_automodel is imported only when a model is built: the daemon's environment lacks it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from openrld.batches import ForwardBackwardBatch, ForwardBackwardResult, LoraSpec, SyncStats
from openrld.engine_types import StateSnapshot
from openrld.errors import BadRequest, Conflict, NotFound, NotSupportedYet
from openrld.gpu import checkpoint, delta, full_io, lora_io, offload, train_steps
from openrld.gpu.automodel_model import ShardSizes, export_peft, load_sharded
from openrld.gpu.automodel_optim import ShardedAdamW, WholeDimuon
from openrld.gpu.automodel_park import StorageSlot, fsdp_module_tensors
from openrld.gpu.automodel_passes import ShardedPasses
from openrld.gpu.automodel_shards import ShardedWeights, gather_bytes, local_view, read_rows, shard_of, whole
from openrld.gpu.models import pick_dtype
from openrld.gpu.safetensors_stream import StreamedWrites, StreamStatistics, entries_of
from openrld.gpu.scoring import TrainerConfig

__all__ = ["AutomodelOptions", "AutomodelStatistics", "AutomodelTrainer"]

logger = logging.getLogger(__name__)

DIMUON_REFUSAL = "dimuon needs a LoRA model: openrl.fine_tuning_type=full trains with AdamW only"


class AutomodelOptions(msgspec.Struct, frozen=True):
    """`Start.options` of kind "automodel_trainer"."""

    fine_tuning: str = "lora"  # "lora" or "full" (openrl.fine_tuning_type)
    cp: int = 1  # context-parallel degree (openrl.trainer_cp); divides the group's size
    weight_sync: str = "delta"  # full fine-tuning: "delta" or "full" (openrl.weight_sync)
    max_batch_tokens: int = 8192  # padded tokens per micro-batch, as the single-device trainers'; per rank with cp
    # Activations a round's largest micro-batch may keep (per rank) before every rank checkpoints its
    # layers in that round (the node's activation_budget_bytes): 0, the device's default; 1, always.
    activation_budget_bytes: int = 0
    # Set when the job's sampler cannot serve a LoRA on lm_head (vLLM, for some architectures):
    # why, as the 400 that refuses such an adapter (the lora_trainer's option of the same name).
    unembed_refusal: str | None = None


class AutomodelStatistics(msgspec.Struct, frozen=True):
    job: str | None
    fine_tuning: str
    world_size: int  # ranks in the group
    dp: int  # data-parallel ranks (world_size / cp)
    cp: int
    rank_devices: list[str]  # each rank's device, in rank order
    parameters: int  # trainable elements, over every shard
    optim_steps: int
    forward_backward_calls: int
    tokens: int  # model-input tokens run through forward_backward
    backward_rounds: int  # rounds of the passes run with a backward (this rank's count; every rank runs each round)
    checkpointed_rounds: int  # those whose layers were checkpointed: the same on every rank
    activation_bytes_per_token: float  # what a round's padded token keeps, agreed over the ranks (0.0: not measured yet)
    last_sync: SyncStats | None
    # The files of the last full fine-tuning save, streamed, as this rank saw them (rank 0 writes):
    # peak_held 1 means no more than one whole tensor was held at a time.
    last_save: list[StreamStatistics] = []


class AutomodelTrainer(offload.ParksInSlot, train_steps.TrainsInPasses):
    """One job's trainer over the ranks of a group; every call runs on every rank alike."""

    _last_save: tuple[StreamStatistics, ...] = ()  # the last full fine-tuning save's files (`_save_full`)

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        options: AutomodelOptions = AutomodelOptions(),
        dtype: torch.dtype | None = None,
    ) -> None:
        """Raises:
            BadRequest: an unknown fine_tuning or weight_sync, or a cp that does not divide the group.
        """
        _check_options(options)
        _ensure_process_group(device)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        if self.world_size % options.cp:
            raise BadRequest(
                f"openrl.trainer_cp={options.cp} does not divide openrl.trainer_gpus={self.world_size}", key="trainer_cp"
            )
        self.device = device
        self.options = options
        self.dp = self.world_size // options.cp
        self._dtype = dtype or pick_dtype(device)
        self._model_dir = str(model_dir)
        # Activation checkpointing is chosen per round, alike on every rank (`automodel_passes`).
        self._config = TrainerConfig(
            max_batch_tokens=options.max_batch_tokens, chunked_head=False,
            activation_budget_bytes=options.activation_budget_bytes,
        )
        parts = gather_bytes(str(device).encode())
        self.rank_devices = [part.decode() for part in parts] if parts is not None else []
        self._job: str | None = None
        self._spec: LoraSpec | None = None
        self._model: torch.nn.Module | None = None
        self._params: dict[str, torch.nn.Parameter] = {}  # trainable: peft key (LoRA) or model name (full)
        self._optimizer: ShardedAdamW | WholeDimuon | None = None
        self._family = "adamw"  # the job's optimizer family, fixed when it opens
        self._peft_config: object | None = None  # Automodel's PeftConfig of the LoRA job (for its Checkpointer)
        self._passes: ShardedPasses | None = None  # type: ignore[assignment]
        self._weights: ShardedWeights | None = None
        self._synced_version: str | None = None
        self._last_sync: SyncStats | None = None
        self._slot = StorageSlot("trainer", device, self._device_state)
        if options.fine_tuning == "full":
            self._build(None)

    # ------------------------------------------------------------ the job

    def add_adapter(self, name: str, spec: LoraSpec | None, optimizer: str = "adamw") -> None:
        """Open the engine's one job: for LoRA, build the model with `spec`'s adapter.

        Raises:
            Conflict: a job is open.  BadRequest: an unknown optimizer family, Dimuon for full
            fine-tuning, or a LoRA job without a spec or with rank < 1.
            EngineParked: the engine is parked (the new model's storages would be on the device).
        """
        self._slot.require_resident("add_adapter")
        _check_family(optimizer, self.options.fine_tuning)
        if self._job is not None:
            raise Conflict(
                f"this automodel trainer already serves model {self._job}; it serves one job (its devices are its own)"
            )
        if self.options.fine_tuning == "lora":
            if spec is None:
                raise BadRequest("a LoRA job needs its LoraSpec; got none (a full fine-tuning job?)")
            if spec.rank < 1:
                raise BadRequest(f"LoRA rank must be >= 1; got {spec.rank}", key="rank")
            if spec.train_unembed and self.options.unembed_refusal is not None:
                raise BadRequest(self.options.unembed_refusal, key="lora_config.train_unembed")
            self._build(spec, optimizer)
            self._spec = spec
        else:
            for param in self._params.values():
                param.requires_grad_(True)
        self._job = name
        logger.info(
            "automodel job opened model_id=%s fine_tuning=%s ranks=%d rank=%d",
            name, self.options.fine_tuning, self.world_size, self.rank,
        )

    def drop_adapter(self, name: str) -> None:
        """Close the job; a LoRA job's model goes with it. Raises NotFound."""
        self._get(name)
        assert self._optimizer is not None
        self._optimizer.zero_grad()
        self._optimizer.reset()
        if self.options.fine_tuning == "lora":
            self._model = self._passes = self._optimizer = None
            self._params = {}
            self._spec = None
        self._job = None
        logger.info("automodel job closed model_id=%s", name)

    def has_adapter(self, name: str) -> bool:
        return name == self._job

    def adapter_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The trainable weights, whole, as CPU tensors on rank 0 ({} on the others): peft's keys
        for LoRA (what `TorchTrainer.adapter_tensors` gives), the model's names for full."""
        self._get(name)
        return self._whole_params()

    def sampler_payload(self, name: str, version: str) -> dict[str, torch.Tensor] | delta.WeightDelta:
        """LoRA: the adapter tensors. Full: the change since the sampler's version (weight_sync
        "delta") or every tensor ("full"), as `FullTrainer.sampler_payload`; on rank 0 (the
        other ranks return {} after their part of the gathers)."""
        self._get(name)
        if self.options.fine_tuning == "lora":
            return self._whole_params()
        assert self._weights is not None
        if self.options.weight_sync == "delta":
            change = self._weights.delta(self._synced_version)
        else:
            change = self._weights.full(self._synced_version)
        self._synced_version = version
        if change is None:
            return {}
        self._last_sync = change.stats()
        logger.info(
            "weight sync model_id=%s version=%s mode=%s changed_fraction=%.4f bytes=%d of %d",
            name, version, change.mode, self._last_sync.changed_fraction, change.bytes_moved, change.full_bytes,
        )
        return change

    # ------------------------------------------------------------ training

    # forward_backward, forward_backward_many, forward_backward_then_step, optim_step:
    # train_steps.TrainsInPasses, over the job's trainable tensors and its sharded AdamW.
    def _trainable(self, name: str) -> Iterable[torch.nn.Parameter]:
        self._get(name)
        return self._params.values()

    def _stepper(self, name: str) -> tuple[str, ShardedAdamW | WholeDimuon]:  # type: ignore[override]
        self._get(name)
        assert self._optimizer is not None
        return self._family, self._optimizer

    def forward_backward_many(self, name: str, batches: Sequence[ForwardBackwardBatch]) -> list[ForwardBackwardResult]:
        """`TrainsInPasses.forward_backward_many`, once the job is known to be open (NotFound)."""
        self._get(name)
        return super().forward_backward_many(name, batches)

    # ------------------------------------------------------------ checkpoints

    def sampler_checkpoint(self, name: str, directory: Path) -> int:
        """Write what a sampler loads (lora_io for LoRA, full_io for full, streamed) into the empty
        `directory`; rank 0 writes, every rank gathers. Bytes written (0 off rank 0)."""
        self._get(name)
        if self.options.fine_tuning == "full":
            return self._save_full(directory, with_optimizer=False)
        tensors = self._whole_params()
        if self.rank != 0:
            return 0
        assert self._spec is not None
        return lora_io.save_adapter(directory, tensors, self._spec)

    def export_adapter(self, name: str, directory: Path, base_model: str) -> int:
        """Write the adapter in HF-PEFT form (`peft.PeftModel.from_pretrained` reads it) with
        Automodel's `Checkpointer`: `adapter_model.safetensors` and `adapter_config.json`
        (naming `base_model`) into the empty `directory`, every file fsynced. Bytes written.

        Raises:
            NotSupportedYet: a full fine-tuning job has no adapter.
        """
        self._get(name)
        if self.options.fine_tuning == "full":
            raise NotSupportedYet(
                "save_weights_external is not supported yet for full fine-tuning; save_weights_for_sampler with a "
                "name writes the full weights as safetensors (model.safetensors)"
            )
        return export_peft(self._model, self._peft_config, directory, base_model, dp_rank=self.rank // self.options.cp)

    def save_state(self, name: str, directory: Path, with_optimizer: bool = True) -> int:
        """Write the weights, `optimizer.safetensors` when `with_optimizer`, and `state.json`
        (`checkpoint`) into the existing, empty `directory` (rank 0 writes; every rank gathers).
        Bytes written."""
        self._get(name)
        assert self._optimizer is not None
        optimizer_state = None
        state: checkpoint.TrainerState | checkpoint.FullTrainerState
        if self.options.fine_tuning == "full":
            size = self._save_full(directory, with_optimizer)  # the optimizer's file too, streamed
            state = checkpoint.full_state(self._optimizer.steps_done, with_optimizer)
        else:
            size = self.sampler_checkpoint(name, directory)
            optimizer_state = self._optimizer.state_tensors() if with_optimizer else None  # every rank gathers
            assert self._spec is not None
            state = checkpoint.lora_state(self._spec, self._family, self._optimizer.steps_done, with_optimizer)
        if self.rank != 0:
            return 0
        return size + checkpoint.write_beside(directory, state, optimizer_state)

    def snapshot_state(self, name: str, with_optimizer: bool = True) -> StateSnapshot | None:
        """None: the state is sharded over the group's ranks and gathered whole, tensor by tensor, by
        every rank to write it (`save_state`, streamed for full fine-tuning); a host copy of it whole on
        rank 0 is what that streaming avoids. An auto-save writes it with `save_state`."""
        self._get(name)
        return None

    def load_state(
        self, name: str, directory: Path, spec: LoraSpec | None, with_optimizer: bool, optimizer: str = "adamw"
    ) -> None:
        """Take the weights (and, `with_optimizer`, the AdamW state) of `directory`, a state or
        sampler checkpoint of this trainer or of the single-device one, opening the job if needed.
        Accumulated gradients are dropped. Every rank reads the files and keeps its rows.

        Raises:
            BadRequest: not weights of this kind, a spec other than the checkpoint's, tensors
                missing or of another shape, "checkpoint has no optimizer state", an optimizer
                family other than the job's or the checkpoint's.
            Conflict: another job is open.  EngineParked: the engine is parked (its storages are empty).
        """
        self._slot.require_resident("load_state")
        _check_family(optimizer, self.options.fine_tuning)
        if self._job is not None and self._job != name:
            raise Conflict(f"this automodel trainer already serves model {self._job}; it serves one job")
        if self.options.fine_tuning == "lora":
            stored = lora_io.read_spec(directory)
            spec = spec or stored
            checkpoint.check_lora_spec(directory.name, stored, spec)
            weights_file = directory / lora_io.ADAPTER_WEIGHTS
        else:
            full_io.check_meta(directory)
            weights_file = directory / full_io.FULL_WEIGHTS
        optimizer_path = checkpoint.optimizer_file(directory, optimizer) if with_optimizer else None
        is_new = self._job is None
        if is_new:
            self.add_adapter(name, spec, optimizer)
        else:
            checkpoint.check_family(name, self._family, optimizer)
        assert self._optimizer is not None
        try:
            shapes, rows = read_rows(weights_file, self._params.get)  # this rank's rows only
            checkpoint.check_same_tensors(directory.name, self._params, shapes)
            if optimizer_path is not None:
                self._optimizer.load_state_tensors(read_rows(optimizer_path, self._optimizer.param_of)[1])
            else:
                self._optimizer.reset()
        except BaseException:
            if is_new:  # on failure nothing changes: the job this call opened closes again
                self.drop_adapter(name)
            raise
        with torch.no_grad():
            for key, param in self._params.items():
                local_view(param).copy_(shard_of(rows[key].to(param.dtype), param))
        self._optimizer.zero_grad()
        logger.info("automodel job loaded model_id=%s checkpoint=%s with_optimizer=%s", name, directory, with_optimizer)

    # ------------------------------------------------------------ time-slicing
    # park, resume and is_parked are `offload.ParksInSlot`'s: each rank empties its own device storages
    # to host memory and refills them bit for bit (rank 0's report reaches the daemon); accumulated
    # gradients stay.

    @property
    def last_sync(self) -> SyncStats | None:
        """The trainer side of the last full-weight sync (None before one, and always for LoRA)."""
        return self._last_sync

    def close(self) -> None:
        """Drop the model; the process group is the worker's and stays."""
        self._model = self._passes = self._optimizer = None
        self._params = {}

    # ------------------------------------------------------------ observability

    def statistics(self) -> AutomodelStatistics:
        passes = self._passes
        return AutomodelStatistics(
            job=self._job,
            fine_tuning=self.options.fine_tuning,
            world_size=self.world_size,
            dp=self.dp,
            cp=self.options.cp,
            rank_devices=self.rank_devices,
            parameters=sum(p.numel() for p in self._params.values()),
            optim_steps=self._optimizer.steps_done if self._optimizer is not None else 0,
            forward_backward_calls=passes.calls if passes is not None else 0,
            tokens=passes.tokens if passes is not None else 0,
            backward_rounds=passes.backward_rounds if passes is not None else 0,
            checkpointed_rounds=passes.checkpointed_rounds if passes is not None else 0,
            activation_bytes_per_token=passes.activation_bytes_per_token if passes is not None else 0.0,
            last_sync=self._last_sync,
            last_save=list(self._last_save),
        )

    def ready_info(self) -> dict[str, str | int]:
        """Facts for the worker's Ready: the group's shape and each rank's device."""
        return {
            "engine": "automodel_trainer",
            "fine_tuning": self.options.fine_tuning,
            "world_size": self.world_size,
            "dp": self.dp,
            "cp": self.options.cp,
            "rank_devices": ",".join(self.rank_devices),
        }

    # ------------------------------------------------------------ internals

    def _build(self, spec: LoraSpec | None, family: str = "adamw") -> None:
        """Load and shard the model (with `spec`'s LoRA), then its passes, optimizer and sync."""
        sizes = ShardSizes(dp=self.dp, cp=self.options.cp)
        self._model, self._params, self._peft_config, cp_mesh = load_sharded(
            self._model_dir, self.device, self._dtype, sizes, spec
        )
        self._passes = ShardedPasses(
            self._model, self.device, self._config, dp_rank=self.rank // self.options.cp, dp_size=self.dp, cp_mesh=cp_mesh
        )
        self._family = family
        self._optimizer = ShardedAdamW(self._params) if family == "adamw" else WholeDimuon(self._params, spec.rank)  # type: ignore[union-attr]
        if spec is None:
            self._weights = ShardedWeights(self._params, keep_shadow=self.options.weight_sync == "delta")

    def _save_full(self, directory: Path, with_optimizer: bool) -> int:
        """Full fine-tuning's weights, AdamW state (`with_optimizer`) and full_model.json, into the
        empty `directory`, streamed: no rank holds more than one whole tensor of them at a time.
        Bytes written (0 off rank 0).

        Raises (on rank 0, once every rank is done gathering):
            FileExistsError: `directory` is not empty.  OSError: a write failed.
        """
        writes = StreamedWrites(is_writer=self.rank == 0)
        writes.precondition(lambda: checkpoint.require_empty(directory))
        weights = entries_of(self._params)  # the DTensors' global shapes: every rank knows them
        writes.write(directory / full_io.FULL_WEIGHTS, weights, self._whole_in_order)
        if with_optimizer:
            assert isinstance(self._optimizer, ShardedAdamW), "full fine-tuning steps with AdamW"
            writes.write(directory / checkpoint.OPTIMIZER_FILE, self._optimizer.state_layout(), self._optimizer.iter_state)
        self._last_save = tuple(writes.finish())
        if self.rank != 0:
            return 0
        size = sum(written.bytes for written in self._last_save)
        size += full_io.write_meta(directory, [entry.dtype for entry in weights])
        checkpoint.fsync_directory(directory)
        logger.info(
            "full fine-tuning files saved directory=%s files=%d bytes=%d peak_tensors_held=%d",
            directory, len(self._last_save), size, max(written.peak_held for written in self._last_save),
        )
        return size

    def _whole_in_order(self, names: list[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """A `TensorSource` over the weights: each gathered whole (every rank) as it is asked for."""
        return ((name, whole(self._params[name])) for name in names)

    def _whole_params(self) -> dict[str, torch.Tensor]:
        """Every trainable tensor whole, on rank 0's host, gathered one at a time ({} elsewhere)."""
        tensors = {}
        for key, param in self._params.items():
            value = whole(param)
            if self.rank == 0:
                tensors[key] = value
        return tensors

    def _get(self, name: str) -> None:
        if name != self._job:
            raise NotFound(f"no model {name!r} on this automodel trainer")
        self._slot.require_resident(f"model {name}")

    def _device_state(self) -> list[torch.Tensor]:
        """Every tensor this rank keeps on its device: the model's shards, gradients and buffers,
        the optimizer's state, and full fine-tuning's delta shadow (a copy of every shard)."""
        tensors = fsdp_module_tensors(self._model) if self._model is not None else []
        if self._optimizer is not None:
            tensors += self._optimizer.live_tensors()
        if self._weights is not None:
            tensors += self._weights.device_tensors()
        return tensors


def _check_options(options: AutomodelOptions) -> None:
    if options.fine_tuning not in ("lora", "full"):
        raise BadRequest(f"fine_tuning: expected 'lora' or 'full', got {options.fine_tuning!r}", key="fine_tuning_type")
    if options.weight_sync not in ("delta", "full"):
        raise BadRequest(f"weight_sync: expected 'full' or 'delta', got {options.weight_sync!r}", key="weight_sync")
    if options.cp < 1:
        raise BadRequest(f"trainer_cp must be >= 1; got {options.cp}", key="trainer_cp")
    if options.activation_budget_bytes < 0:
        raise BadRequest(
            f"activation_budget_bytes must be >= 0; got {options.activation_budget_bytes}", key="activation_budget_bytes"
        )


def _check_family(optimizer: str, fine_tuning: str) -> None:
    if optimizer not in ("adamw", "dimuon"):
        raise BadRequest(f"unsupported optimizer type {optimizer!r}; supported: adamw, dimuon", key="optimizer")
    if optimizer == "dimuon" and fine_tuning == "full":
        raise BadRequest(f"{DIMUON_REFUSAL}; got optimizer {optimizer!r}", key="optimizer_config")


def _ensure_process_group(device: torch.device) -> None:
    """A group of one when no torchrun group made the default process group (one device)."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
