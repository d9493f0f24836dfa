"""Workers: engines outside the daemon's interpreter, behind one protocol (docs/worker-protocol.md).

The worker's side (`server.serve`, the base classes of `base.py`, and
`python -m openrld.worker` for the built-in engines) imports neither trio nor the
daemon, so a custom trainer or sampler image needs only this package and its
engine. The daemon's side is `client.py` (an engine whose calls go over the
protocol) and `launchers/` (where a worker runs: a process, a torchrun group, a
container, a Pod).
"""
