"""Sampling-session rows: which base model or checkpoint a sampling client samples from.

It owns the `samplers` table. It never touches checkpoint files.
"""

from __future__ import annotations

from openrld.store import database as db
from openrld.store.database import Repository
from openrld.store.rows import SamplerRow


class SamplerRepository(Repository):
    def create(
        self,
        sampler_id: str,
        session_id: str,
        owner: str,
        base_model: str,
        model_path: str | None,
        run_id: str | None,
    ) -> SamplerRow:
        """Record a new sampling session. Raises Conflict if the id is taken."""
        self._insert_new(
            "INSERT INTO samplers (sampler_id, session_id, owner, base_model, model_path, run_id, created_us)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (sampler_id, session_id, owner, base_model, model_path, run_id, db.to_us(self._db.now())),
            f"sampling session {sampler_id!r}",
        )
        row = self.get(sampler_id)
        assert row is not None
        return row

    def get(self, sampler_id: str) -> SamplerRow | None:
        row = self._db.one("SELECT * FROM samplers WHERE sampler_id = ?", (sampler_id,))
        if row is None:
            return None
        return SamplerRow(
            sampler_id=row["sampler_id"],
            session_id=row["session_id"],
            owner=row["owner"],
            base_model=row["base_model"],
            model_path=row["model_path"],
            run_id=row["run_id"],
            created_at=db.at(row["created_us"]),
        )

    def of_session(self, session_id: str) -> list[str]:
        """The session's sampler ids, in creation order."""
        rows = self._db.conn.execute(
            "SELECT sampler_id FROM samplers WHERE session_id = ? ORDER BY created_us, rowid", (session_id,)
        )
        return [row[0] for row in rows]
