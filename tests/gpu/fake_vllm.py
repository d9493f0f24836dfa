"""A fake of vLLM 0.33's surface that openrld's vLLM engines touch, the edge we cannot reach.

vLLM is not installed here (it needs CUDA). Every signature here is vLLM 0.33.0's, read from
its wheel: `LLM(**engine_args)`, `LLM.sleep(level=1, mode="abort")`, `LLM.wake_up(tags=None)`,
`LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)`, `LLMEngine.add_request`,
`step`, `abort_request`, `add_lora`, `remove_lora`, `reset_prefix_cache(reset_running_requests=False,
reset_connector=False)`, `SamplingParams`' checks, `VLLMValidationError`, and
`model_executor.model_loader.checkpoint_weight_patch` (`CheckpointWeightPatch`,
`load_checkpoint_weight_patches`). test_vllm_sampler.py and test_vllm_full_sampler.py install it.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import sys
import types
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest
import torch
from vllm_outputs import VOCAB, Completion, Logprob, Output

from openrld.gpu import vllm_sampler


class VLLMError(Exception):
    """vllm.exceptions (0.30-0.33): VLLMValidationError <- VLLMClientError <- VLLMError <- Exception."""


class VLLMClientError(VLLMError):
    pass


class VLLMValidationError(VLLMClientError):
    def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class FakeSamplingParams:
    """vllm.SamplingParams' checks (`__post_init__`, `_verify_args`), which raise
    VLLMValidationError, and its silent rewrites: a positive temperature below 0.01 is
    raised to 0.01 (`_MAX_TEMP`), a str stop becomes a list."""

    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs
        temperature = float(kwargs.get("temperature", 1.0))  # type: ignore[arg-type]
        if 0 < temperature < 0.01:
            temperature = 0.01  # vLLM logs a warning and samples at 0.01
        kwargs["temperature"] = temperature
        stop = kwargs.get("stop") or []
        kwargs["stop"] = [stop] if isinstance(stop, str) else list(stop)  # type: ignore[arg-type]
        if not math.isfinite(temperature) or temperature < 0:
            raise VLLMValidationError(f"temperature must be non-negative, got {temperature}.", parameter="temperature")
        if temperature > 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {temperature}.", parameter="temperature")
        if not 0.0 < float(kwargs.get("top_p", 1.0)) <= 1.0:  # type: ignore[arg-type]
            raise VLLMValidationError(f"top_p must be in (0, 1], got {kwargs['top_p']}.", parameter="top_p")
        if int(kwargs.get("top_k", 0)) < -1:  # type: ignore[call-overload]
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {kwargs['top_k']}.")
        if kwargs.get("max_tokens") is not None and int(kwargs["max_tokens"]) < 1:  # type: ignore[call-overload]
            raise VLLMValidationError(f"max_tokens must be at least 1, got {kwargs['max_tokens']}.", parameter="max_tokens")
        if any(not s for s in kwargs["stop"]):  # type: ignore[union-attr]
            raise VLLMValidationError("stop cannot contain an empty string.")
        if temperature < 1e-5 and int(kwargs.get("n", 1)) > 1:  # type: ignore[call-overload]
            raise VLLMValidationError(f"n must be 1 when using greedy sampling, got {kwargs['n']}.")


class FakeEngine:
    """vLLM's LLMEngine as the sampler uses it. step() advances every live request by one
    token: token j of a sample is (its seed + j) % VOCAB. A sample ends with finish_reason
    "stop" on a stop id (stop_reason: the id) or on EOS unless ignore_eos (stop_reason None),
    else "length" at max_tokens; with FINAL_ONLY only a finished sample is returned. Like
    vLLM's, step() blocks until its engine core answers, which it never does with nothing
    live (here: an error, so a test sees it), and abort_request skips unknown ids."""

    def __init__(self, vocab: int, context: int, eos: int, dtype: torch.dtype = torch.float32) -> None:
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: vocab, max_model_len=context, dtype=dtype)
        self.engine_core = types.SimpleNamespace(shutdown=lambda: None)
        self.eos = eos
        self.added: list[tuple[str, list[int], object, object]] = []
        self.live: dict[str, tuple[list[int], FakeSamplingParams, list[int]]] = {}
        self.aborted: list[str] = []
        self.loras: dict[int, object] = {}
        self.calls: list[str] = []
        self.refuse_at: dict[str, VLLMValidationError] = {}  # request id -> what its processor raises

    def add_request(self, request_id: str, prompt: dict, params: FakeSamplingParams, lora_request: object = None) -> None:
        tokens = prompt["prompt_token_ids"]
        if request_id in self.refuse_at:
            raise self.refuse_at[request_id]
        if len(tokens) > self.model_config.max_model_len:
            raise VLLMValidationError(f"The decoder prompt (length {len(tokens)}) is longer than the maximum model length")
        self.added.append((request_id, tokens, params, lora_request))
        self.live[request_id] = (tokens, params, [])

    def step(self) -> list[Output]:
        if not self.live:
            raise AssertionError("vLLM's step() blocks forever with no request live")
        outputs = []
        for request_id, (prompt, params, tokens) in list(self.live.items()):
            kw = params.kwargs
            tokens.append(((kw["seed"] or 0) + len(tokens)) % VOCAB)
            finish, stop_reason = None, None
            if tokens[-1] in kw["stop_token_ids"]:
                finish, stop_reason = "stop", tokens[-1]
            elif tokens[-1] == self.eos and not kw["ignore_eos"]:
                finish = "stop"
            elif len(tokens) == kw["max_tokens"]:
                finish = "length"
            if finish is None:
                continue
            rows = None
            if kw["prompt_logprobs"] is not None:
                rows = [None] + [{t: Logprob(-1.0)} for t in prompt[1:]]
            done = Completion(list(tokens), [{t: Logprob(-0.25)} for t in tokens], finish, stop_reason=stop_reason)
            outputs.append(Output(request_id, [done], prompt_logprobs=rows))
            del self.live[request_id]
        return outputs

    def abort_request(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for request_id in request_ids:
            self.live.pop(request_id, None)

    def add_lora(self, request: object) -> bool:
        self.loras[request.int_id] = request  # type: ignore[attr-defined]
        return True

    def remove_lora(self, int_id: int) -> bool:
        del self.loras[int_id]
        return True

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self.calls.append("reset_prefix_cache")
        return True


class FakeLLM:
    """vllm.LLM as the engines use it. With `worker_extension_cls`, its one GPU worker (a
    `FakeWorker` holding `FusedLlama`) gets the class mixed in, as vLLM's WorkerWrapperBase
    does, and `collective_rpc` calls the worker's methods by name with its arguments and
    results round-tripped through msgpack without types, as vLLM's engine process decodes a
    utility call (a tensor argument fails here; in vLLM it would arrive as a list)."""

    def __init__(self, **kwargs: object) -> None:
        self.kwargs = kwargs
        self.environment = dict(os.environ)  # what vLLM's engine-core process would inherit
        eos = json.loads((Path(str(kwargs["model"])) / "config.json").read_text())["eos_token_id"]
        dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}[str(kwargs.get("dtype", "auto"))]
        self.llm_engine = FakeEngine(VOCAB, 64, eos, dtype)
        self.is_sleeping = False
        self.rpc_calls: list[str] = []
        extension = str(kwargs.get("worker_extension_cls") or "")
        worker_class: type = FakeWorker
        if extension:
            module, _, name = extension.rpartition(".")
            worker_class = type("Worker", (FakeWorker, getattr(importlib.import_module(module), name)), {})
        self.worker = worker_class(FusedLlama(Path(str(kwargs["model"])), dtype))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.llm_engine.calls.append(f"sleep({level})")
        self.is_sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.llm_engine.calls.append("wake_up")
        self.is_sleeping = False
        return True

    def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
    ) -> list:
        if self.is_sleeping:
            raise AssertionError(f"collective_rpc({method!r}) while asleep: the weights are off the device")
        self.rpc_calls.append(method)
        args, kwargs = msgspec.msgpack.decode(msgspec.msgpack.encode([list(args), kwargs or {}]))
        result = getattr(self.worker, method)(*args, **kwargs)
        return [msgspec.msgpack.decode(msgspec.msgpack.encode(result))]


class FakeWorker:
    """vLLM's GPU worker, as an extension sees it: `get_model()`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


