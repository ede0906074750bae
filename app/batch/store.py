"""The durable side of batch jobs: file and batch metadata in SQLite (WAL), file bodies in a
directory beside it (on a cluster: a shared path every ingress and the BatchJobs actor see).

Every process that serves `/v1/files` or `/v1/batches`, and the batch runner, opens its own
`BatchStore` on the same directory; SQLite serialises the writers. Results are the heart of
"exactly once": a line's result is a row keyed by (batch, custom_id), inserted once
(`record_result` says whether this call inserted it) together with the batch's counts, in
one transaction; output and error files are written from those rows when the batch ends. A
runner that dies mid-batch loses only lines whose rows were not committed, and runs exactly
those again.

Owners: every row carries the API key's owner id ("" when keys are off); reads filter by it,
so one key never sees another's files or batches.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# OpenAI's batch statuses; the first four are the runner's to move on.
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("failed", "completed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, lines INTEGER NOT NULL, created_at INTEGER NOT NULL,
    path TEXT NOT NULL, deleted INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL,
    created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, total INTEGER NOT NULL,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    times TEXT NOT NULL DEFAULT '{}', output_file_id TEXT, error_file_id TEXT,
    metadata TEXT, errors TEXT
);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line INTEGER NOT NULL,
    ok INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, created_at, id);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at, id);
"""


@dataclass(slots=True, frozen=True)
class FileRow:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    lines: int
    created_at: int
    path: str


@dataclass(slots=True, frozen=True)
class BatchRow:
    id: str
    owner: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    total: int
    completed: int
    failed: int
    times: dict[str, int] = field(default_factory=dict)  # in_progress_at, completed_at, …
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None


