"""`SqliteBackend`: the state in one SQLite file, `<state_dir>/broker.sqlite3`.

The only module of the broker that imports `sqlite3`.

Durability. The file is in WAL mode with `synchronous=FULL`: a transaction is on disk (the WAL
fsynced) before `COMMIT` returns, so what the broker has acknowledged to a client or a node
survives a power cut, not only a crash of the process. `NORMAL` would survive a SIGKILL as
well, but a power cut could undo the last transactions, and the broker's writes are few enough
that one fsync each costs nothing that matters. Foreign keys are enforced.

Consistency. A transaction begins with `BEGIN IMMEDIATE`, which takes the file's write lock at
once: a transaction that reads and then writes sees no other writer in between, in this
process or another (a second opener waits, then fails with "database is locked").

Schema. `PRAGMA user_version` is the schema version; the write lock of the migration's
transaction keeps a second opener from migrating at the same time.

The file and its `-wal` and `-shm` are private (0600, in a 0700 folder): they hold live
deployment tokens.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

from broker.state.backend import Params, Result, Row
from broker.state.errors import ConstraintError, SchemaError, StorageError
from broker.state.permissions import create_private_file, private_dir, tighten

DB_FILENAME = "broker.sqlite3"
_MIN_SQLITE = (3, 38, 0)  # STRICT tables (3.37) and built-in JSON functions (3.38)


class SqliteBackend:
    """The SQLite file of `state_dir` (created if absent, with the folder): see the module
    docstring. SchemaError for an SQLite too old for the schema; StorageError when the file
    cannot be opened."""

    dialect = "sqlite"
    begin = "BEGIN IMMEDIATE"
    row_lock = ""
    clock = "(julianday('now') - 2440587.5) * 86400.0"  # this machine's, in ms steps

    def __init__(self, state_dir: Path) -> None:
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise SchemaError(
                f"SQLite {sqlite3.sqlite_version} is too old for the broker's state: it needs "
                f"{'.'.join(map(str, _MIN_SQLITE))} or newer"
            )
        private_dir(state_dir)
        self.path: Path | None = state_dir / DB_FILENAME
        self.location = f"file {self.path}"
        # SQLite gives the -wal and -shm files the main file's mode: create it private first.
        create_private_file(state_dir / DB_FILENAME)
        for suffix in ("-wal", "-shm"):
            tighten(state_dir / (DB_FILENAME + suffix))
        try:
            self._conn = sqlite3.connect(
                state_dir / DB_FILENAME, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as err:
            raise StorageError(f"cannot open the state {self.location}: {err}") from err
        self._conn.row_factory = _dict_row

    def execute(self, sql: str, params: Params = ()) -> Result:
        try:
            cursor = self._conn.execute(sql, params)
            rows = cursor.fetchall() if cursor.description is not None else []
        except sqlite3.IntegrityError as err:
            # STRICT tables report a value of the wrong type as one too.
            raise ConstraintError(f"the change breaks a rule of the state: {err}") from err
        except sqlite3.Error as err:
            raise StorageError(f"{type(err).__name__} on {self.location}: {err}") from err
        return Result(rows, cursor.rowcount)

    def in_transaction(self) -> bool:
        return self._conn.in_transaction

    def configure(self) -> None:
        mode = self.execute("PRAGMA journal_mode = WAL").rows[0]["journal_mode"]
        self.execute("PRAGMA synchronous = FULL")
        self.execute("PRAGMA foreign_keys = ON")
        if mode != "wal":
            raise SchemaError(
                f"the state {self.location} cannot be put in WAL mode (SQLite answered "
                f"{mode!r}); keep the state dir on a local filesystem"
            )

    def recover(self) -> None:
        """Nothing to do: a file does not drop its connection."""

    def schema_version(self) -> int:
        return int(self.execute("PRAGMA user_version").rows[0]["user_version"])

    def set_schema_version(self, version: int) -> None:
        self.execute(f"PRAGMA user_version = {int(version)}")

    def lock_schema(self) -> None:
        """Nothing to do: `BEGIN IMMEDIATE` has taken the file's write lock."""

    def run_script(self, script: str) -> None:
        for statement in _statements(script):
            self.execute(statement)

    def close(self) -> None:
        self._conn.close()


def _dict_row(cursor: sqlite3.Cursor, values: tuple[object, ...]) -> Row:
    return {column[0]: value for column, value in zip(cursor.description, values, strict=True)}


def _statements(script: str) -> Iterator[str]:
    """The statements of a migration script, one at a time (`executescript` would commit the
    transaction the script must run in)."""
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            yield pending
            pending = ""
    if pending.strip():
        yield pending  # incomplete: executing it reports the syntax error