# (vLLM's fused parameter, the checkpoint's name, its shard): vLLM's Llama stacked_params_mapping.
STACKED = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


class FusedLlama(torch.nn.Module):
    """vLLM's Llama as its loader sees it: q/k/v fused into qkv_proj, gate/up into gate_up_proj
    (shards stacked along dim 0 in that order), and `load_weights` taking checkpoint names,
    writing each shard with `param.data.narrow(0, offset, size).copy_(loaded)` and every other
    weight with `param.data.copy_(loaded)` (QKVParallelLinear, MergedColumnParallelLinear and
    default_weight_loader at tensor parallel size 1). Starts from the checkpoint's weights."""

    def __init__(self, model_dir: Path, dtype: torch.dtype) -> None:
        super().__init__()
        from safetensors.torch import load_file

        checkpoint = {k: v.to(dtype) for p in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(p).items()}
        shapes: dict[str, list[int]] = {}
        self.shards: dict[tuple[str, object], tuple[int, int]] = {}  # (fused name, shard) -> (offset, rows)
        order = [shard for _, _, shard in STACKED]
        by_shard = sorted(checkpoint.items(), key=lambda item: order.index(s) if (s := self._fused(item[0])[1]) in order else -1)
        for name, tensor in by_shard:  # shards stacked in vLLM's order: q, k, v and gate, up
            fused, shard = self._fused(name)
            rows = shapes.setdefault(fused, [0, *tensor.shape[1:]])
            self.shards[(fused, shard)] = (rows[0], tensor.shape[0])
            rows[0] += tensor.shape[0]
        self.params = torch.nn.ParameterDict(
            {k.replace(".", "__"): torch.nn.Parameter(torch.zeros(s, dtype=dtype), requires_grad=False) for k, s in shapes.items()}
        )
        self.load_weights(checkpoint.items())

    @staticmethod
    def _fused(name: str) -> tuple[str, object]:
        for fused, shard_name, shard in STACKED:
            if f".{shard_name}." in name:
                return name.replace(shard_name, fused), shard
        return name, None

    def fused_weights(self) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): p.data for k, p in self.params.items()}

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            fused, shard = self._fused(name)
            param = self.params[fused.replace(".", "__")]
            if shard is None:
                assert param.size() == tensor.size()
                param.data.copy_(tensor)
            else:
                offset, rows = self.shards[(fused, shard)]
                param.data.narrow(0, offset, rows).copy_(tensor)
            loaded.add(name)
        return loaded