class FileInUse(Exception):
    """A file an active batch reads cannot be deleted."""

    def __init__(self, file_id: str, batch_id: str) -> None:
        super().__init__(f"file {file_id} is the input of active batch {batch_id}")
        self.file_id = file_id
        self.batch_id = batch_id


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.files_dir = self.directory / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.directory / "batches.sqlite3",
            timeout=30.0,
            isolation_level=None,  # explicit transactions only
            check_same_thread=False,
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- files ---------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / f"{file_id}.jsonl"

    def add_file(
        self, file_id: str, owner: str, filename: str, purpose: str, size: int, lines: int
    ) -> FileRow:
        row = FileRow(
            file_id,
            owner,
            filename,
            purpose,
            size,
            lines,
            int(time.time()),
            str(self.file_path(file_id)),
        )
        with self._tx() as db:
            db.execute(
                "INSERT INTO files (id, owner, filename, purpose, bytes, lines, created_at, path)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (row.id, owner, filename, purpose, size, lines, row.created_at, row.path),
            )
        return row

    def get_file(self, file_id: str, owner: str) -> FileRow | None:
        rows = self._query(
            "SELECT id, owner, filename, purpose, bytes, lines, created_at, path FROM files"
            " WHERE id = ? AND owner = ? AND deleted = 0",
            (file_id, owner),
        )
        return FileRow(*rows[0]) if rows else None

    def list_files(
        self, owner: str, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileRow], bool]:
        """Newest first, `limit` of them after the file `after`; and whether more follow."""
        sql = (
            "SELECT id, owner, filename, purpose, bytes, lines, created_at, path FROM files"
            " WHERE owner = ? AND deleted = 0"
        )
        args: list[Any] = [owner]
        if purpose:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM files WHERE id = ?)"
            args.append(after)
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        args.append(limit + 1)
        rows = [FileRow(*r) for r in self._query(sql, tuple(args))]
        return rows[:limit], len(rows) > limit

    def delete_file(self, file_id: str, owner: str) -> bool:
        """True once deleted, False when the owner has no such file; `FileInUse` while an
        active batch reads it (the file is kept: that batch still needs its lines)."""
        marks = ", ".join("?" * len(ACTIVE))
        with self._tx() as db:
            reader = db.execute(
                f"SELECT id FROM batches WHERE input_file_id = ? AND status IN ({marks})"
                " ORDER BY created_at LIMIT 1",
                (file_id, *ACTIVE),
            ).fetchone()
            deleted = db.execute(
                "UPDATE files SET deleted = 1 WHERE id = ? AND owner = ? AND deleted = 0",
                (file_id, owner),
            ).rowcount
            if deleted and reader is not None:
                raise FileInUse(file_id, str(reader[0]))  # the transaction rolls back
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # -- batches -------------------------------------------------------------------------------

    _BATCH_COLUMNS = (
        "id, owner, input_file_id, endpoint, completion_window, status, created_at, expires_at,"
        " total, completed, failed, times, output_file_id, error_file_id, metadata, errors"
    )

    @staticmethod
    def _batch(row: tuple[Any, ...]) -> BatchRow:
        (rid, owner, file_id, endpoint, window, status, created, expires, total, completed,
         failed, times, out_id, err_id, metadata, errors) = row  # fmt: skip
        return BatchRow(
            rid,
            owner,
            file_id,
            endpoint,
            window,
            status,
            created,
            expires,
            total,
            completed,
            failed,
            times=json.loads(times),
            output_file_id=out_id,
            error_file_id=err_id,
            metadata=json.loads(metadata) if metadata else None,
            errors=json.loads(errors) if errors else None,
        )

    def add_batch(
        self,
        owner: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        window_s: int,
        total: int,
        metadata: dict[str, str] | None,
    ) -> BatchRow:
        now = int(time.time())
        batch_id = new_id("batch")
        with self._tx() as db:
            db.execute(
                f"INSERT INTO batches ({self._BATCH_COLUMNS}) VALUES"
                " (?, ?, ?, ?, ?, 'validating', ?, ?, ?, 0, 0, '{}', NULL, NULL, ?, NULL)",
                (
                    batch_id,
                    owner,
                    input_file_id,
                    endpoint,
                    completion_window,
                    now,
                    now + window_s,
                    total,
                    json.dumps(metadata) if metadata else None,
                ),
            )
        batch = self.get_batch(batch_id, owner)
        assert batch is not None
        return batch

    def get_batch(self, batch_id: str, owner: str | None) -> BatchRow | None:
        """`owner` None: any owner (the runner's view)."""
        sql = f"SELECT {self._BATCH_COLUMNS} FROM batches WHERE id = ?"
        args: tuple[Any, ...] = (batch_id,)
        if owner is not None:
            sql += " AND owner = ?"
            args = (batch_id, owner)
        rows = self._query(sql, args)
        return self._batch(rows[0]) if rows else None

    def list_batches(
        self, owner: str, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]:
        sql = f"SELECT {self._BATCH_COLUMNS} FROM batches WHERE owner = ?"
        args: list[Any] = [owner]
        if after:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
            args.append(after)
        sql += " ORDER BY created_at DESC, id DESC LIMIT ?"
        args.append(limit + 1)
        rows = [self._batch(r) for r in self._query(sql, tuple(args))]
        return rows[:limit], len(rows) > limit

    def active_batches(self) -> list[BatchRow]:
        marks = ", ".join("?" * len(ACTIVE))
        rows = self._query(
            f"SELECT {self._BATCH_COLUMNS} FROM batches WHERE status IN ({marks})"
            " ORDER BY created_at, id",
            ACTIVE,
        )
        return [self._batch(r) for r in rows]

    def set_status(
        self, batch_id: str, status: str, *, only_from: tuple[str, ...] = (), **fields: Any
    ) -> bool:
        """Move a batch to `status` (stamping `<status>_at`), optionally only from the
        statuses in `only_from`; `fields` may set output_file_id, error_file_id, errors."""
        with self._tx() as db:
            row = db.execute(
                "SELECT status, times FROM batches WHERE id = ?", (batch_id,)
            ).fetchone()
            if row is None or (only_from and row[0] not in only_from):
                return False
            times = json.loads(row[1])
            times.setdefault(f"{status}_at", int(time.time()))
            sets = ["status = ?", "times = ?"]
            args: list[Any] = [status, json.dumps(times)]
            for name in ("output_file_id", "error_file_id"):
                if name in fields:
                    sets.append(f"{name} = ?")
                    args.append(fields[name])
            if "errors" in fields:
                sets.append("errors = ?")
                args.append(json.dumps(fields["errors"]))
            db.execute(f"UPDATE batches SET {', '.join(sets)} WHERE id = ?", (*args, batch_id))
        return True

    # -- results -------------------------------------------------------------------------------

    def record_result(
        self, batch_id: str, line: int, custom_id: str, ok: bool, body: dict[str, Any]
    ) -> bool:
        """Store one line's result; False (and nothing changes) when it was stored before."""
        with self._tx() as db:
            inserted = db.execute(
                "INSERT OR IGNORE INTO results (batch_id, custom_id, line, ok, body)"
                " VALUES (?, ?, ?, ?, ?)",
                (batch_id, custom_id, line, int(ok), json.dumps(body, separators=(",", ":"))),
            ).rowcount
            if inserted:
                column = "completed" if ok else "failed"
                db.execute(f"UPDATE batches SET {column} = {column} + 1 WHERE id = ?", (batch_id,))
        return bool(inserted)

    def done_custom_ids(self, batch_id: str) -> set[str]:
        rows = self._query("SELECT custom_id FROM results WHERE batch_id = ?", (batch_id,))
        return {r[0] for r in rows}

    def results(self, batch_id: str, ok: bool) -> Iterator[str]:
        """The stored result lines of one kind, in input order."""
        rows = self._query(
            "SELECT body FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
            (batch_id, int(ok)),
        )
        for (body,) in rows:
            yield body
