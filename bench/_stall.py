"""Hold stalled connections open against an HTTP server on loopback, for `bench/soak.py`.

Run as its own process (`python bench/_stall.py HOST PORT KEY COUNTS SPREAD_S`), so its
file descriptors and its CPU are not the bench's. COUNTS is a JSON object giving how many
connections of each kind to hold:

- `silent`: connect and send nothing;
- `slow_head`: send a request head one byte every SLOW_BYTE_S, never finishing it;
- `stalled_body`: a whole head with the valid KEY and `Content-Length: 1000000`, then no body;
- `stalled_body_bad_key`: the same with a key the server does not know.

Each connection reads what the server sends; when the server closes it (a deadline, a
refusal), it is opened again at once, so the count held stays at COUNTS. Connections
start spread over SPREAD_S seconds, the kinds interleaved, so that their deadlines do
not all fall together.
Every second a JSON line goes to stdout: connections held, closed by the server, reopened,
and the status lines the server answered, by kind. A line on stdin (or its end) stops
everything: every socket is closed by this process, a last JSON line is printed, and it exits.
"""

from __future__ import annotations

import json
import resource
import sys
from collections import Counter

import trio

SLOW_BYTE_S = 0.5
BODY_BYTES = 1_000_000
KINDS = ("silent", "slow_head", "stalled_body", "stalled_body_bad_key")


class Tally:
    def __init__(self) -> None:
        self.held = Counter()
        self.opened = Counter()  # connections established, by kind
        self.closed_by_server = Counter()  # the server ended them (EOF or reset)
        self.connect_errors = Counter()
        self.answers = Counter()  # "kind status" -> count, from the first line the server sent

    def report(self, final: bool = False) -> str:
        return json.dumps(
            {
                "final": final, "held": dict(self.held), "opened": dict(self.opened),
                "closed_by_server": dict(self.closed_by_server), "connect_errors": dict(self.connect_errors),
                "answers": dict(self.answers),
            }
        )


def head(kind: str, host: str, port: int, key: str) -> bytes:
    header_key = key if kind == "stalled_body" else "tml-not-a-key-this-node-knows"
    return (
        f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: {host}:{port}\r\nX-API-Key: {header_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {BODY_BYTES}\r\n\r\n"
    ).encode()


async def hold(kind: str, host: str, port: int, key: str, delay: float, tally: Tally) -> None:
    """One slot: keep one connection of this kind open, reopening it whenever the server closes it."""
    await trio.sleep(delay)
    request = head(kind, host, port, key)
    while True:
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            tally.connect_errors[kind] += 1
            await trio.sleep(0.1)
            continue
        tally.opened[kind] += 1
        tally.held[kind] += 1
        try:
            async with stream, trio.open_nursery() as nursery:
                if kind != "silent":
                    nursery.start_soon(send, stream, request, kind == "slow_head")
                answer = await read_until_closed(stream)
                nursery.cancel_scope.cancel()
        finally:
            tally.held[kind] -= 1
        tally.answers[f"{kind} {answer}"] += 1
        tally.closed_by_server[kind] += 1


async def read_until_closed(stream: trio.SocketStream) -> str:
    """What the server answers, until it closes: the status of its first line, "none", or "reset"."""
    first = b""
    try:
        while data := await stream.receive_some(65536):
            first = first or data
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return "reset"
    return first.split(b"\r\n", 1)[0].decode("latin-1")[9:12] if first else "none"


async def send(stream: trio.SocketStream, request: bytes, slowly: bool) -> None:
    """Send the head whole, or a byte at a time (then the server's deadline ends it long before the last byte)."""
    try:
        if not slowly:
            await stream.send_all(request)
            return
        for i in range(len(request) - 4):
            await stream.send_all(request[i : i + 1])
            await trio.sleep(SLOW_BYTE_S)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the server has closed it: the reader sees that too


async def main(host: str, port: int, key: str, counts: dict[str, int], spread_s: float) -> None:
    tally = Tally()
    async with trio.open_nursery() as nursery:
        # The kinds interleaved, so that each kind's connections, and their deadlines, spread over spread_s.
        slots = sorted((i / counts[kind], kind) for kind in KINDS for i in range(counts.get(kind, 0)))
        for index, (_, kind) in enumerate(slots):
            nursery.start_soon(hold, kind, host, port, key, spread_s * index / len(slots), tally)

        async def reporter() -> None:
            while True:
                await trio.sleep(1.0)
                print(tally.report(), flush=True)

        nursery.start_soon(reporter)
        await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
        nursery.cancel_scope.cancel()  # each `async with stream` closes its socket on the way out
    print(tally.report(final=True), flush=True)


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    trio.run(main, sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), float(sys.argv[5]))
