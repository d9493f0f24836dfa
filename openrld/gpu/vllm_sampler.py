"""The vLLM sampling engine: the torch sampler's interface, served by vLLM on a CUDA device.

`VllmSampler` is what `sampler_backend = "vllm"` builds instead of
`torch_sampler.TorchSampler`, and the sampler actor drives it the same way: it is a
`SamplerEngine` (`openrld/engine_types.py`), with `park`/`resume` for the time-slicer
served by vLLM's sleep mode (`sleep()` offloads the weights to host memory and drops
the KV cache, `wake()` brings them back). It is written against vLLM 0.33.0 (the pin of
`make vllm-env` and the image), and runs in that environment's process worker
(`[workers] vllm_python`), which sees its device as cuda:0.

How a request maps onto vLLM:
- Sample i of a request is its own vLLM request (`"<id>#<i>"`, n=1) seeded from
  (seed, i) as the torch engine seeds it (`sampling_math.stream_seed`); the samples
  share the prompt's KV through vLLM's prefix cache. Sample 0 also scores the prompt
  when asked. A seed reproduces a request that runs alone; batched with others, vLLM's
  kernels give the same bits only in its batch-invariant mode (VLLM_BATCH_INVARIANT=1),
  which this engine does not turn on, so a seed then reproduces up to kernel rounding
  ("on GPU as far as the kernels allow").
- Every SamplingParams field is translated by `child_params` (a pure function), after
  `check_vllm_limits` refused what vLLM would refuse or silently change (temperature
  above 2, or positive below 0.01). Anything vLLM still refuses at `add` (its
  `VLLMValidationError`, which is not a ValueError) is a BadRequest for that request,
  never an error that reaches the sampler group.
- Logprobs follow Tinker's sampling semantics: sampled tokens report log
  q_T, the distribution actually sampled from (after temperature, top-k and
  top-p, renormalised); prompt scoring reports the raw model at T = 1. vLLM
  reports raw logprobs unless the engine is built with
  `logprobs_mode="processed_logprobs"` (logprobs of the logits after temperature
  and top-k/top-p processing, in fp32); prompt logprobs are raw whatever the mode.
  T = 0 is greedy in vLLM and reports 0.0 here, as the torch engine does.
- LoRA versions are written as peft adapter directories and loaded under unique,
  immutable names: version k gets `openrld-v<k>` and LoRARequest int id k, never
  reused for the life of the engine, so vLLM's adapter cache (keyed by that id)
  can never serve an older version's weights for a newer one. An adapter that
  trains lm_head is refused by name for architectures whose vLLM model takes no
  LoRA there (`VLLM_NO_UNEMBED_LORA`).

On one device: the engine's `gpu_memory_utilization` is sized from what is free when
it starts (`memory_share`), so sampler replicas and a trainer can share a GPU, and a
device too full is refused with the figures. vLLM starts its engine-core process with
`spawn` (VLLM_WORKER_MULTIPROC_METHOD), never `fork`: the process that builds the
engine may be multithreaded (the daemon's worker thread, a worker's heartbeats).

Module import needs no vLLM: vLLM is imported only when an engine is built
(`require_vllm`), and a missing package is a clear error naming it. The pure
parts (`child_params`, `AdapterNames`, `to_sample_result`, `memory_share`) live in
`vllm_mapping` and are tested without vLLM on fake vLLM-shaped outputs; the
engine itself runs in bench/gpu_check.py on a GPU. Not thread-safe; never
imports trio.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import msgspec
import torch
import transformers

from openrld.batches import LoraSpec, SampleJob, SampleResult, SyncStats
from openrld.engine_types import Finished, ParkReport, ResumeReport, WeightPayload
from openrld.errors import BadRequest
from openrld.gpu import offload, torch_sampler
from openrld.gpu.lora_versions import ServesLoraVersions
from openrld.gpu.peft_export import save_peft_adapter
from openrld.gpu.sample_alone import sample_alone
from openrld.gpu.vllm_mapping import (
    AdapterNames,
    ChildParams,
    RequestOutputLike,
    check_logprob_caps,
    check_vllm_limits,
    child_params,
    generation_limit,
    lora_tensors_only,
    memory_share,
    scores_prompt,
    to_sample_result,
    unembed_lora_refusal,
    vllm_max_lora_rank,
)

logger = logging.getLogger(__name__)

VLLM_PACKAGE = "vllm"
INSTALL_HINT = (
    "build the vLLM environment with `make vllm-env` and set [workers] vllm_python to its interpreter "
    "(the image has /opt/openrld/envs/vllm/bin/python); never install vLLM into the daemon's environment, "
    "it replaces torch and transformers. Or set sampler_backend = \"torch\""
)
# vLLM reads its settings from the environment; its engine-core process must be spawned, not forked.
MULTIPROC_METHOD = ("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


class VllmUnavailable(RuntimeError):
    """vLLM is configured but cannot be used here (not installed, or no CUDA device)."""


def require_vllm() -> ModuleType:
    """Import vLLM, or raise VllmUnavailable naming the package and how to install it."""
    try:
        return importlib.import_module(VLLM_PACKAGE)
    except ImportError as error:
        raise VllmUnavailable(
            f"sampler_backend = \"vllm\" needs the {VLLM_PACKAGE!r} package, which is not installed "
            f"({error}); {INSTALL_HINT}"
        ) from error


class VllmSamplerConfig(msgspec.Struct, frozen=True):
    """Engine knobs; the node config sets the first, the rest are vLLM's usual choices."""

    # The most of the GPU's total memory one engine takes for weights and KV cache, lowered
    # at start to what is free (`memory_share`). Below vLLM's 0.9 default because the LoRA
    # trainer of the same group shares the device.
    gpu_memory_utilization: float = 0.5
    max_lora_rank: int = 128  # the node's max_lora_rank: vLLM sizes its LoRA buffers by it
    max_loras: int = 8  # distinct adapters in one running batch
    max_cpu_loras: int = 32  # adapters vLLM keeps loaded; the actor holds at most 32 per engine
    max_logprobs: int = 20  # the largest top-k of sampled or prompt logprobs a request may ask
    dtype: str = "auto"  # the checkpoint's dtype; "float32" for exact comparisons on tiny models
    enforce_eager: bool = False  # True skips CUDA graph capture: faster start, slower decode
    max_model_len: int | None = None  # None: the model's own context


