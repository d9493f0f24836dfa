"""Arguments and results on the wire: msgpack values, with tensors as raw buffers.

A tensor (a numpy array, a torch tensor, or a `HostTensor`) is written as the
msgpack extension value `TENSOR_EXT`: its dtype, its shape and the index of the
frame buffer that holds its bytes. Reading gives back a `HostTensor` over that
buffer (no copy), which the declared type turns into a numpy array (the plain
data of `openrld.batches`) or, on a worker, a torch tensor.

This module never imports torch: the daemon's side of a worker holds tensors
only as `HostTensor`s. It recognises a torch tensor by duck type when asked to
send one (an engine in the daemon handing its weights to a worker elsewhere).

Every value read is checked: the buffer index exists, the dtype is one of
`DTYPES`, the shape's size times the item size is the buffer's length. A value
that fails is a `ProtocolError`, as a malformed frame is.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from openrld import errors
from openrld.worker.frames import ProtocolError

TENSOR_EXT = 1
MAX_DIMS = 8

# dtype name -> item size. The names are torch's, without "torch."; numpy has all but bfloat16.
DTYPES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


class HostTensor:
    """A tensor's bytes in host memory, with its dtype and shape; torch-free."""

    __slots__ = ("dtype", "shape", "data")

    def __init__(self, dtype: str, shape: tuple[int, ...], data: memoryview) -> None:
        self.dtype, self.shape, self.data = dtype, shape, data

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def numpy(self) -> np.ndarray:
        if self.dtype == "bfloat16":
            raise ProtocolError("a bfloat16 tensor where a numpy array was due")
        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)

    def __repr__(self) -> str:
        return f"HostTensor({self.dtype}, {self.shape})"


class WirePayload(msgspec.Struct, frozen=True):
    """A trainer's weights for its sampler, opaque to the daemon: "tensors" (name -> tensor,
    a LoRA adapter or whole weights) or "weight_delta" (gpu/delta.py's WeightDelta, as a map)."""

    kind: str
    value: Any


class RequestFailure(msgspec.Struct, frozen=True):
    """One sampling request the worker refused or failed, with the rest of its batch unharmed."""

    request_id: str
    kind: str
    message: str


_header_pack = msgspec.msgpack.Encoder()
_ext_decoder = msgspec.msgpack.Decoder(tuple[int, str, list[int]])


def payload_of(value: Any) -> WirePayload:
    """An engine's sampler payload (a tensor dict, a WeightDelta, or one already on the wire)."""
    if isinstance(value, WirePayload):
        return value
    if isinstance(value, dict):
        return WirePayload("tensors", value)
    if type(value).__name__ == "WeightDelta":
        return WirePayload("weight_delta", value)
    raise TypeError(f"not a weight payload: {type(value).__name__}")


# ---------------------------------------------------------------- encoding


class Encoding:
    """One frame's worth of values: encodes them, collecting the tensors' buffers."""

    def __init__(self) -> None:
        self.buffers: list[memoryview] = []
        self._keep: list[Any] = []  # the contiguous copies the buffers point into
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._hook)

    def encode(self, value: Any) -> msgspec.Raw:
        return msgspec.Raw(self._encoder.encode(value))

    def _hook(self, obj: Any) -> Any:
        if isinstance(obj, HostTensor):
            return self._tensor(obj.dtype, obj.shape, obj.data)
        if isinstance(obj, np.ndarray):
            array = np.ascontiguousarray(obj)
            self._keep.append(array)
            # numpy's stubs give ndarray a __buffer__ only from Python 3.12; mypy checks as 3.11.
            view = memoryview(array).cast("B") if array.size else memoryview(b"")  # type: ignore[arg-type]
            return self._tensor(array.dtype.name, array.shape, view)
        if _is_torch_tensor(obj):
            return self._torch(obj)
        if isinstance(obj, Path):
            return str(obj)
        raise NotImplementedError(f"cannot send a {type(obj).__name__} to or from a worker")

    def _torch(self, tensor: Any) -> msgspec.msgpack.Ext:
        import torch  # already loaded: this is a torch tensor

        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise NotImplementedError(f"cannot send a {dtype} tensor to or from a worker")
        flat = tensor.detach().to("cpu").contiguous()
        shape = tuple(flat.shape)
        if dtype == "bfloat16":
            flat = flat.view(torch.int16)  # its bits; numpy has no bfloat16
        array = flat.reshape(-1).numpy()
        self._keep.append(array)
        return self._tensor(dtype, shape, memoryview(array).cast("B") if array.size else memoryview(b""))

    def _tensor(self, dtype: str, shape: tuple[int, ...], data: memoryview) -> msgspec.msgpack.Ext:
        self.buffers.append(data)
        return msgspec.msgpack.Ext(TENSOR_EXT, _header_pack.encode((len(self.buffers) - 1, dtype, list(shape))))


def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


# ---------------------------------------------------------------- decoding


