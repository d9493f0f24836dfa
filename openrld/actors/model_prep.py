"""Preparing the node's configured models in the background, so the first client does not wait.

At startup the daemon runs `prepare_models`: every configured GGUF model whose
conversion is not in the model cache yet is converted, one at a time, in a
worker thread, while the node already serves requests. Progress is on the
catalog's `ProgressBoard` (and so in `/openrl/v1/info`). A client that asks
for the model before it is ready waits in its `create_model` future: the
engine builder calls the same converter, which waits on the running
conversion instead of starting a second one.

It owns no state of its own, never imports torch (the converter is handed
in), and a failed conversion is logged and left on the board; it never stops
the daemon.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from openrld.errors import OpenrldError
from openrld.model_catalog import ModelCatalog, ModelEntry

logger = logging.getLogger(__name__)


async def prepare_models(
    catalog: ModelCatalog,
    ensure_files: Callable[[ModelEntry], None],
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Convert the configured models that need it; report the names it will prepare, then work.

    Args:
        catalog: the node's catalog; its `unconverted()` models are prepared.
        ensure_files: blocking; makes an entry's directory loadable (`GgufConverter.ensure`).
    """
    pending = catalog.unconverted()
    task_status.started([entry.name for entry in pending])
    for entry in pending:
        logger.info("preparing model=%s source=%s", entry.name, entry.gguf_file)
        try:
            # abandon_on_cancel: a shutdown does not wait for a minute-long conversion; its
            # staging directory is removed by the next conversion of the same file.
            await trio.to_thread.run_sync(ensure_files, entry, abandon_on_cancel=True)
        except OpenrldError as error:
            logger.warning("model=%s was not prepared: %s", entry.name, error)
