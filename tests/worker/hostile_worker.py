"""A worker that breaks the protocol on purpose, one way per OPENRLD_TEST_HOSTILE mode.

It stands for a custom image the operator did not write: the daemon must fail its
job with a clear error, and serve on.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import sys
import time

import msgspec

from openrld.worker import values
from openrld.worker.frames import FrameSocket, Header
from openrld.worker.protocol import PROTOCOL_VERSION, Call, Hello, Ready, Result, Start

MODE = os.environ["OPENRLD_TEST_HOSTILE"]


class Evil:
    def __reduce__(self):
        return (os.system, ("touch " + os.environ.get("OPENRLD_TEST_PWNED", "/tmp/openrld-pwned"),))


def raw_frame(sock: socket.socket, header: bytes, tail: bytes = b"") -> None:
    sock.sendall(struct.pack(">I", len(header)) + header + tail)


def main() -> None:
    if MODE == "exit_early":
        sys.exit(3)
    if MODE == "never_connect":
        time.sleep(3600)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["OPENRLD_WORKER_SOCKET"])
    frames = FrameSocket(sock)
    token = os.environ["OPENRLD_WORKER_TOKEN"]
    role = os.environ["OPENRLD_WORKER_ROLE"]
    if MODE == "never_hello":
        time.sleep(3600)
    if MODE == "bad_token":
        frames.send(Hello(PROTOCOL_VERSION, "not-the-token", role, os.getpid()))
        time.sleep(3600)
    if MODE == "old_version":
        frames.send(Hello(PROTOCOL_VERSION + 41, token, role, os.getpid()))
        time.sleep(3600)
    if MODE == "pickle_hello":
        raw_frame(sock, pickle.dumps(Evil()))
        time.sleep(3600)
    frames.send(Hello(PROTOCOL_VERSION, token, role, os.getpid(), ["shared_memory"]))
    start, _ = frames.receive()
    assert isinstance(start, Start)
    frames.shared_memory = start.shared_memory
    if MODE == "build_fails":
        from openrld.worker.protocol import Failure

        frames.send(Failure(0, "fault", "RuntimeError: no such model in this image"))
        time.sleep(3600)
    frames.send(Ready())
    call, _ = frames.receive()
    assert isinstance(call, Call)
    answer(sock, frames, call)
    time.sleep(3600)


def answer(sock: socket.socket, frames: FrameSocket, call: Call) -> None:
    """The answer to the first call, broken as MODE says."""
    if MODE == "die_in_call":
        os._exit(9)
    if MODE == "hang_in_call":
        time.sleep(3600)
    if MODE == "garbage_header":
        raw_frame(sock, b"\xc1\xc1 not msgpack at all")
    elif MODE == "oversized_header":
        sock.sendall(struct.pack(">I", 2**31))
    elif MODE == "oversized_buffer":
        header = msgspec.msgpack.encode(Header(Result(call.id, msgspec.Raw(b"\xc0")), [values_spec(2**40)]))
        raw_frame(sock, header)
    elif MODE == "pickle_result":
        frames.send(Result(call.id, msgspec.Raw(msgspec.msgpack.encode(pickle.dumps(Evil())))))
    elif MODE in ("wrong_shape", "wrong_dtype", "bad_buffer_index"):
        import numpy as np

        tokens = np.zeros(4, dtype=np.float32)
        ref = {"wrong_shape": (0, "float32", [5]), "wrong_dtype": (0, "complex128", [4]), "bad_buffer_index": (7, "float32", [4])}[MODE]
        ext = msgspec.msgpack.Ext(values.TENSOR_EXT, msgspec.msgpack.encode(ref))
        value = msgspec.msgpack.encode({"logprobs": [ext], "metrics": {}})
        frames.send(Result(call.id, msgspec.Raw(value)), [memoryview(tokens).cast("B")])
    elif MODE == "wrong_type":
        frames.send(Result(call.id, msgspec.Raw(msgspec.msgpack.encode({"logprobs": "lots", "metrics": 3}))))
    elif MODE == "unexpected_message":
        frames.send(Ready())
    elif MODE == "unsealed_memfd":
        fd = os.memfd_create("evil", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 4096)
        header = msgspec.msgpack.encode(Header(Result(call.id, msgspec.Raw(b"\xc0")), [values_spec(4096, 0)], 4096))
        first = struct.pack(">I", len(header)) + header
        socket.send_fds(sock, [first], [fd])
    elif MODE == "unannounced_fds":
        fds = [os.memfd_create(f"evil{i}", os.MFD_CLOEXEC) for i in range(5)]
        socket.send_fds(sock, [b"\x00"], fds)
    else:
        raise SystemExit(f"unknown mode {MODE}")


def values_spec(nbytes: int, offset: int = -1):
    from openrld.worker.frames import BufferSpec

    return BufferSpec(nbytes, offset)


if __name__ == "__main__":
    main()
