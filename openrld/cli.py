"""`openrld` on the command line: `openrld serve` runs a node.

Flags override the environment's OPENRLD_* variables, which override the
config file, which overrides the defaults (`config.load_config`; the one order
the README, config/openrld.toml and tests/test_config.py state). `--port 0` lets the kernel pick a
port; the address bound is printed on stdout as `openrld listening on URL`.
SIGTERM and SIGINT shut the node down cleanly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import msgspec
import trio

from openrld import __version__
from openrld.config import ConfigError, NodeConfig, load_config, process_environment
from openrld.heap import bound_heap


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def _setup_logging(config: NodeConfig, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if config.log_json:
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("httpx", "httpcore", "quart.serving"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


async def _serve_until_signalled(config: NodeConfig) -> None:
    from openrld.daemon import serve

    stop = trio.Event()
    async with trio.open_nursery() as nursery:

        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    logging.getLogger(__name__).info("signal %s: shutting down", signal.Signals(signum).name)
                    stop.set()
                    return

        nursery.start_soon(on_signals)
        url = await nursery.start(lambda task_status: serve(config, shutdown=stop, task_status=task_status))
        print(f"openrld listening on {url}", flush=True)
        await stop.wait()
        # serve() returns once drained; on_signals has returned already.


def _serve(args: argparse.Namespace) -> int:
    overrides = {
        key: value
        for key, value in (
            ("host", args.host), ("port", args.port), ("data_dir", args.data_dir), ("device", args.device),
            ("node_name", args.node_name),
            ("join", tuple(seed.strip() for seed in args.join.split(",") if seed.strip()) if args.join else None),
        )
        if value is not None
    }
    try:
        config = load_config(args.config, overrides, process_environment())
    except ConfigError as error:
        print(f"openrld: {error}", file=sys.stderr)
        return 2
    _setup_logging(config, args.verbose)
    # What the layers (flags, OPENRLD_* variables, the file) came to; -v shows it. The secret stays out.
    shown = msgspec.structs.replace(config, cluster_secret="<set>" if config.cluster_secret else "")
    logging.getLogger(__name__).debug("config %s", msgspec.json.encode(shown, enc_hook=str).decode())
    bound_heap(os.environ)  # before the engines' threads allocate (heap.py)
    refused: list[ConfigError] = []
    try:
        trio.run(_serve_until_signalled, config)
    except* ConfigError as group:  # found while starting: the devices, the key file, the TLS files
        refused.extend(error for error in group.exceptions if isinstance(error, ConfigError))
    if refused:
        print(f"openrld: {refused[0]}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openrld", description="A self-hosted Tinker-compatible RL training service.")
    parser.add_argument("--version", action="version", version=f"openrld {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run this node's daemon")
    serve.add_argument("--host", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to bind; 0 picks a free one (default 8000)")
    serve.add_argument("--data-dir", type=Path, help="where the database and checkpoints live")
    serve.add_argument("--config", type=Path, help="a TOML config file (see config/openrld.toml)")
    serve.add_argument(
        "--device", help="auto (a GPU if usable, else the CPU), cpu, or cuda[:N] (a GPU, or refuse to start) (default auto)"
    )
    serve.add_argument("--node-name", help="this node's name in the cluster (default: the host name)")
    serve.add_argument(
        "--join", help="comma-separated HOST:PORT (or DNS names) of cluster members' APIs to join; needs cluster_secret"
    )
    serve.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    serve.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
