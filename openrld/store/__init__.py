"""The node's durable state: an SQLite database and checkpoint directories, one module per concern.

- rows.py: the records (SessionRow, RunRow, SamplerRow, CheckpointRow, UsageRow, ...), plain Structs;
- database.py: the connections, schema and migrations, and column codecs;
- sessions.py, samplers.py, runs.py, checkpoint_rows.py, requests.py, audit.py: one repository per table;
- checkpoint_files.py: the checkpoint filesystem (layout, staging, atomic commit, fsync, recovery, containment);
- adoption.py: manifests of new checkpoints, and rows adopted from another node's on a shared root;
- data_dir.py: the data dir's lock and opening order, and `Store`, which holds one of each.

It guarantees what each module says; together: what was written before a kill
is there after a restart, requests pending at a kill read as "lost", no path
leaves the checkpoint root, and one Store per data dir at a time.
"""

from openrld.store.checkpoint_files import NODE_ID_FILE, SHARED_STAGING_DIR
from openrld.store.data_dir import Store
from openrld.store.database import DB_NAME, SCHEMA_VERSION
from openrld.store.requests import REQUEST_LOG_KEEP
from openrld.store.rows import (
    CheckpointRow,
    JsonScalar,
    RequestFinish,
    RequestState,
    RunRow,
    SamplerRow,
    SessionRow,
    StoreStatistics,
    UsageRow,
    utc_now,
)

__all__ = [
    "DB_NAME", "NODE_ID_FILE", "REQUEST_LOG_KEEP", "SCHEMA_VERSION", "SHARED_STAGING_DIR", "CheckpointRow",
    "JsonScalar", "RequestFinish", "RequestState", "RunRow", "SamplerRow", "SessionRow", "Store",
    "StoreStatistics", "UsageRow", "utc_now",
]
