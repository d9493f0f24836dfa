"""`openrld serve` with three test hooks that hold a job's step where a kill is to land (test_adoption.py).

Run as `python tests/e2e/chaos_serve.py serve ARGS...` (test_adoption.py starts its workers
through conftest's Daemon) with OPENRLD_CHAOS_DIR naming a directory the test controls. For a
model id with a file of that name in it:

- `slow-optim-<model_id>`: its next optim_step is applied on the engine, then the engine thread
  holds before answering, until the daemon is killed (`optim-held-<model_id>` says it holds);
- `slow-save-<model_id>`: its next auto-save is renamed into place as a filesystem whose rename
  is not atomic does it (GCS FUSE copies, then deletes): the manifest first, then the other
  files, the copy holding halfway through the first of them until the daemon is killed
  (`save-held-<model_id>`);
- `slow-named-save-<model_id>`: its next named save (`save_state`) is written and committed, and
  its answer is never sent (`named-save-held-<model_id>`); the trainer goes on with other work.

Each hook takes its file away when it fires, so that the job's adopter (which runs this script
too) is not held. Without those files the daemon is the CLI, unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

CHAOS_DIR = Path(os.environ.get("OPENRLD_CHAOS_DIR", "/nonexistent"))
HOLD_S = 120.0  # longer than any test waits: the daemon is killed first


def _fires(hook: str, model_id: str) -> bool:
    try:
        (CHAOS_DIR / f"{hook}-{model_id}").unlink()
    except FileNotFoundError:
        return False
    return True


def _hold(marker: str, model_id: str) -> None:
    (CHAOS_DIR / f"{marker}-{model_id}").touch()
    time.sleep(HOLD_S)


class _NonAtomicRename:
    """The node's checkpoint files, but for a rename into place that copies file by file."""

    def __init__(self, files, model_id: str) -> None:
        self._files = files
        self._model_id = model_id

    @property
    def root(self) -> Path:
        return self._files.root

    def staging_dir(self) -> Path:
        return self._files.staging_dir()

    def commit_dir(self, staging: Path, final: Path, *, replace: bool = False) -> None:
        from openrld.autosave import AUTOSAVE_MANIFEST

        final.mkdir(parents=True)
        shutil.copyfile(staging / AUTOSAVE_MANIFEST, final / AUTOSAVE_MANIFEST)
        first = min(p for p in staging.iterdir() if p.name != AUTOSAVE_MANIFEST)
        data = first.read_bytes()
        (final / first.name).write_bytes(data[: len(data) // 2])  # the copy of the next file, cut short
        _hold("save-held", self._model_id)


def main() -> int:
    import openrld.autosave
    from openrld import cli
    from openrld.gpu import train_steps

    optim_step = train_steps.TrainsInPasses.optim_step

    def held_optim_step(self, name, params):
        result = optim_step(self, name, params)
        if _fires("slow-optim", name):
            _hold("optim-held", name)  # the step is applied here, and nothing has answered it
        return result

    commit_autosave = openrld.autosave.commit_autosave

    def held_commit_autosave(files, staging, manifest):
        if _fires("slow-save", manifest.model_id):
            files = _NonAtomicRename(files, manifest.model_id)
        return commit_autosave(files, staging, manifest)

    from openrld.actors import trainer

    settle = trainer.TrainerActor._settle

    def held_settle(self, op, value):
        if isinstance(op, trainer.SaveState) and _fires("slow-named-save", op.model_id):
            (CHAOS_DIR / f"named-save-held-{op.model_id}").touch()
            return  # the checkpoint is on the root and its row recorded; nothing answers it
        settle(self, op, value)

    trainer.TrainerActor._settle = held_settle
    train_steps.TrainsInPasses.optim_step = held_optim_step
    openrld.autosave.commit_autosave = held_commit_autosave
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
