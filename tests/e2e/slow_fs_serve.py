"""`openrld serve` on a slow filesystem: checkpoint deletion and manifest writes take SLOW_FS_S each.

Run as `python tests/e2e/slow_fs_serve.py serve ARGS...` (test_slow_filesystem.py starts it
through conftest's Daemon). It wraps the two filesystem edges the store uses, then runs the
CLI unchanged: `shutil.rmtree` (a checkpoint's deletion removes its directory with it) and
the store's `write_manifest` (every commit, publish and TTL change writes one). The delay is
a sleep, which holds no CPU and no GIL, as a slow NFS or FUSE call does.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

SLOW_FS_S = float(os.environ.get("SLOW_FS_S", "2.0"))


def _slowed(fn):
    def slow(*args, **kwargs):
        time.sleep(SLOW_FS_S)
        return fn(*args, **kwargs)

    return slow


def main() -> int:
    import openrld.store.checkpoint_files
    from openrld import cli

    shutil.rmtree = _slowed(shutil.rmtree)
    openrld.store.checkpoint_files.write_manifest = _slowed(openrld.store.checkpoint_files.write_manifest)
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
