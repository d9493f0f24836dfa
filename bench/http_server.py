"""The HTTP server's own cost per request: openrld's `api/http1.py` against hypercorn.

Both serve the same small ASGI app (read the body, answer 200 with a short JSON
reply) in a child process of their own; one httpx client in this process sends
the same POSTs to each over one kept-alive connection: a 600-byte JSON body and
the SDK's header set, as a `retrieve_future` or `asample` call sends them.
Server blocks alternate, so drift in this shared machine's speed hits both.

Printed figures, all measured in this run (medians over ROUNDS blocks):

    server CPU per request   (user + system time of the server process / requests)
    wall time per request    (the client's round trip)
    ratio                    hypercorn CPU per request / http1 CPU per request

Run: `.venv/bin/python bench/http_server.py` (about half a minute).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REQUESTS, ROUNDS = 1000, 5
BODY = b'{"request_id": "r-' + b"0" * 32 + b'", "padding": "' + b"x" * 540 + b'"}'
HEADERS = {
    "x-api-key": "tml-bench", "content-type": "application/json", "accept": "application/json",
    "user-agent": "AsyncTinker/Python 0.38.0", "x-stainless-lang": "python", "x-stainless-package-version": "0.38.0",
    "x-stainless-os": "Linux", "x-stainless-arch": "x64", "x-stainless-runtime": "CPython",
    "x-stainless-runtime-version": "3.11.7", "x-stainless-async": "async:asyncio", "x-stainless-retry-count": "0",
    "x-stainless-read-timeout": "45", "x-stainless-timeout": "45",
}

APP = '''
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    reply = b'{"type": "try_again", "request_id": "r-0", "queue_state": "active"}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]})
    await send({"type": "http.response.body", "body": reply})
'''

SERVERS = {
    "http1": APP + '''
import trio
from openrld.api.http1 import Server

async def run():
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(Server(app).serve, "127.0.0.1", 0, trio.Event())
        print("listening on", urls[0], flush=True)

trio.run(run)
''',
    "hypercorn": APP + '''
import trio
import hypercorn.config
import hypercorn.trio

async def run():
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(hypercorn.trio.serve, app, config)
        print("listening on", urls[0], flush=True)

trio.run(run)
''',
}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(name: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", SERVERS[name]], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        match = re.search(r"listening on (\S+)", line)
        if match:
            return proc, match.group(1)
    raise RuntimeError(f"{name} did not start")


def block(client: httpx.Client, url: str, pid: int) -> tuple[float, float]:
    """(server CPU seconds, client wall seconds) per request over REQUESTS POSTs."""
    cpu_before, start_s = cpu_seconds(pid), time.perf_counter()
    for _ in range(REQUESTS):
        reply = client.post(url + "/api/v1/retrieve_future", content=BODY, headers=HEADERS)
        assert reply.status_code == 200
    return (cpu_seconds(pid) - cpu_before) / REQUESTS, (time.perf_counter() - start_s) / REQUESTS


def main() -> None:
    servers = {name: start(name) for name in SERVERS}
    clients = {name: httpx.Client(base_url=url) for name, (_, url) in servers.items()}
    try:
        for name, (proc, url) in servers.items():
            block(clients[name], url, proc.pid)  # warm-up: imports, the connection
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in SERVERS}
        for _ in range(ROUNDS):
            for name, (proc, url) in servers.items():
                figures[name].append(block(clients[name], url, proc.pid))
    finally:
        for proc, _ in servers.values():
            proc.kill()
    median = {name: (statistics.median(c for c, _ in f), statistics.median(w for _, w in f)) for name, f in figures.items()}
    print(f"{REQUESTS} POSTs of {len(BODY)} bytes per block, one kept-alive connection, medians of {ROUNDS} blocks")
    for name, (cpu, wall) in median.items():
        print(f"{name:>9}: server CPU {cpu * 1e3:6.3f} ms/request   round trip {wall * 1e3:6.3f} ms")
    print(f"ratio (hypercorn CPU / http1 CPU per request): {median['hypercorn'][0] / median['http1'][0]:.2f}")


if __name__ == "__main__":
    main()
