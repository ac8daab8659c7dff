"""`PostgresBackend`: the state in a PostgreSQL database, named by a `postgresql://` URL.

The only module of the broker that imports `psycopg` (version 3, its blocking API: the store
runs on one thread at a time, as it does on SQLite).

Durability. A transaction is durable once `COMMIT` returns, as far as the server's settings
make it so (`synchronous_commit = on`, the default, waits for the WAL flush, and for the
synchronous standbys where the server has some). A broker killed mid-transaction leaves
nothing of it: the server rolls back what the dropped connection had not committed.

Consistency. Transactions run at PostgreSQL's default isolation, READ COMMITTED; where the
store reads rows to change them it reads them with `FOR UPDATE`, so a second broker writing
the same database waits for the first instead of overwriting its change with older values.
Uniqueness and references are the schema's constraints, checked by the server whatever
another connection did meanwhile. The broker still assumes it is the database's one writer
(two brokers would both place replicas on the same GPUs): the store's consistency holds
under concurrency, the broker's decisions do not.

Schema. The version is the one row of the table `schema_version` (absent: 0). Each missing
migration runs in its own transaction, which first takes a transaction-level advisory lock
(`pg_advisory_xact_lock`): of two brokers opening an empty database at once, one migrates
and the other waits, then finds the work done.

The password never leaves the URL: `location`, errors and logs show the URL with it replaced
by `***`.
"""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path
from typing import Any

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row

from broker.state.backend import Params, Result, Row
from broker.state.errors import ConstraintError, SchemaError, StorageError

logger = logging.getLogger(__name__)

SCHEMES = ("postgresql://", "postgres://")
"""The URL schemes that name a PostgreSQL database (libpq's two spellings)."""

_MIN_SERVER = 120000  # 12: the schema needs 10 (identity columns); older is long unsupported
_CONNECT_TIMEOUT_S = 10  # unless the URL says otherwise (`?connect_timeout=`)
_SCHEMA_LOCK = 0x6564676F_66666C64  # "edgoffld": the advisory lock key of migrations

# A `?`/`:name` placeholder outside string literals, comments and `::` casts; `%` to escape.
_TOKENS = re.compile(r"'(?:[^']|'')*'|--[^\n]*|::|:(?P<name>[A-Za-z_]\w*)|(?P<q>\?)|(?P<pct>%)")
_URL_PASSWORD = re.compile(r"(://[^/?#@:]*:)[^/?#@]*@")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redact(url: str) -> str:
    """`url` with its password (in the user part or a `password=` parameter) replaced by
    `***`: what an error, a log line or a repr may show. Works on a malformed URL too."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", url))


class PostgresBackend:
    """A connection to the database `url` names (`postgresql://user:password@host:port/db`,
    or any libpq URL): see the module docstring. StorageError, quoting the URL without its
    password, when the URL is malformed or the server cannot be reached or refuses us."""

    dialect = "postgresql"
    begin = "BEGIN"
    row_lock = " FOR UPDATE"
    clock = "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)"  # the server's
    path: Path | None = None

    def __init__(self, url: str) -> None:
        self.location = f"database {redact(url)}"
        try:
            options = conninfo_to_dict(url)
        except psycopg.Error:
            # The driver's message may quote the URL, password included.
            raise StorageError(
                f"the state {self.location} is not a valid PostgreSQL URL"
            ) from None
        self._password = str(options.get("password") or "")
        self._url = url
        self._timeout: dict[str, Any] = (
            {} if "connect_timeout" in options else {"connect_timeout": _CONNECT_TIMEOUT_S}
        )
        self._conn = self._connect()

    def __repr__(self) -> str:
        return f"PostgresBackend({self.location!r})"

    def _connect(self) -> psycopg.Connection[Row]:
        try:
            return psycopg.connect(
                self._url, autocommit=True, row_factory=dict_row, **self._timeout
            )
        except psycopg.Error as err:
            # Not chained: nothing of the driver's may carry the password into a traceback.
            raise StorageError(
                f"cannot connect to the state {self.location}: {self._scrub(err)}"
            ) from None

    def _scrub(self, err: BaseException) -> str:
        text = str(err).strip()
        return text.replace(self._password, "***") if self._password else text

    def execute(self, sql: str, params: Params = ()) -> Result:
        try:
            if params:
                cursor = self._conn.execute(_pyformat(sql), params)
            else:  # no parameters: psycopg runs the text as it is (scripts, `%` included)
                cursor = self._conn.execute(sql)
            rows = cursor.fetchall() if cursor.description is not None else []
        except (psycopg.IntegrityError, psycopg.DataError) as err:
            # DataError: a value the column's type refuses ('{' as JSON, 'x' as a number).
            raise ConstraintError(
                f"the change breaks a rule of the state: {self._scrub(err)}"
            ) from err
        except psycopg.Error as err:
            raise StorageError(
                f"{type(err).__name__} on {self.location}: {self._scrub(err)}"
            ) from err
        return Result(rows, cursor.rowcount)

    def in_transaction(self) -> bool:
        status = self._conn.info.transaction_status
        return status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    def configure(self) -> None:
        version = self._conn.info.server_version
        if version < _MIN_SERVER:
            raise SchemaError(
                f"PostgreSQL {version // 10000} at {self.location} is too old for the broker's "
                f"state: it needs {_MIN_SERVER // 10000} or newer"
            )

    def recover(self) -> None:
        if not self._conn.broken:
            return
        logger.warning("state: the connection to %s was lost; connecting again", self.location)
        self._conn.close()
        self._conn = self._connect()

    def schema_version(self) -> int:
        # Not to_regclass: its catalog cache can miss a table that an opener, whose advisory
        # lock this transaction waited for, has just committed. A scan of pg_tables reads the
        # statement's snapshot.
        present = self.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables WHERE tablename = "
            "'schema_version' AND schemaname = current_schema()) AS present"
        )
        if not present.rows[0]["present"]:
            return 0
        rows = self.execute("SELECT COALESCE(MAX(version), 0) AS version FROM schema_version").rows
        return int(rows[0]["version"])

    def set_schema_version(self, version: int) -> None:
        self.execute("UPDATE schema_version SET version = ?", (version,))

    def lock_schema(self) -> None:
        self.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))

    def run_script(self, script: str) -> None:
        self.execute(script)

    def close(self) -> None:
        self._conn.close()


@functools.lru_cache(maxsize=256)
def _pyformat(sql: str) -> str:
    """`sql` with its `?` and `:name` placeholders in psycopg's spelling (`%s`,
    `%(name)s`), and a literal `%` doubled."""

    def replace(match: re.Match[str]) -> str:
        if match["name"]:
            return f"%({match['name']})s"
        if match["q"]:
            return "%s"
        if match["pct"]:
            return "%%"
        return match[0]

    return _TOKENS.sub(replace, sql)
