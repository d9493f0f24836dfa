"""Training-run rows: a training client's model id, base model, LoRA config, settings and owner.

It owns the `runs` table: creating a run (or inserting one adopted from a
checkpoint's manifest), listing an owner's runs, and each run's last request
time. Run ids pass `ids.validate_name`, since they become directory names.
It never touches checkpoint files.
"""

from __future__ import annotations

import builtins
import sqlite3

from openrld.checkpoint_manifest import CheckpointManifest
from openrld.errors import NotFound
from openrld.ids import validate_name
from openrld.store import database as db
from openrld.store.database import Repository
from openrld.store.rows import JsonScalar, RunRow

_INSERT = (
    "INSERT INTO runs (run_id, session_id, owner, base_model, model_dir, lora, settings,"
    " user_metadata, optimizer_config, created_us, last_request_us)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


class RunRepository(Repository):
    def create(
        self,
        run_id: str,
        session_id: str,
        owner: str,
        base_model: str,
        model_dir: str,
        lora: dict[str, JsonScalar] | None,
        settings: dict[str, JsonScalar],
        user_metadata: dict[str, str],
        optimizer_config: dict[str, JsonScalar],
    ) -> RunRow:
        """Record a new training run. Raises Conflict if the id is taken, BadRequest if it is unsafe."""
        validate_name(run_id, "run id")
        now_us = db.to_us(self._db.now())
        self._insert_new(
            _INSERT,
            (
                run_id, session_id, owner, base_model, str(model_dir),
                None if lora is None else db.json(lora), db.json(settings),
                db.user_metadata(user_metadata, "training run"), db.json(optimizer_config), now_us, now_us,
            ),
            f"training run {run_id!r}",
        )  # fmt: skip
        row = self.get(run_id)
        assert row is not None
        return row

    def insert_from_manifest(self, manifest: CheckpointManifest) -> None:
        """The run's row as a checkpoint's manifest describes it (adoption.py, inside its transaction)."""
        self._db.conn.execute(
            _INSERT,
            (
                manifest.run_id, manifest.session_id, manifest.owner, manifest.base_model, manifest.model_dir,
                None if manifest.lora is None else db.json(manifest.lora), db.json(manifest.settings),
                db.json(manifest.run_user_metadata), db.json(manifest.optimizer_config),
                db.to_us(manifest.run_created_at), db.to_us(manifest.created_at),
            ),
        )  # fmt: skip

    def get(self, run_id: str) -> RunRow | None:
        row = self._db.one("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        return None if row is None else _run_row(row)

    def list(
        self, owner: str, limit: int, offset: int, *, accessible: bool = False, every_owner: bool = False
    ) -> tuple[list[RunRow], int]:
        """A page of `owner`'s runs, newest first, and how many there are in all.

        With `accessible`, other users' runs that have a published checkpoint count too;
        with `every_owner` (an operator's view), every run does.
        """
        limit, offset = db.page(limit, offset)
        where = "owner = ?"
        if every_owner:
            where = "(owner = ? OR 1 = 1)"  # keeps the one parameter the queries below pass
        elif accessible:
            where += " OR run_id IN (SELECT run_id FROM checkpoints WHERE public = 1)"
        rows = self._db.conn.execute(
            f"SELECT * FROM runs WHERE {where} ORDER BY created_us DESC, rowid DESC LIMIT ? OFFSET ?",
            (owner, limit, offset),
        )
        page = [_run_row(row) for row in rows]
        return page, self._db.count(f"SELECT count(*) FROM runs WHERE {where}", (owner,))

    def touch(self, run_id: str) -> None:
        """Set the run's last_request_time to now. Raises NotFound for an unknown run.

        On the request log's connection, and no caller awaits a sync for it: a time that lags
        by the last few requests after a power loss is harmless, and this runs on every request.
        """
        updated = self._db.log.execute(
            "UPDATE runs SET last_request_us = ? WHERE run_id = ?", (db.to_us(self._db.now()), run_id)
        ).rowcount
        if updated == 0:
            raise NotFound(f"training run {run_id!r} not found")

    def of_session(self, session_id: str) -> builtins.list[str]:  # `list` in this class is the method above
        """The session's run ids, in creation order."""
        rows = self._db.conn.execute(
            "SELECT run_id FROM runs WHERE session_id = ? ORDER BY created_us, rowid", (session_id,)
        )
        return [row[0] for row in rows]

    def base_models(self) -> builtins.list[str]:
        """Every base model name a run or a sampling session here was created on, sorted, each once."""
        rows = self._db.conn.execute("SELECT base_model FROM runs UNION SELECT base_model FROM samplers ORDER BY 1")
        return [row[0] for row in rows]


def _run_row(row: sqlite3.Row) -> RunRow:
    return RunRow(
        run_id=row["run_id"],
        session_id=row["session_id"],
        owner=row["owner"],
        base_model=row["base_model"],
        model_dir=row["model_dir"],
        lora=None if row["lora"] is None else db.decode_json_dict(row["lora"]),
        settings=db.decode_json_dict(row["settings"]),
        user_metadata=db.decode_str_dict(row["user_metadata"]),
        optimizer_config=db.decode_json_dict(row["optimizer_config"]),
        created_at=db.at(row["created_us"]),
        last_request_at=db.at(row["last_request_us"]),
        corrupted=bool(row["corrupted"]),
    )
