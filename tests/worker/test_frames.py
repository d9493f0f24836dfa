"""Frames and values on a worker's socket: what goes in comes out, bit for bit, by either path."""

from __future__ import annotations

import gc
import socket
import threading

import msgspec
import numpy as np
import pytest
import torch

from openrld.batches import ForwardBackwardResult
from openrld.worker import values
from openrld.worker.frames import SHARED_MIN_BYTES, FrameSocket
from openrld.worker.protocol import Result


@pytest.fixture(params=[False, True], ids=["inline", "shared_memory"])
def pair(request):
    a, b = socket.socketpair()
    ends = FrameSocket(a, shared_memory=request.param), FrameSocket(b, shared_memory=request.param)
    yield ends
    for end in ends:
        end.close()


def send_value(sender: FrameSocket, value, call_id: int = 1) -> None:
    """Sent from a thread: a frame larger than the socket's buffer waits for its reader."""
    encoding = values.Encoding()
    message = Result(call_id, encoding.encode(value))
    thread = threading.Thread(target=sender.send, args=(message, encoding.buffers))
    thread.start()
    SENDING.append(thread)


SENDING: list[threading.Thread] = []


def receive_value(receiver: FrameSocket, type_, **kwargs):
    message, buffers = receiver.receive(timeout=5)
    SENDING.pop(0).join()
    return values.decode(message.value, type_, buffers, **kwargs), buffers


def test_numpy_arrays_in_structs_arrive_equal(pair):
    sender, receiver = pair
    big = np.random.default_rng(0).standard_normal(SHARED_MIN_BYTES // 4 + 3).astype(np.float32)
    sent = ForwardBackwardResult(logprobs=[big, np.float32([1.5, -2.0])], metrics={"loss:sum": 0.25})
    send_value(sender, sent)
    got, _ = receive_value(receiver, ForwardBackwardResult)
    assert got.metrics == {"loss:sum": 0.25}
    assert [a.dtype for a in got.logprobs] == [np.float32, np.float32]
    assert all(np.array_equal(a, b) for a, b in zip(got.logprobs, sent.logprobs))


def test_torch_tensors_of_every_dtype_arrive_bit_identical(pair):
    sender, receiver = pair
    sent = {
        name: torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype) * (1 if dtype == torch.bool else 0.37)
        for name, dtype in [("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32), ("i64", torch.int64)]
    }
    sent["large"] = torch.randn(512, 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    send_value(sender, values.payload_of(sent))
    payload, _ = receive_value(receiver, values.WirePayload)
    got = values.local_payload(payload)
    assert sorted(got) == sorted(sent)
    for name in sent:
        assert got[name].dtype == sent[name].dtype and got[name].shape == sent[name].shape
        assert torch.equal(got[name].view(-1).view(torch.uint8), sent[name].reshape(-1).view(torch.uint8))


def test_a_large_buffer_travels_in_a_sealed_memfd_only_when_agreed(pair):
    sender, receiver = pair
    send_value(sender, np.ones(SHARED_MIN_BYTES, dtype=np.uint8))
    got, buffers = receive_value(receiver, np.ndarray)
    assert got.sum() == SHARED_MIN_BYTES
    assert isinstance(buffers[0].obj, bytearray) is (not sender.shared_memory)


def test_frames_with_and_without_memfds_keep_their_order(pair):
    sender, receiver = pair
    sizes = [SHARED_MIN_BYTES * 2, 8, SHARED_MIN_BYTES, 3]

    def send_all() -> None:
        for i, size in enumerate(sizes):
            encoding = values.Encoding()
            sender.send(Result(i, encoding.encode(np.full(size, i, dtype=np.uint8))), encoding.buffers)

    thread = threading.Thread(target=send_all)
    thread.start()
    for i, size in enumerate(sizes):
        message, buffers = receiver.receive(timeout=5)
        got = values.decode(message.value, np.ndarray, buffers)
        assert (message.id, got.shape, set(got.tolist())) == (i, (size,), {i})
    thread.join()


def test_a_host_tensor_is_forwarded_without_knowing_torch(pair):
    sender, receiver = pair
    send_value(sender, values.payload_of({"w": torch.full((3,), 2.5, dtype=torch.bfloat16)}))
    payload, _ = receive_value(receiver, values.WirePayload)
    host = payload.value["w"]
    assert (type(host).__name__, host.dtype, host.shape) == ("HostTensor", "bfloat16", (3,))
    send_value(receiver, payload)  # back the other way, as the daemon hands it to a sampler
    again, _ = receive_value(sender, values.WirePayload)
    assert torch.equal(values.local_payload(again)["w"], torch.full((3,), 2.5, dtype=torch.bfloat16))


def test_an_unknown_value_type_is_refused_when_sent():
    with pytest.raises(NotImplementedError, match="cannot send a object to or from a worker"):
        values.Encoding().encode({"x": object()})


def test_errors_cross_by_class_name_and_unknown_ones_become_faults():
    from openrld.errors import BadRequest, EngineLost

    assert values.failure_fields(BadRequest("rank too large", key="openrl.x")) == ("BadRequest", "rank too large", "openrl.x")
    assert values.failure_fields(EngineLost("gone")) == ("ServerError", "gone", None)
    assert values.failure_fields(ZeroDivisionError("boom")) == ("fault", "ZeroDivisionError: boom", None)
    assert type(values.error_from("BadRequest", "m")) is BadRequest
    assert type(values.error_from("SystemExit", "m")) is values.WorkerFault
    assert type(values.error_from("__import__('os')", "m")) is values.WorkerFault


def test_a_struct_value_that_does_not_fit_is_a_protocol_error():
    from openrld.worker.frames import ProtocolError

    with pytest.raises(ProtocolError, match="a value that does not fit its type"):
        values.decode(msgspec.msgpack.encode({"logprobs": 1}), ForwardBackwardResult, [])


@pytest.fixture
def shared_pair():
    a, b = socket.socketpair()
    ends = FrameSocket(a, shared_memory=True), FrameSocket(b, shared_memory=True)
    yield ends
    for end in ends:
        end.close()


def segments_made(end: FrameSocket) -> int:
    return end._segments._next - 1


def test_a_segment_the_receiver_still_reads_is_never_written_again(shared_pair):
    sender, receiver = shared_pair
    send_value(sender, np.full(SHARED_MIN_BYTES, 1, dtype=np.uint8))
    first, _ = receive_value(receiver, np.ndarray)
    send_value(sender, np.full(SHARED_MIN_BYTES, 2, dtype=np.uint8))
    second, _ = receive_value(receiver, np.ndarray)
    assert (set(first.tolist()), set(second.tolist()), segments_made(sender)) == ({1}, {2}, 2)


def test_a_segment_comes_back_to_its_sender_once_its_tensors_are_gone_and_is_reused(shared_pair):
    sender, receiver = shared_pair
    send_value(sender, np.full(SHARED_MIN_BYTES, 1, dtype=np.uint8))
    got, buffers = receive_value(receiver, np.ndarray)
    del got, buffers
    gc.collect()
    send_value(receiver, {"ack": 1})  # says so in its next frame
    receive_value(sender, dict)
    send_value(sender, np.full(SHARED_MIN_BYTES, 3, dtype=np.uint8))
    again, _ = receive_value(receiver, np.ndarray)
    assert (set(again.tolist()), segments_made(sender)) == ({3}, 1)


def test_giving_back_a_segment_that_was_never_lent_changes_nothing(shared_pair):
    sender, _ = shared_pair
    sender._segments.give_back([7, 0, -1])
    assert (segments_made(sender), sender._segments._free) == (0, [])
