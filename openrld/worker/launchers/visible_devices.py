"""Which GPUs a worker may see, named as the node names them.

A daemon's "cuda:i" is the i-th device the daemon itself sees. When the daemon
runs under CUDA_VISIBLE_DEVICES (a systemd unit given a slice of the node's GPUs,
a container runtime or a device plugin that sets it), its cuda:1 is the second
entry of that list, not the node's GPU 1. A worker's own CUDA_VISIBLE_DEVICES
replaces the daemon's, so it must name the devices as the daemon's list does:
indices of the node, or UUIDs (`GPU-...`, `MIG-...`), copied as they are.
Without the mapping, a worker under `CUDA_VISIBLE_DEVICES=4,5,6,7` sent to
cuda:1 would run on GPU 1, which may be another tenant's.
"""

from __future__ import annotations

from collections.abc import Sequence


def worker_visible_devices(indices: Sequence[str], inherited: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES of a worker given the daemon's devices `indices` ("0", "3").

    Args:
        indices: the daemon's own CUDA indices, in the order the worker numbers them.
        inherited: the daemon's CUDA_VISIBLE_DEVICES (None: unset, every GPU of the node
            visible under its own index).

    Raises:
        ValueError: an index that is not a number, or past the daemon's visible devices.
    """
    if not all(index.isdigit() for index in indices):
        raise ValueError(f"CUDA device indices must be numbers, got {list(indices)}")
    if inherited is None:
        return ",".join(indices)
    visible = [entry.strip() for entry in inherited.split(",") if entry.strip()]
    beyond = [index for index in indices if int(index) >= len(visible)]
    if beyond:
        raise ValueError(
            f"cuda:{beyond[0]} is past the {len(visible)} device(s) the daemon sees "
            f"(CUDA_VISIBLE_DEVICES={inherited!r})"
        )
    return ",".join(visible[int(index)] for index in indices)
