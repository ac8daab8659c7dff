"""The seam between `StateStore` and a database: one connection, its dialect and its errors.

`StateStore` holds every rule of the state (validation, records, transactions, retention, API
key hashing) and writes its SQL once, in what SQLite and PostgreSQL both speak: `?` and
`:name` placeholders, `INSERT ... ON CONFLICT`, `RETURNING`, row values. A backend runs that
SQL on its one connection and supplies only what differs between the two:

- `execute` turns the driver's errors into ours, in one place: a broken rule of the schema (a
  constraint, a malformed value) is `ConstraintError`, anything else `StorageError`;
- `begin` and `row_lock` are how a transaction makes its read-then-write safe (SQLite: take
  the write lock at BEGIN; PostgreSQL: lock the rows read with `FOR UPDATE`);
- the schema version (where it is kept, how concurrent openers are kept from migrating at
  once) and how a migration script runs; the scripts themselves are `schema.MIGRATIONS`.

`sqlite_backend` and `postgres_backend` implement it; they are the only modules that import
a database driver. Blocking, like the store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

Row = dict[str, Any]
"""A row: column name (or alias) -> value."""

Params = Sequence[object] | Mapping[str, object]
"""Positional values for `?` placeholders, or named ones for `:name`."""


@dataclass(frozen=True, slots=True)
class Result:
    rows: list[Row]
    """Every row the statement returned (none for a change without RETURNING)."""
    rowcount: int
    """The rows a change inserted, updated or deleted (-1 where the driver cannot tell)."""


class Backend(Protocol):
    """One open connection to the state's database. Not thread-safe: `StateStore` serialises
    every call with its lock."""

    dialect: str
    """The key of this database's scripts in `schema.MIGRATIONS`."""
    location: str
    """Where the state is, for messages and logs ("file /x/broker.sqlite3", "database
    postgresql://broker:***@db/offload"): never holds a password."""
    path: Path | None
    """The SQLite file; None for a database elsewhere."""
    begin: str
    """The statement that opens a top-level transaction."""
    row_lock: str
    """Appended to a SELECT whose rows a transaction reads to change them ("" where `begin`
    has locked the whole database already)."""
    clock: str
    """An SQL expression: the database's clock, float seconds since the epoch (one clock for
    every broker sharing the database, whatever their own say)."""

    def execute(self, sql: str, params: Params = ()) -> Result:
        """Run one statement. ConstraintError when it breaks a rule of the schema,
        StorageError for any other failure of the database."""
        ...

    def in_transaction(self) -> bool:
        """Whether a transaction is open on the connection (False after the database rolled
        one back by itself, or lost the connection)."""
        ...

    def configure(self) -> None:
        """Ready an opened connection for use, once the store has checked that the schema is
        not newer than it knows (a refused database is left untouched)."""
        ...

    def recover(self) -> None:
        """Between transactions: replace a connection the database dropped, if it can."""
        ...

    def schema_version(self) -> int:
        """The schema version of the database: 0 for an empty one."""
        ...

    def set_schema_version(self, version: int) -> None:
        """Record `version`, inside the transaction of the migration that reached it."""
        ...

    def lock_schema(self) -> None:
        """Inside a migration's transaction, before the version is read: wait until no other
        opener is migrating the same database, and keep it out until the end."""
        ...

    def run_script(self, script: str) -> None:
        """Run a migration script (several statements, no parameters) in the open
        transaction."""
        ...

    def close(self) -> None:
        """Close the connection; idempotent."""
        ...
