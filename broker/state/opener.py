"""`open_store`: the broker's state opened where its location says, on the backend it names.

The one module that chooses a database: a `postgresql://` (or `postgres://`) URL is that
PostgreSQL database (`postgres_backend`), anything else the SQLite file of a folder
(`sqlite_backend`). It hands the opened backend to `StateStore`, which holds the state's
rules and reaches a database only through the backend it is given (import-linter checks
that the store imports no driver, directly or through another module).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from broker.state.errors import StorageError
from broker.state.postgres_backend import SCHEMES, PostgresBackend, redact
from broker.state.sqlite_backend import SqliteBackend
from broker.state.store import StateStore


def is_shared(location: str) -> bool:
    """Whether `location` names a PostgreSQL database (which several brokers can share), not
    a folder of this machine."""
    return location.startswith(SCHEMES)


def open_store(
    location: str, state_dir: Path, *, clock: Callable[[], float] = time.time
) -> StateStore:
    """Open the broker's state where `location` says: "" for the SQLite file in `state_dir`
    (`<state_dir>/broker.sqlite3`, created if absent), a `postgresql://` or `postgres://` URL
    for that PostgreSQL database (its tables created if absent), or any other text for the
    SQLite file in that folder. StorageError, quoting `location` without its password, for
    another URL scheme, a malformed URL or a server that cannot be reached; SchemaError as
    `StateStore`. Blocking."""
    if is_shared(location):
        return StateStore(PostgresBackend(location), clock=clock)
    if "://" in location:
        raise StorageError(
            f"the state {redact(location)!r} is neither a folder nor a PostgreSQL URL "
            f"({' or '.join(SCHEMES)})"
        )
    return StateStore(SqliteBackend(Path(location) if location else state_dir), clock=clock)
