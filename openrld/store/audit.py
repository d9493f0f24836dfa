"""The audit log and the usage ledger: what each owner did, and the tokens each session used.

It owns the `audit` table (append-only `<resource>_<action>` events with
string details) and the `usage` table (hourly token buckets per session, base
model and kind, added into). It never touches checkpoint files.
"""

from __future__ import annotations

from datetime import datetime

from openrld.store import database as db
from openrld.store.database import Repository
from openrld.store.rows import UsageRow


class AuditLog(Repository):
    def record(self, owner: str, event: str, details: dict[str, str]) -> None:
        """Append one audit event (`<resource>_<action>`) of `owner`'s."""
        self._db.conn.execute(
            "INSERT INTO audit (owner, event, details, at_us) VALUES (?, ?, ?, ?)",
            (owner, event, db.json(details), db.to_us(self._db.now())),
        )

    def events(self, owner: str, since: datetime, until: datetime) -> list[tuple[datetime, str, dict[str, str]]]:
        """`owner`'s audit events in [since, until), oldest first."""
        rows = self._db.conn.execute(
            "SELECT at_us, event, details FROM audit WHERE owner = ? AND at_us >= ? AND at_us < ? ORDER BY at_us, rowid",
            (owner, db.to_us(since), db.to_us(until)),
        )
        return [(db.at(r[0]), r[1], db.decode_str_dict(r[2])) for r in rows]


class UsageLedger(Repository):
    def add(self, rows: list[UsageRow]) -> None:
        """Add token counts into their hourly buckets (one transaction)."""
        with db.transaction(self._db.conn):
            for row in rows:
                self._db.conn.execute(
                    "INSERT INTO usage (bucket_us, session_id, owner, base_model, kind, tokens)"
                    " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (bucket_us, session_id, base_model, kind)"
                    " DO UPDATE SET tokens = tokens + excluded.tokens",
                    (db.to_us(row.bucket_start), row.session_id, row.owner, row.base_model, row.kind, row.tokens),
                )

    def of_owner(self, owner: str, since: datetime, until: datetime) -> list[UsageRow]:
        """`owner`'s hourly token counts with buckets starting in [since, until)."""
        rows = self._db.conn.execute(
            "SELECT * FROM usage WHERE owner = ? AND bucket_us >= ? AND bucket_us < ?"
            " ORDER BY bucket_us, tokens DESC",
            (owner, db.to_us(since), db.to_us(until)),
        )
        return [
            UsageRow(
                bucket_start=db.at(r["bucket_us"]), session_id=r["session_id"], owner=r["owner"],
                base_model=r["base_model"], kind=r["kind"], tokens=int(r["tokens"]),
            )
            for r in rows
        ]