class CheckpointWeightPatch(NamedTuple):
    """vllm.model_executor.model_loader.checkpoint_weight_patch.CheckpointWeightPatch (0.33)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    values: torch.Tensor
    indices: torch.Tensor | None = None


@torch.no_grad()
def load_checkpoint_weight_patches(
    model: torch.nn.Module, patches, *, max_chunk_bytes: int = 512 << 20, validate_unique_indices: bool = True
) -> set[str]:
    """vLLM 0.33's patch loader, as it behaves: dense and sparse not mixed in one call; a sparse
    patch is staged as its whole checkpoint tensor, NaN where unchanged, and loaded with every
    copy_ keeping the destination wherever the source is NaN; NaN values, out-of-range or
    duplicate indices are refused before anything is written."""
    patches = list(patches)
    if len({p.indices is None for p in patches}) > 1:
        raise ValueError("Dense and sparse checkpoint patches cannot be mixed")
    for p in patches:
        if p.indices is not None:
            bad = bool(torch.isnan(p.values).any()) or bool((p.indices < 0).any() | (p.indices >= math.prod(p.shape)).any())
            if bad or (validate_unique_indices and p.indices.unique().numel() != p.indices.numel()):
                raise ValueError("Sparse checkpoint patches contain NaN values, out-of-range indices, or duplicate indices")
    plain_copy = torch.Tensor.copy_

    def keep_where_nan(destination: torch.Tensor, source: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return torch.where(torch.isnan(source), destination, source.to(destination.dtype), out=destination)

    loaded: set[str] = set()
    for p in patches:
        if p.indices is None:
            loaded |= model.load_weights([(p.name, p.values.view(p.shape))])
            continue
        staged = torch.full((math.prod(p.shape),), float("nan"), dtype=p.dtype)
        staged.index_copy_(0, p.indices.long(), p.values)
        torch.Tensor.copy_ = keep_where_nan  # type: ignore[method-assign]
        try:
            loaded |= model.load_weights([(p.name, staged.view(p.shape))])
        finally:
            torch.Tensor.copy_ = plain_copy  # type: ignore[method-assign]
    return loaded


@dataclasses.dataclass
class FakeLoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def int_id(self) -> int:
        return self.lora_int_id


GIB = 1 << 30
H200 = 139 * GIB  # total memory of the device the fakes pretend to have


def install_fake_vllm(monkeypatch: pytest.MonkeyPatch, free_bytes: int = H200) -> None:
    root = types.ModuleType("vllm")
    root.LLM = FakeLLM  # type: ignore[attr-defined]
    root.SamplingParams = FakeSamplingParams  # type: ignore[attr-defined]
    lora_request = types.ModuleType("vllm.lora.request")
    lora_request.LoRARequest = FakeLoRARequest  # type: ignore[attr-defined]
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.RequestOutputKind = types.SimpleNamespace(FINAL_ONLY="final_only")  # type: ignore[attr-defined]
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMValidationError = VLLMValidationError  # type: ignore[attr-defined]
    patch_loader = types.ModuleType("vllm.model_executor.model_loader.checkpoint_weight_patch")
    patch_loader.CheckpointWeightPatch = CheckpointWeightPatch  # type: ignore[attr-defined]
    patch_loader.load_checkpoint_weight_patches = load_checkpoint_weight_patches  # type: ignore[attr-defined]
    for name, module in (("vllm", root), ("vllm.lora", types.ModuleType("vllm.lora")), ("vllm.exceptions", exceptions),
                         ("vllm.lora.request", lora_request), ("vllm.sampling_params", sampling_params),
                         ("vllm.model_executor", types.ModuleType("vllm.model_executor")),
                         ("vllm.model_executor.model_loader", types.ModuleType("vllm.model_executor.model_loader")),
                         ("vllm.model_executor.model_loader.checkpoint_weight_patch", patch_loader)):
        monkeypatch.setitem(sys.modules, name, module)
    # The device's memory, the CUDA edge: (free, total) of the process's cuda:0.
    monkeypatch.setattr(vllm_sampler, "_device_memory", lambda: (free_bytes, H200))
