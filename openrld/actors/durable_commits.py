"""Durable commits, as a group: the one place the node waits for its database to reach the disk.

The store's connections commit without an fsync (store/database.py), so a
commit on the event loop waits on no disk. A caller whose row must outlive the
node (a session, a run, a checkpoint) then awaits `durable()` before it
answers: it returns once a `Database.sync` that started after the call has
finished in a worker thread. Syncs run one at a time, and one covers every
caller that was waiting when it started, so a burst of creates costs one
fsync, not one each (the group commit of databases that sync their own log).
The maintenance loop calls it too, which checkpoints the WAL on an idle node.

It never writes a row and never decides which rows need it; the actors that
write them do.
"""

from __future__ import annotations

from collections.abc import Callable

import trio


class DurableCommits:
    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self._lock = trio.Lock()
        self._started = 0  # how many syncs have started
        self._finished = 0  # the number of the last sync to finish

    async def durable(self) -> None:
        """Return once every commit made before this call is on disk. Not cancellable midway:
        a sync under way runs to its end, since others may be waiting on it too."""
        # Any sync numbered `ticket` or later starts after this point, so it covers our commits.
        ticket = self._started + 1
        with trio.CancelScope(shield=True):
            async with self._lock:
                if self._finished >= ticket:
                    return  # a sync that started while we queued has covered us
                self._started += 1
                number = self._started
                await trio.to_thread.run_sync(self._sync)
                self._finished = number
