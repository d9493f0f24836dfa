"""Frames on a worker's socket: one message, and the raw buffers its tensors point at.

A frame on the stream:

    u32 big-endian    length of the header
    header            msgpack of `Header`: the message, where each buffer is, and
                      the ids of the peer's shared segments this end is done with
    inline buffers    their bytes, back to back, in buffer order

Buffers of `SHARED_MIN_BYTES` or more, when both ends said "shared_memory" in
their hello, travel instead in a shared segment: a memfd of the sender's, passed
with the frame's first bytes (SCM_RIGHTS), sealed against shrinking and growing.
The receiver maps it privately and reads the tensors in place; the sender copied
the bytes once. A sealed size matters: a mapping of a file that its sender could
truncate would raise SIGBUS in the daemon at the next read. A memfd without those
seals, or smaller than the header states, is refused.

Segments are reused, since fresh shared memory costs more than the copy into it
(on a 2-core VM, 2.1 GiB/s into new tmpfs pages against 9.4 GiB/s into warm
ones). The sender lends a segment to one frame; the receiver gives it back (its
id in a later header's `released`) once every tensor over its mapping is gone,
and only then does the sender write into it again. A peer that gives back a
segment early, or writes into one it lent, harms only the tensors of its own
frames, never the daemon's memory safety.

Why by hand: no library frames msgpack with out-of-band buffers and file
descriptors over a Unix socket; multiprocessing's Connection pickles, and a
worker may run code the operator did not write.

Everything a frame states is checked against `Limits` before any byte of it
is read into memory, and any breach is a `ProtocolError`: the caller fails
that worker and only that worker.
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import socket
import struct
import threading
import weakref
from collections import deque
from collections.abc import Sequence

import msgspec

from openrld.worker.protocol import Message

SHARED_MIN_BYTES = 256 * 1024  # below this, one more syscall and a mapping cost more than the copy
_LENGTH = struct.Struct(">I")
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
SEGMENT_ROUND = 2**20  # segments come in whole MiB, so that one fits the next frame of about the same size
KEEP_FREE_SEGMENTS = 2  # idle segments kept for reuse; more are unmapped
_MAX_FDS_PER_READ = 8
_MAX_WAITING_FDS = 2


class ProtocolError(Exception):
    """The peer broke the protocol: a frame too large, malformed, or not what was due."""


class Limits(msgspec.Struct, frozen=True):
    max_header_bytes: int = 16 * 2**20  # msgpack of the message itself; tensors are buffers
    max_buffers: int = 65536
    max_frame_bytes: int = 64 * 2**30  # every buffer of one frame: a large model's full weights


class BufferSpec(msgspec.Struct, frozen=True, array_like=True):
    nbytes: int
    offset: int = -1  # -1: inline, in order; else where it starts in the frame's shared segment


class Header(msgspec.Struct, frozen=True):
    message: Message
    buffers: list[BufferSpec] = []
    shared_bytes: int = 0  # the bytes of the frame's shared segment it uses; 0: it has none
    segment: int = 0  # the sender's id of that segment, which the receiver gives back when done
    released: list[int] = []  # ids of the receiver's segments that the sender is done with


class _Segment:
    """A memfd of ours, mapped for writing, lent to one frame at a time."""

    def __init__(self, ident: int, size: int) -> None:
        self.ident, self.size = ident, size
        self.fd = os.memfd_create("openrld-frame", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            self.mapping = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise

    def fill(self, buffers: list[memoryview]) -> None:
        view, offset = memoryview(self.mapping), 0
        for buffer in buffers:
            view[offset : offset + buffer.nbytes] = buffer
            offset += buffer.nbytes
        view.release()

    def close(self) -> None:
        self.mapping.close()
        os.close(self.fd)


class _SegmentPool:
    """The segments this end lends: each busy from its frame until the peer gives it back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._busy: dict[int, _Segment] = {}
        self._free: list[_Segment] = []

    def lend(self, nbytes: int) -> _Segment:
        with self._lock:
            fits = [s for s in self._free if nbytes <= s.size <= 2 * nbytes + SEGMENT_ROUND]
            if fits:
                segment = min(fits, key=lambda s: s.size)
                self._free.remove(segment)
            else:
                segment = _Segment(self._next, -(-nbytes // SEGMENT_ROUND) * SEGMENT_ROUND)
                self._next += 1
            self._busy[segment.ident] = segment
            return segment

    def give_back(self, idents: list[int]) -> None:
        """The peer is done with these; an id that is not lent is ignored."""
        with self._lock:
            for ident in idents:
                segment = self._busy.pop(ident, None)
                if segment is not None:
                    self._free.append(segment)
            while len(self._free) > KEEP_FREE_SEGMENTS:
                self._free.pop(0).close()

    def close(self) -> None:
        with self._lock:
            for segment in [*self._busy.values(), *self._free]:
                segment.close()
            self._busy.clear()
            self._free.clear()


_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)


class FrameSocket:
    """Sends and receives frames on a connected Unix stream socket.

    `send` may be called from several threads (a worker's heartbeats and its
    results): one frame goes out whole. `receive` is for one thread at a time.
    """

    def __init__(self, sock: socket.socket, limits: Limits = Limits(), *, shared_memory: bool = False) -> None:
        self.sock = sock
        self.limits = limits
        self.shared_memory = shared_memory  # set once both ends said they can
        self._send_lock = threading.Lock()
        self._pending = bytearray()  # bytes read past the last frame
        self._fds: deque[int] = deque()  # received with those bytes, in order
        self._segments = _SegmentPool()  # what this end lends to its frames
        # The peer's segments this end is done with, to say so in the next frame sent; appended
        # to when the last tensor over one is collected, from whichever thread drops it.
        self._done_with: deque[int] = deque()

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()
        self._segments.close()  # a mapping the peer still holds stays valid: it has its own

    # ------------------------------------------------------------ sending

    def send(self, message: Message, buffers: Sequence[memoryview] = ()) -> None:
        buffers = [b.cast("B") if b.format != "B" or b.ndim != 1 else b for b in buffers]
        shared = [b for b in buffers if self.shared_memory and b.nbytes >= SHARED_MIN_BYTES]
        specs, inline, offset = [], [], 0
        for buffer in buffers:
            if shared and any(buffer is s for s in shared):
                specs.append(BufferSpec(buffer.nbytes, offset))
                offset += buffer.nbytes
            else:
                specs.append(BufferSpec(buffer.nbytes))
                inline.append(buffer)
        segment = self._segments.lend(offset) if shared else None
        try:
            if segment is not None:
                segment.fill(shared)
            with self._send_lock:
                released = [self._done_with.popleft() for _ in range(len(self._done_with))]
                header = Header(message, specs, offset, segment.ident if segment else 0, released)
                encoded = _header_encoder.encode(header)
                first = _LENGTH.pack(len(encoded)) + encoded
                if segment is None:
                    self.sock.sendall(first)
                else:
                    sent = socket.send_fds(self.sock, [first], [segment.fd])
                    if sent < len(first):
                        self.sock.sendall(first[sent:])
                for buffer in inline:
                    self.sock.sendall(buffer)
        except BaseException:
            if segment is not None:  # never reached the peer, or the connection is gone: no one holds it
                self._segments.give_back([segment.ident])
            raise

    # ------------------------------------------------------------ receiving

    def receive(self, timeout: float | None = None) -> tuple[Message, list[memoryview]]:
        """The next frame. Raises EOFError when the peer closed, TimeoutError past
        `timeout` seconds with no complete frame, ProtocolError on a bad frame."""
        self.sock.settimeout(timeout)
        size = _LENGTH.unpack(self._read_exact(_LENGTH.size))[0]
        if size > self.limits.max_header_bytes:
            raise ProtocolError(f"frame header of {size} bytes is over the limit of {self.limits.max_header_bytes}")
        try:
            header = _header_decoder.decode(self._read_exact(size))
        except msgspec.ValidationError as error:
            raise ProtocolError(f"malformed frame header: {error}") from None
        except msgspec.DecodeError as error:
            raise ProtocolError(f"malformed frame header: {error}") from None
        self._check(header)
        self._segments.give_back(header.released)
        shared = self._take_shared(header.shared_bytes, header.segment) if header.shared_bytes else None
        buffers = []
        for spec in header.buffers:
            if spec.offset >= 0:
                if shared is None or spec.offset + spec.nbytes > header.shared_bytes:
                    raise ProtocolError("a shared buffer lies outside the frame's shared memory")
                buffers.append(shared[spec.offset : spec.offset + spec.nbytes])
            else:
                buffers.append(memoryview(self._read_exact(spec.nbytes)))
        return header.message, buffers

    def _check(self, header: Header) -> None:
        limits = self.limits
        if len(header.buffers) > limits.max_buffers:
            raise ProtocolError(f"{len(header.buffers)} buffers in one frame; the limit is {limits.max_buffers}")
        if any(spec.nbytes < 0 or spec.offset < -1 for spec in header.buffers) or header.shared_bytes < 0:
            raise ProtocolError("a negative buffer size or offset")
        inline = sum(spec.nbytes for spec in header.buffers if spec.offset < 0)
        if inline + header.shared_bytes > limits.max_frame_bytes:
            raise ProtocolError(
                f"a frame of {inline + header.shared_bytes} bytes is over the limit of {limits.max_frame_bytes}"
            )
        if header.shared_bytes and not self.shared_memory:
            raise ProtocolError("shared memory was used but not agreed in the hello")

    def _take_shared(self, nbytes: int, segment: int) -> memoryview:
        if not self._fds:
            raise ProtocolError("the frame announced shared memory but carried no file descriptor")
        fd = self._fds.popleft()
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise ProtocolError("the shared memory is not a sealable memfd") from None
            if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
                raise ProtocolError("the shared memory is not sealed against shrinking and growing")
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ProtocolError(f"the shared memory holds {size} bytes, and the frame uses {nbytes}")
            # Private and writable: the receiver may use the tensors in place (copy on write).
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # When the last tensor over it is gone, the segment goes back to its sender.
        weakref.finalize(mapping, self._done_with.append, segment)
        return memoryview(mapping)

    def _read_exact(self, n: int) -> bytearray:
        out = bytearray(n)
        view = memoryview(out)
        got = min(n, len(self._pending))
        view[:got] = self._pending[:got]
        del self._pending[:got]
        while got < n:
            if n - got >= 65536:  # large: straight into place
                count = self._recv_into(view[got:])
            else:
                chunk = bytearray(65536)
                count = self._recv_into(memoryview(chunk))
                take = min(count, n - got)
                view[got : got + take] = chunk[:take]
                self._pending += chunk[take:count]
                count = take
            got += count
        return out

    def _recv_into(self, view: memoryview) -> int:
        fds = array.array("i")
        try:
            count, ancillary, flags, _ = self.sock.recvmsg_into(
                [view], socket.CMSG_SPACE(_MAX_FDS_PER_READ * fds.itemsize)
            )
        except TimeoutError:
            raise TimeoutError("no frame from the peer in time") from None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        self._fds.extend(fds)
        # A read may run into the next frame, and bring its descriptor early; more than a
        # few waiting means descriptors that no frame announces: refused, never kept.
        if flags & socket.MSG_CTRUNC or len(self._fds) > _MAX_WAITING_FDS:
            self._close_fds()
            raise ProtocolError("too many file descriptors in one message")
        if count == 0:
            raise EOFError("the peer closed the connection")
        return count

    def _close_fds(self) -> None:
        while self._fds:
            os.close(self._fds.popleft())