def decode(raw: bytes | msgspec.Raw, type_: Any, buffers: list[memoryview], *, torch_tensors: bool = False) -> Any:
    """`raw` read as `type_`; tensors come back over `buffers` (numpy where the type says
    np.ndarray; with `torch_tensors`, a worker's side, torch where it says torch.Tensor or Any).

    Raises:
        ProtocolError: the value does not fit the type, or a tensor does not fit its buffer.
    """

    def ext_hook(code: int, data: memoryview) -> Any:
        if code != TENSOR_EXT:
            raise ProtocolError(f"unknown extension type {code}")
        tensor = _host_tensor(data, buffers)
        return to_torch(tensor) if torch_tensors else tensor

    def dec_hook(target: type, obj: Any) -> Any:
        if target is np.ndarray:
            if _is_torch_tensor(obj):
                return obj.numpy()
            if isinstance(obj, HostTensor):
                return obj.numpy()
        elif target is Path and isinstance(obj, str):
            return Path(obj)
        elif _is_torch_class(target) and _is_torch_tensor(obj):
            return obj
        raise msgspec.ValidationError(f"expected {getattr(target, '__name__', target)}, got {type(obj).__name__}")

    try:
        return msgspec.msgpack.decode(raw, type=type_, ext_hook=ext_hook, dec_hook=dec_hook)
    except (msgspec.ValidationError, msgspec.DecodeError, ValueError, TypeError) as error:
        raise ProtocolError(f"a value that does not fit its type: {error}") from None


def _is_torch_class(target: Any) -> bool:
    return getattr(target, "__module__", "").startswith("torch") and getattr(target, "__name__", "") == "Tensor"


def _host_tensor(data: memoryview, buffers: list[memoryview]) -> HostTensor:
    try:
        index, dtype, shape = _ext_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise ProtocolError("a malformed tensor reference") from None
    if not 0 <= index < len(buffers):
        raise ProtocolError(f"a tensor points at buffer {index}, and the frame has {len(buffers)}")
    if dtype not in DTYPES:
        raise ProtocolError(f"a tensor of unknown dtype {dtype!r}")
    if len(shape) > MAX_DIMS or any(d < 0 for d in shape):
        raise ProtocolError(f"a tensor of shape {shape}")
    buffer = buffers[index]
    if math.prod(shape) * DTYPES[dtype] != buffer.nbytes:
        raise ProtocolError(f"a {dtype} tensor of shape {shape} over a buffer of {buffer.nbytes} bytes")
    return HostTensor(dtype, tuple(shape), buffer)


def to_torch(tensor: HostTensor) -> Any:
    """A torch tensor over the host tensor's bytes (no copy where the buffer is writable)."""
    import torch

    if tensor.nbytes == 0:
        return torch.empty(tensor.shape, dtype=getattr(torch, tensor.dtype))
    data: memoryview | bytearray = tensor.data
    if tensor.data.readonly:
        data = bytearray(tensor.data)
    flat = torch.frombuffer(data, dtype=torch.int16 if tensor.dtype == "bfloat16" else getattr(torch, tensor.dtype))
    if tensor.dtype == "bfloat16":
        flat = flat.view(torch.bfloat16)
    return flat.reshape(tensor.shape)


def local_payload(payload: Any) -> Any:
    """A payload as an engine in this process takes it: torch tensors, a WeightDelta."""
    if not isinstance(payload, WirePayload):
        return payload
    if payload.kind == "tensors":
        if not isinstance(payload.value, dict):
            raise ProtocolError("a tensors payload that is not a map")
        return {str(name): _torch_value(value) for name, value in payload.value.items()}
    if payload.kind == "weight_delta":
        from openrld.gpu.delta import WeightDelta

        def dec_hook(target: type, obj: Any) -> Any:
            if _is_torch_class(target):
                return _torch_value(obj)
            raise msgspec.ValidationError(f"expected {target}")

        try:
            return msgspec.convert(payload.value, WeightDelta, dec_hook=dec_hook)
        except msgspec.ValidationError as error:
            raise ProtocolError(f"a malformed weight delta: {error}") from None
    raise ProtocolError(f"a payload of unknown kind {payload.kind!r}")


def _torch_value(value: Any) -> Any:
    if isinstance(value, HostTensor):
        return to_torch(value)
    if _is_torch_tensor(value):
        return value
    raise ProtocolError(f"a {type(value).__name__} where a tensor was due")


# ---------------------------------------------------------------- errors

# The errors a worker may report by name; anything else arrives as a WorkerFault.
_KNOWN_ERRORS: dict[str, type[errors.OpenrldError]] = {
    cls.__name__: cls
    for cls in (
        errors.BadRequest, errors.NotSupportedYet, errors.Conflict, errors.NotFound, errors.Gone,
        errors.TooManyRequests, errors.ServerError,
    )
}
_KNOWN_BUILTINS: dict[str, type[Exception]] = {"ValueError": ValueError, "KeyError": KeyError}


class WorkerFault(RuntimeError):
    """An unexpected error inside a worker's engine; the worker lives on."""


def failure_fields(error: BaseException) -> tuple[str, str, str | None]:
    """(kind, message, key) of an error, as a Failure states it."""
    if isinstance(error, errors.OpenrldError):
        # A subclass we do not map (WeightMismatch, ...) travels as its nearest known base.
        kind = next(c.__name__ for c in type(error).__mro__ if c.__name__ in _KNOWN_ERRORS or c is errors.OpenrldError)
        return kind if kind in _KNOWN_ERRORS else "ServerError", error.detail, error.key
    name = type(error).__name__
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return (name if name in _KNOWN_BUILTINS else "fault"), (
        message if name in _KNOWN_BUILTINS else f"{name}: {message}"
    ), None


def error_from(kind: str, message: str, key: str | None = None) -> Exception:
    """The exception a Failure stands for: a known class by name, else a WorkerFault."""
    cls = _KNOWN_ERRORS.get(kind)
    if cls is not None:
        return cls(message, key=key)
    builtin = _KNOWN_BUILTINS.get(kind)
    if builtin is not None:
        return builtin(message)
    return WorkerFault(message)
