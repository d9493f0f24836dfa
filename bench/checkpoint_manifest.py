"""What a checkpoint's manifest costs, as ratios against the same work without it.

Two figures, measured in one process on one filesystem (wherever the temp dir
is; an NFS or FUSE root will differ), in alternating blocks so that noise from
other work on the machine falls on both sides alike:

- `Store.commit_dir` of a 1 MiB checkpoint with its manifest (one more small
  file, written and fsynced with the rest) against the same commit without one;
- `Store.adopt_checkpoint` (read and check the manifest, insert two rows in one
  fsynced transaction) against `Store.get_checkpoint` of a row already there.

Run: python bench/checkpoint_manifest.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from openrld.ids import CheckpointKind, TinkerPath
from openrld.store import Store

RUN = "s-0123456789abcdef:train:0"
W = CheckpointKind.WEIGHTS
BLOCKS = 10
PER_BLOCK = 10
TENSOR_BYTES = 1 << 20


def _commit(store: Store, name: str, blob: bytes, *, with_manifest: bool) -> float:
    staging = store.files.staging_dir()
    (staging / "adapter_model.safetensors").write_bytes(blob)
    manifest = (
        store.adoption.manifest_for(RUN, W, name, size_bytes=len(blob), user_metadata={}, expires_at=None)
        if with_manifest
        else None
    )
    start = time.perf_counter()
    store.files.commit_dir(staging, store.files.checkpoint_dir(RUN, W, name), manifest=manifest)
    return time.perf_counter() - start


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="openrld-bench-") as tmp:
        root = Path(tmp)
        (root / "shared").mkdir()
        with (
            Store.open(root / "a", checkpoint_root=root / "shared") as a,
            Store.open(root / "b", checkpoint_root=root / "shared") as b,
        ):
            a.runs.create(
                RUN, "s-0123456789abcdef", "alice", "tiny-llama", "/models/tiny", {"rank": 4},
                {"fine_tuning_type": "lora"}, {}, {"type": "adamw"},
            )
            blob = os.urandom(TENSOR_BYTES)
            ratios: list[float] = []
            count = 0
            for _ in range(BLOCKS):
                with_manifest, without = [], []
                for _ in range(PER_BLOCK):
                    with_manifest.append(_commit(a, f"c{count}", blob, with_manifest=True))
                    without.append(_commit(a, f"c{count + 1}", blob, with_manifest=False))
                    count += 2
                ratios.append(statistics.median(with_manifest) / statistics.median(without))
            print(
                f"commit_dir with manifest / without (1 MiB checkpoint): {statistics.median(ratios):.2f} "
                f"(median of {BLOCKS} blocks; min {min(ratios):.2f}, max {max(ratios):.2f})"
            )
            adopt, read = [], []
            for index in range(0, count, 2):  # the even ones carry a manifest
                start = time.perf_counter()
                b.adoption.adopt_checkpoint(TinkerPath(RUN, W, f"c{index}"))
                adopt.append(time.perf_counter() - start)
                start = time.perf_counter()
                b.checkpoints.get(RUN, W, f"c{index}")
                read.append(time.perf_counter() - start)
            print(
                f"adopt_checkpoint / get_checkpoint of an existing row: "
                f"{statistics.median(adopt) / statistics.median(read):.0f}x (paid once per checkpoint per node)"
            )


if __name__ == "__main__":
    main()