# ---------------------------------------------------------------------------
# The engine


class VllmSamplerStatistics(msgspec.Struct, frozen=True):
    gpu_memory_utilization: float  # the share of the device's memory the engine started with
    versions_loaded: int
    requests_done: int
    samples_done: int
    tokens_generated: int
    requests_running: int
    is_asleep: bool


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    version: str | None
    job: SampleJob
    limit: int
    children: list[str]  # vLLM request ids, in sample order; empty when nothing needs vLLM
    outputs: dict[str, RequestOutputLike] = dataclasses.field(default_factory=dict)

    @property
    def is_done(self) -> bool:
        return len(self.outputs) == len(self.children)


class VllmSampler(ServesLoraVersions):
    """Samples from one base model and its LoRA versions through vLLM.

    Args:
        model_dir: a Hugging Face model directory with its tokenizer.
        device: a CUDA device; vLLM runs on cuda:0 of the process, so only that one is
            accepted. The process launcher gives each worker one GPU through
            CUDA_VISIBLE_DEVICES, which it then sees as cuda:0.
        config: engine knobs.
        adapter_root: where version directories are written (a fresh temporary
            directory by default, removed by `close`).
        serves_lora: False for a full fine-tuning job's sampler, which serves only the base
            model whose weights `vllm_weights.VllmWeights` replaces in place (vLLM is then
            built without LoRA, and `load_version` refuses every version).
        worker_extension: the qualified name of a class vLLM mixes into its GPU worker, whose
            methods `call_workers` can call there (`vllm_weights.EXTENSION`); "" for none.

    Raises:
        VllmUnavailable: vLLM is not installed, `device` is not cuda:0, or too little of
            the device's memory is free (`memory_share`).
    """

    def __init__(
        self,
        model_dir: str | Path,
        device: torch.device,
        config: VllmSamplerConfig = VllmSamplerConfig(),
        *,
        adapter_root: Path | None = None,
        serves_lora: bool = True,
        worker_extension: str = "",
    ) -> None:
        if device.type != "cuda":
            raise VllmUnavailable(
                f"the vLLM sampler runs on a CUDA device; this node's device is {device} "
                "(use sampler_backend = \"torch\")"
            )
        if (device.index or 0) != 0:
            raise VllmUnavailable(
                f"the vLLM sampler runs on its process's cuda:0, and was asked for {device} in the daemon's own "
                "process: set [workers] vllm_python, so that it runs in a process worker that sees its GPU as cuda:0"
            )
        if os.environ.setdefault(*MULTIPROC_METHOD) != MULTIPROC_METHOD[1]:
            logger.warning("%s=%s set by the operator; vLLM may fork a multithreaded process", *MULTIPROC_METHOD)
        vllm = require_vllm()
        self._lora_request_type = importlib.import_module(f"{VLLM_PACKAGE}.lora.request").LoRARequest
        self._sampling_params_type = vllm.SamplingParams
        # What vLLM raises for a request it refuses: VLLMValidationError, which is not a ValueError
        # (VLLMClientError <- VLLMError <- Exception); plain ValueErrors still come from some checks.
        self._refusals = (getattr(importlib.import_module(f"{VLLM_PACKAGE}.exceptions"), "VLLMValidationError", ValueError), ValueError)
        # FINAL_ONLY: step() returns a sample once, when it has finished.
        self._final_only = importlib.import_module(f"{VLLM_PACKAGE}.sampling_params").RequestOutputKind.FINAL_ONLY
        self._config = config
        self._model_dir = str(model_dir)
        free, total = _device_memory()
        try:
            self._memory_share = memory_share(
                free_bytes=free, total_bytes=total, wanted=config.gpu_memory_utilization,
                weights_bytes=_weights_bytes(Path(model_dir)),
            )
        except ValueError as error:
            raise VllmUnavailable(str(error)) from error
        self._unembed_refusal = unembed_lora_refusal(_architectures(Path(model_dir)))
        logger.info("starting vLLM model=%s gpu_memory_utilization=%.3f", self._model_dir, self._memory_share)
        self._serves_lora = serves_lora
        self._llm = vllm.LLM(
            model=self._model_dir,
            tokenizer=self._model_dir,
            dtype=config.dtype,
            gpu_memory_utilization=self._memory_share,
            enable_lora=serves_lora,
            max_lora_rank=vllm_max_lora_rank(config.max_lora_rank),
            max_loras=config.max_loras,
            max_cpu_loras=config.max_cpu_loras,
            max_logprobs=config.max_logprobs,
            # log q_T for sampled tokens; vLLM V1's default, raw_logprobs, is the
            # T = 1 model. Processed = log_softmax of the temperature-scaled, top-k/top-p-masked
            # logits: TopKTopPSampler.forward_native in vllm/v1/sample/ops/topk_topp_sampler.py.
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,  # the samples of one request share the prompt's KV
            enable_sleep_mode=True,  # sleep()/wake() for the time-slicer
            enforce_eager=config.enforce_eager,
            max_model_len=config.max_model_len,
            worker_extension_cls=worker_extension,
        )
        self._engine = self._llm.llm_engine
        model_config = self._engine.model_config
        self._vocab = int(model_config.get_vocab_size())
        self._context = int(model_config.max_model_len)
        self._eos_ids = _eos_ids(self._model_dir)
        self._names = AdapterNames()
        self._owns_root = adapter_root is None
        self._adapter_root = Path(tempfile.mkdtemp(prefix="openrld-vllm-lora-")) if adapter_root is None else adapter_root
        self._requests: dict[str, _Request] = {}
        self._by_child: dict[str, _Request] = {}
        self._is_asleep = False
        self._requests_done = 0
        self._samples_done = 0
        self._tokens_generated = 0

    # -- versions ---------------------------------------------------------

    def has_version(self, version: str | None) -> bool:
        return version is None or version in self._names

    def load_version(self, version: str, payload: WeightPayload, spec: LoraSpec | None) -> None:
        """Write the version as a peft adapter and load it under a name never used before.

        Raises:
            ValueError: not a LoRA version, already loaded, or vLLM refused the adapter (the
                message says why).
            BadRequest: the adapter trains lm_head, which vLLM takes no LoRA on for this model.
        """
        if not self._serves_lora:
            raise ValueError(f"weight version {version!r}: this vLLM engine serves full-weight versions, through FullSampler")
        if spec is None or not isinstance(payload, Mapping):
            raise ValueError(f"weight version {version!r} is not a LoRA adapter; this sampler serves LoRA versions")
        if spec.train_unembed and self._unembed_refusal is not None:
            raise BadRequest(f"weight version {version!r}: {self._unembed_refusal}", key="lora_config.train_unembed")
        tensors: Mapping[str, torch.Tensor] = payload
        self._require_awake("load_version")
        slot = self._names.assign(version)
        directory = self._adapter_root / slot.name
        try:
            directory.mkdir(parents=True)
            save_peft_adapter(directory, lora_tensors_only(tensors), spec, self._model_dir)
            if not self._engine.add_lora(self._lora_request_type(slot.name, slot.int_id, str(directory))):
                raise ValueError("vLLM did not add it")
        except Exception as error:  # vLLM raises plain exceptions for adapters it cannot load
            self._names.release(version)
            shutil.rmtree(directory, ignore_errors=True)
            raise ValueError(f"weight version {version!r}: vLLM could not load the adapter: {error}") from error
        logger.info("loaded weight version=%s adapter=%s id=%d rank=%d", version, slot.name, slot.int_id, spec.rank)

    def drop_version(self, version: str) -> None:
        """Unload a version and delete its files; its name stays retired.

        Raises:
            KeyError: not loaded.  ValueError: a live request samples from it.
        """
        self._refuse_in_use(version)
        self._require_awake("drop_version")
        slot = self._names.release(version)
        self._engine.remove_lora(slot.int_id)
        shutil.rmtree(self._adapter_root / slot.name, ignore_errors=True)
        logger.info("dropped weight version=%s adapter=%s", version, slot.name)

    def versions_in_use(self) -> set[str]:
        return {r.version for r in self._requests.values() if r.version is not None}

    # -- the weights, for a full fine-tuning job (vllm_weights.VllmWeights) --

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype vLLM holds the model's weights in."""
        return self._engine.model_config.dtype

    def call_workers(self, method: str, *args: object) -> list:
        """Call `method` of the worker extension in each of vLLM's GPU workers (`LLM.collective_rpc`);
        `args` cross to vLLM's engine process as msgpack, so plain values and bytes only.

        Raises:
            offload.EngineParked: asleep (the weights are off the device).
        """
        self._require_awake(method)
        return self._llm.collective_rpc(method, args=args)

    def base_weights_changed(self) -> None:
        """The weights were replaced in place: every prefix vLLM cached holds the old weights' KV."""
        self._require_awake("base_weights_changed")
        self._engine.reset_prefix_cache()

    # -- scheduling -------------------------------------------------------

    def validate(self, job: SampleJob) -> None:
        """Raise BadRequest for a job that `add` would refuse before vLLM sees it (the torch
        engine's checks, the logprob caps and vLLM's temperature range)."""
        torch_sampler._validate(job, self._vocab, self._context)  # the same checks as the torch engine
        check_logprob_caps(job, self._config.max_logprobs)
        check_vllm_limits(job)

    def add(self, request_id: str, version: str | None, job: SampleJob) -> None:
        """Validate `job` and hand its samples to vLLM.

        Raises:
            BadRequest: invalid job (`validate`), or one vLLM refused (its message, and the
                parameter it names).
            KeyError: `version` not loaded.  ValueError: `request_id` already live.
        """
        self.validate(job)
        lora = None if version is None else self._lora_request(version)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in the sampler")
        limit = generation_limit(job, self._context)
        if limit > 0:
            count = job.num_samples
        else:
            count = 1 if scores_prompt(job) else 0  # one throwaway token carries the prompt scores
        request = _Request(request_id, version, job, limit, [f"{request_id}#{i}" for i in range(count)])
        prompt = {"prompt_token_ids": [int(t) for t in job.prompt]}
        added: list[str] = []
        try:
            for index, child in enumerate(request.children):
                params = self._sampling_params(child_params(job, index, limit, self._vocab))
                self._engine.add_request(child, prompt, params, lora_request=lora)
                added.append(child)
        except self._refusals as error:  # vLLM refused the request: a 400 for it alone
            if added:
                self._engine.abort_request(added)
            parameter = getattr(error, "parameter", None)
            raise BadRequest(
                f"the vLLM sampler refused the request: {error}",
                key=f"sampling_params.{parameter}" if parameter else None,
            ) from error
        except Exception:
            if added:
                self._engine.abort_request(added)
            raise
        for child in request.children:
            self._by_child[child] = request
        self._requests[request_id] = request

    def cancel(self, request_id: str) -> bool:
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        live = [child for child in request.children if child not in request.outputs]
        if live:
            self._engine.abort_request(live)
        for child in request.children:
            self._by_child.pop(child, None)
        logger.info("cancelled sample request_id=%s", request_id)
        return True

    def has_work(self) -> bool:
        return bool(self._requests)

    def step(self) -> list[Finished]:
        """One vLLM engine step; returns the requests whose every sample finished.

        vLLM's step() blocks until its engine core answers, so it is called only while a
        sample of ours is live in it."""
        self._require_awake("step")
        finished = [self._finish(r) for r in list(self._requests.values()) if r.is_done]
        if self._by_child:
            for output in self._engine.step():
                request = self._by_child.get(output.request_id)
                if request is None or not output.finished:
                    continue  # a cancelled request's last output, or a partial one
                request.outputs[output.request_id] = output
                del self._by_child[output.request_id]
                if request.is_done:
                    finished.append(self._finish(request))
        return finished

    def sample(self, version: str | None, job: SampleJob) -> SampleResult:
        """Run one request alone to completion on the idle engine (`sample_alone`)."""
        return sample_alone(self, version, job)

    def _finish(self, request: _Request) -> Finished:
        del self._requests[request.request_id]
        outputs = [request.outputs[child] for child in request.children]
        result = to_sample_result(request.job, outputs, request.limit, self._eos_ids)
        self._requests_done += 1
        self._samples_done += len(result.sequences)
        self._tokens_generated += sum(len(s.tokens) for s in result.sequences)
        return Finished(request_id=request.request_id, result=result)

    def _sampling_params(self, params: ChildParams) -> object:
        return self._sampling_params_type(**msgspec.structs.asdict(params), output_kind=self._final_only)

    def _lora_request(self, version: str) -> object:
        slot = self._names.get(version)
        return self._lora_request_type(slot.name, slot.int_id, str(self._adapter_root / slot.name))

    # -- time-slicing -----------------------------------------------------

    def sleep(self) -> ParkReport:
        """vLLM sleep mode level 1: weights (LoRA buffers included) to host memory, KV cache dropped.

        Raises:
            offload.CannotPark: requests are live (vLLM would abort them).
            offload.EngineParked: already asleep.
        """
        if self._is_asleep:
            raise offload.EngineParked("the vLLM sampler is already asleep")
        if self._requests:
            raise offload.CannotPark(f"the vLLM sampler has live requests {sorted(self._requests)[:4]}")
        free_before = _free_device_bytes()
        start = time.perf_counter()
        # The KV cache is discarded, so no cached prefix may point into it after waking.
        self._engine.reset_prefix_cache()
        self._llm.sleep(level=1)
        self._is_asleep = True
        free_after = _free_device_bytes()
        # vLLM does not say what it moved; the device-wide free memory is what the time-slicer needs.
        return ParkReport(
            device="cuda:0", tensors=0, bytes_held=0, bytes_moved=0, cache_bytes_dropped=0,
            device_bytes_freed=free_after - free_before, device_bytes_reserved_after=0, seconds=time.perf_counter() - start,
        )

    def wake(self) -> ResumeReport:
        """Bring the weights back and re-allocate the KV cache.

        Raises:
            offload.EngineParked: not asleep.
        """
        if not self._is_asleep:
            raise offload.EngineParked("the vLLM sampler is not asleep")
        start = time.perf_counter()
        self._llm.wake_up()
        self._is_asleep = False
        return ResumeReport(device="cuda:0", tensors=0, bytes_moved=0, seconds=time.perf_counter() - start)

    # The time-slicer parks every engine the same way.
    park = sleep
    resume = wake

    @property
    def is_parked(self) -> bool:
        return self._is_asleep

    @property
    def last_sync(self) -> SyncStats | None:
        """Always None: LoRA versions arrive whole, with no sync to account for."""
        return None

    def _require_awake(self, operation: str) -> None:
        if self._is_asleep:
            raise offload.EngineParked(f"{operation} on a sleeping vLLM sampler; wake() it first")

    # -- lifecycle --------------------------------------------------------

    def close(self) -> None:
        """Stop vLLM's engine process and delete the adapter files this engine wrote."""
        shutdown = getattr(self._engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        if self._owns_root:
            shutil.rmtree(self._adapter_root, ignore_errors=True)

    def statistics(self) -> VllmSamplerStatistics:
        return VllmSamplerStatistics(
            gpu_memory_utilization=self._memory_share,
            versions_loaded=len(self._names),
            requests_done=self._requests_done,
            samples_done=self._samples_done,
            tokens_generated=self._tokens_generated,
            requests_running=len(self._requests),
            is_asleep=self._is_asleep,
        )


def _device_memory() -> tuple[int, int]:
    """(free, total) bytes of the process's cuda:0, device-wide (other processes' use counted)."""
    free, total = torch.cuda.mem_get_info(0)
    return int(free), int(total)


def _weights_bytes(model_dir: Path) -> int:
    """The checkpoint's size on disk: what vLLM's weights take on the device, for dtype="auto"."""
    return sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in model_dir.glob(pattern))


def _architectures(model_dir: Path) -> list[str]:
    config = json.loads((model_dir / "config.json").read_text())
    return [str(name) for name in config.get("architectures") or []]


def _free_device_bytes() -> int:
    # Device-wide, since vLLM's engine runs in its own process.
    return int(torch.cuda.mem_get_info()[0]) if torch.cuda.is_available() else 0


def _eos_ids(model_dir: str) -> frozenset[int]:
    """The tokenizer's EOS plus the generation config's, as the torch engine reads them."""
    ids: set[int] = set()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        configured = transformers.GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json
        configured = None
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    return frozenset(ids)
