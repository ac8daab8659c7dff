"""`StateStore`: the broker's durable state in one SQLite file, `<state_dir>/broker.sqlite3`.

This module is the state's adapter: the only one in the broker that imports `sqlite3`.

Durability. The file is in WAL mode with `synchronous=FULL`: a transaction is on disk (the WAL
fsynced) before `commit` returns, so what the broker has acknowledged to a client or a node
survives a power cut, not only a crash of the process. `NORMAL` would survive a SIGKILL as
well, but a power cut could undo the last transactions, and the broker's writes (deploys,
placements, state changes, heartbeats) are few enough that one fsync each costs nothing that
matters. Every change runs in a transaction (`transaction()`), so a crash at any point leaves
each change either whole or absent. Foreign keys are enforced.

Schema. `PRAGMA user_version` is the schema version; the scripts of `schema.MIGRATIONS` that
a file lacks are applied at open, each in its own transaction with its version number. A file
of a newer schema than this broker knows is refused with `SchemaError`, untouched.

Blocking. Every method blocks on SQLite (and `put_client`/`client_for_api_key` on a ~35 ms
key hash): callers on an event loop use `asyncio.to_thread` or one single-thread executor.
One connection serves all threads (`check_same_thread=False`), serialised by a lock that a
transaction holds from BEGIN to COMMIT.

"Missing". `get_*` and `client_site` return None for an unknown id; methods that change a
row raise `KeyError` for one (`heartbeat` returns False instead: a node that heartbeats
before it registers is routine, not an error). A change that would break the schema's rules
raises `ConstraintError` with nothing written.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from broker.state import api_keys
from broker.state.errors import ConstraintError, SchemaError, StorageError
from broker.state.permissions import create_private_file, private_dir, tighten
from broker.state.records import (
    ClientRecord,
    DeploymentRecord,
    DeploymentState,
    EventRecord,
    KeyChanges,
    MigrationRecord,
    MigrationState,
    MigrationStrategy,
    MigrationTrigger,
    ModelRecord,
    NodeRecord,
    NodeState,
    OffloadCount,
    OffloadReportRecord,
    OffloadSummary,
    ResizeRecord,
    StandbyRecord,
)
from broker.state.schema import MIGRATIONS

logger = logging.getLogger(__name__)

DB_FILENAME = "broker.sqlite3"
_MIN_SQLITE = (3, 38, 0)  # STRICT tables (3.37) and built-in JSON functions (3.38)

_Record = TypeVar("_Record", DeploymentRecord, MigrationRecord)
_E = TypeVar("_E", bound=StrEnum)

_NODE_COLUMNS = (
    "node_id, address, site, state, inventory_json, runtimes_json, registered_at, "
    "last_heartbeat_at, usage_json"
)
_DEPLOYMENT_COLUMNS = (
    "deployment_id, client_id, model_sha256, model_name, request_json, priority, site, state, "
    "node_id, gpus_json, gpu_uuids_json, endpoint, token, epoch, explanation_json, reason, "
    "created_at, updated_at"
)
_MIGRATION_COLUMNS = (
    "migration_id, deployment_id, trigger, source_node, target_node, strategy, state, "
    "timeline_json, outcome, reason, downtime_ms, failed_requests, created_at, updated_at, "
    "span_gap_ms, prewarmed"
)
_RESIZE_COLUMNS = (
    "node_id, event_id, deployment_id, replica_id, cpus_before, cpus_after, policy, reason, at"
)
_OFFLOAD_COLUMNS = (
    "deployment_id, client_id, session, policy, local_model, decisions_json, remote_requests, "
    "local_requests, fallbacks, remote_estimate_ms, local_estimate_ms, remote_reachable, "
    "reported_at"
)
_OFFLOAD_KEY = ("deployment_id", "client_id", "session")


def _placeholders(columns: str) -> str:
    return ", ".join(f":{name.strip()}" for name in columns.split(","))


def _assignments(columns: str, key: str) -> str:
    names = [name.strip() for name in columns.split(",")]
    return ", ".join(f"{name} = :{name}" for name in names if name != key)


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


def _enum(cls: type[_E], value: str, what: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(member.value for member in cls)
        raise ConstraintError(f"{what} {value!r} is not one of: {valid}") from None


class StateStore:
    """The broker's durable state. Open with `StateStore(state_dir)`, `close()` when done
    (or use it as a context manager). See the module docstring for durability, blocking and
    what "missing" means."""

    def __init__(self, state_dir: Path, *, clock: Callable[[], float] = time.time) -> None:
        """Open (creating if absent) `<state_dir>/broker.sqlite3` and bring its schema up to
        date. SchemaError if the file's schema is newer than this broker knows or a migration
        fails; StorageError if the file cannot be opened as SQLite. Blocking."""
        if sqlite3.sqlite_version_info < _MIN_SQLITE:
            raise SchemaError(
                f"SQLite {sqlite3.sqlite_version} is too old for the broker's state: it needs "
                f"{'.'.join(map(str, _MIN_SQLITE))} or newer"
            )
        private_dir(state_dir)
        self.path = state_dir / DB_FILENAME
        # SQLite gives the -wal and -shm files the main file's mode: create it private first.
        create_private_file(self.path)
        for suffix in ("-wal", "-shm"):
            tighten(self.path.with_name(DB_FILENAME + suffix))
        self._clock = clock
        self._lock = threading.RLock()
        self._depth = 0  # transactions open on the connection: 0, or 1 + savepoints
        try:
            self._conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as err:
            raise StorageError(f"cannot open the state file {self.path}: {err}") from err
        self._conn.row_factory = sqlite3.Row
        try:
            self._open()
        except BaseException:
            self._conn.close()
            raise

    def _open(self) -> None:
        try:
            self._refuse_newer_schema()
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self._conn.execute("PRAGMA synchronous = FULL")
            self._conn.execute("PRAGMA foreign_keys = ON")
        except sqlite3.Error as err:
            raise StorageError(f"cannot open the state file {self.path}: {err}") from err
        if mode != "wal":
            raise SchemaError(
                f"the state file {self.path} cannot be put in WAL mode (SQLite answered "
                f"{mode!r}); keep the state dir on a local filesystem"
            )
        self._migrate()

    def _schema_version(self) -> int:
        version: int = self._conn.execute("PRAGMA user_version").fetchone()[0]
        return version

    def _refuse_newer_schema(self) -> None:
        version = self._schema_version()
        if version > len(MIGRATIONS):
            raise SchemaError(
                f"the state file {self.path} has schema version {version}, newer than the "
                f"{len(MIGRATIONS)} this broker knows: run the broker that wrote it (or a "
                "newer one), or start from another --state-dir"
            )

    def _migrate(self) -> None:
        for target, script in enumerate(MIGRATIONS, start=1):
            try:
                with self.transaction():  # BEGIN IMMEDIATE: one opener migrates at a time
                    self._refuse_newer_schema()
                    if self._schema_version() >= target:
                        continue
                    for statement in _statements(script):
                        self._conn.execute(statement)
                    self._conn.execute(f"PRAGMA user_version = {target}")
            except (ConstraintError, StorageError) as err:
                raise SchemaError(
                    f"migrating the state file {self.path} to schema version {target} failed, "
                    f"it stays at version {target - 1}: {err}"
                ) from err
            logger.info("state: %s migrated to schema version %d", self.path, target)

    def close(self) -> None:
        """Close the file; idempotent. Blocking (SQLite checkpoints the WAL)."""
        with self._lock:
            self._conn.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- transactions ---------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the block's changes as one transaction: all of them are committed when it ends,
        none if it raises (the exception propagates). Nested blocks are savepoints: an inner
        block that raises undoes its own changes only. Every method below runs in one, so a
        caller groups several (a deployment and its event) by calling them inside one block.
        Holds the store's lock until the end: keep the block short and free of awaits."""
        undo: tuple[str, ...]
        with self._lock:
            if self._depth == 0:
                begin, commit, undo = "BEGIN IMMEDIATE", "COMMIT", ("ROLLBACK",)
            else:
                name = f"nested_{self._depth}"
                begin, commit = f"SAVEPOINT {name}", f"RELEASE {name}"
                undo = (f"ROLLBACK TO {name}", f"RELEASE {name}")
            self._control(begin)
            self._depth += 1
            try:
                yield
                self._control(commit)
            except BaseException as err:
                self._undo(undo)
                if isinstance(err, sqlite3.IntegrityError):
                    raise ConstraintError(f"the change breaks a rule of the state: {err}") from err
                if isinstance(err, sqlite3.Error):
                    raise StorageError(f"{type(err).__name__} on {self.path}: {err}") from err
                raise
            finally:
                self._depth -= 1

    def _control(self, statement: str) -> None:
        try:
            self._conn.execute(statement)
        except sqlite3.Error as err:
            raise StorageError(f"{statement} on {self.path} failed: {err}") from err

    def _undo(self, statements: tuple[str, ...]) -> None:
        if not self._conn.in_transaction:
            return  # SQLite rolled back already (after an I/O error, say)
        try:
            for statement in statements:
                self._conn.execute(statement)
        except sqlite3.Error:
            logger.exception("state: undoing a failed transaction on %s failed", self.path)

    def _query(self, sql: str, params: Any = ()) -> list[sqlite3.Row]:
        with self._lock:
            try:
                return self._conn.execute(sql, params).fetchall()
            except sqlite3.Error as err:
                raise StorageError(f"{type(err).__name__} on {self.path}: {err}") from err

    def _exists(self, table: str, column: str, value: object) -> bool:
        return bool(self._query(f"SELECT 1 FROM {table} WHERE {column} = ?", (value,)))

    def _require(self, table: str, column: str, value: object, what: str) -> None:
        if not self._exists(table, column, value):
            raise ConstraintError(f"{what} {value!r} is unknown")

    # -- clients --------------------------------------------------------------------------

    def put_client(self, client_id: str, api_key: str) -> None:
        """Create `client_id`, or give it a new key (the old one stops working). Only a
        salted hash of the key's secret is stored. ConstraintError unless `api_key` is a
        well-formed key of this client (`broker.state.api_keys` has the format)."""
        try:
            api_keys.check_client_id(client_id)
        except ValueError as err:
            raise ConstraintError(str(err)) from None
        parsed = api_keys.parse_api_key(api_key)
        if parsed is None or parsed[0] != client_id:
            raise ConstraintError(
                f"an API key of client {client_id!r} must look like '{client_id}.<secret>', "
                "the secret 16 to 256 characters of A-Z, a-z, 0-9, '_' or '-'"
            )
        key_hash = api_keys.hash_secret(parsed[1])  # slow: not under the lock
        with self.transaction():
            self._conn.execute(
                "INSERT INTO clients (client_id, key_hash, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT (client_id) DO UPDATE SET key_hash = excluded.key_hash",
                (client_id, key_hash, self._clock()),
            )

    def replace_client_keys(self, keys: Collection[str]) -> KeyChanges:
        """Make `keys` exactly the API keys that authenticate: each one's client gets it
        (created if new), and every other client keeps its row (its deployments refer to it)
        but no key, so nothing authenticates it any more. A key that is already the client's
        keeps its stored hash. ConstraintError, with nothing changed, for a malformed key or two
        keys of one client. Idempotent. Blocking: one ~35 ms hash per key, outside the lock."""
        wanted: dict[str, str] = {}
        for key in keys:
            parsed = api_keys.parse_api_key(key)
            if parsed is None:
                raise ConstraintError(
                    "an API key must look like '<client id>.<secret>', the secret 16 to 256 "
                    "characters of A-Z, a-z, 0-9, '_' or '-'"
                )
            if parsed[0] in wanted:
                raise ConstraintError(f"two API keys of client {parsed[0]!r}: a client has one")
            wanted[parsed[0]] = parsed[1]
        current = self._client_key_hashes()
        hashes = {
            client_id: api_keys.hash_secret(secret)
            for client_id, secret in wanted.items()
            if not current.get(client_id) or not api_keys.verify_secret(secret, current[client_id])
        }
        with self.transaction():
            current = self._client_key_hashes()
            for client_id, key_hash in hashes.items():
                self._conn.execute(
                    "INSERT INTO clients (client_id, key_hash, created_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (client_id) DO UPDATE SET key_hash = excluded.key_hash",
                    (client_id, key_hash, self._clock()),
                )
            revoked = sorted(c for c, h in current.items() if h and c not in wanted)
            self._conn.executemany(
                "UPDATE clients SET key_hash = '' WHERE client_id = ?", [(c,) for c in revoked]
            )
        return KeyChanges(
            added=tuple(sorted(c for c in hashes if not current.get(c))),
            replaced=tuple(sorted(c for c in hashes if current.get(c))),
            revoked=tuple(revoked),
        )

    def _client_key_hashes(self) -> dict[str, str]:
        """client id -> its key hash ("" for a client with no key)."""
        return {row[0]: row[1] for row in self._query("SELECT client_id, key_hash FROM clients")}

    def client_for_api_key(self, api_key: str) -> str | None:
        """The client id `api_key` authenticates, or None: for a malformed key, an unknown
        client or a wrong secret alike. An unknown client costs the same hash as a known one,
        so timing does not tell which ids exist; the comparison is constant-time."""
        parsed = api_keys.parse_api_key(api_key)
        if parsed is None:
            return None
        client_id, secret = parsed
        rows = self._query("SELECT key_hash FROM clients WHERE client_id = ?", (client_id,))
        if not rows or not rows[0]["key_hash"]:  # unknown, or its key was revoked
            api_keys.spend_verify_time(secret)
            return None
        return client_id if api_keys.verify_secret(secret, rows[0]["key_hash"]) else None

    def list_clients(self) -> list[ClientRecord]:
        """Every client, by id."""
        rows = self._query("SELECT client_id, created_at FROM clients ORDER BY client_id")
        return [ClientRecord(row["client_id"], row["created_at"]) for row in rows]

    def set_client_site(self, client_id: str, site: str) -> None:
        """Record the site `client_id` reports it is at now. KeyError for an unknown client."""
        with self.transaction():
            if not self._exists("clients", "client_id", client_id):
                raise KeyError(f"client {client_id!r} is unknown")
            self._conn.execute(
                "INSERT INTO client_sites (client_id, site, updated_at) VALUES (?, ?, ?) "
                "ON CONFLICT (client_id) DO UPDATE SET site = excluded.site, "
                "updated_at = excluded.updated_at",
                (client_id, site, self._clock()),
            )

    def client_site(self, client_id: str) -> str | None:
        """The last site `client_id` reported; None if it reported none (or is unknown)."""
        rows = self._query("SELECT site FROM client_sites WHERE client_id = ?", (client_id,))
        return rows[0]["site"] if rows else None

    # -- nodes ----------------------------------------------------------------------------

    def upsert_node(self, record: NodeRecord) -> None:
        """Store a node as it registered; a node of that id is replaced wholesale (a node
        that registers again after a restart). Idempotent."""
        params = {
            "node_id": record.node_id,
            "address": record.address,
            "site": record.site,
            "state": _enum(NodeState, record.state, "node state").value,
            "inventory_json": record.inventory_json,
            "runtimes_json": json.dumps(list(record.runtimes)),
            "registered_at": record.registered_at,
            "last_heartbeat_at": record.last_heartbeat_at,
            "usage_json": record.usage_json,
        }
        with self.transaction():
            self._conn.execute(
                f"INSERT INTO nodes ({_NODE_COLUMNS}) VALUES ({_placeholders(_NODE_COLUMNS)}) "
                f"ON CONFLICT (node_id) DO UPDATE SET {_assignments(_NODE_COLUMNS, 'node_id')}",
                params,
            )

    def heartbeat(self, node_id: str, at: float, usage_json: str) -> bool:
        """Record a heartbeat of `node_id` at `at` with its usage. False (nothing written) if
        the node is unknown: it must register first. The node's state is left as it is."""
        with self.transaction():
            cursor = self._conn.execute(
                "UPDATE nodes SET last_heartbeat_at = ?, usage_json = ? WHERE node_id = ?",
                (at, usage_json, node_id),
            )
        return cursor.rowcount == 1

    def set_node_state(self, node_id: str, state: NodeState) -> None:
        """Set `node_id`'s state; idempotent. KeyError for an unknown node."""
        value = _enum(NodeState, state, "node state").value
        with self.transaction():
            cursor = self._conn.execute(
                "UPDATE nodes SET state = ? WHERE node_id = ?", (value, node_id)
            )
            if cursor.rowcount == 0:
                raise KeyError(f"node {node_id!r} is unknown")

    def get_node(self, node_id: str) -> NodeRecord | None:
        rows = self._query(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?", (node_id,))
        return _node(rows[0]) if rows else None

    def list_nodes(self) -> list[NodeRecord]:
        """Every node, in any state, by id."""
        return [_node(row) for row in self._query(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY 1")]

    # -- models ---------------------------------------------------------------------------

    def put_model(self, record: ModelRecord) -> bool:
        """Record a stored model. True if it is new; False if that sha256 was recorded already
        (the first record stays: same hash, same content). ConstraintError if the sizes of the
        two differ, which means one of them is wrong."""
        with self.transaction():
            cursor = self._conn.execute(
                "INSERT INTO models (sha256, name, size_bytes, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (sha256) DO NOTHING",
                (record.sha256, record.name, record.size_bytes, record.created_at),
            )
            if cursor.rowcount == 1:
                return True
            known = self._query("SELECT size_bytes FROM models WHERE sha256 = ?", (record.sha256,))
            if known[0]["size_bytes"] != record.size_bytes:
                raise ConstraintError(
                    f"model {record.sha256} is recorded with {known[0]['size_bytes']} bytes, "
                    f"not {record.size_bytes}"
                )
            return False

    def get_model(self, sha256: str) -> ModelRecord | None:
        rows = self._query(
            "SELECT sha256, name, size_bytes, created_at FROM models WHERE sha256 = ?", (sha256,)
        )
        return ModelRecord(*rows[0]) if rows else None

    def list_models(self) -> list[ModelRecord]:
        """Every model, oldest first."""
        rows = self._query(
            "SELECT sha256, name, size_bytes, created_at FROM models ORDER BY created_at, sha256"
        )
        return [ModelRecord(*row) for row in rows]

    def add_model_owner(self, sha256: str, client_id: str) -> bool:
        """Record that `client_id` uploaded the model `sha256`: True if it had not before.
        ConstraintError for an unknown model or client."""
        with self.transaction():
            self._require("models", "sha256", sha256, "model")
            self._require("clients", "client_id", client_id, "client")
            cursor = self._conn.execute(
                "INSERT INTO model_owners (sha256, client_id, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT (sha256, client_id) DO NOTHING",
                (sha256, client_id, self._clock()),
            )
        return cursor.rowcount == 1

    def owns_model(self, client_id: str, sha256: str) -> bool:
        """Whether `client_id` uploaded the model `sha256` (False for unknown ones)."""
        return bool(
            self._query(
                "SELECT 1 FROM model_owners WHERE client_id = ? AND sha256 = ?",
                (client_id, sha256),
            )
        )

    def client_model_bytes(self, client_id: str) -> int:
        """The total size of the models `client_id` uploaded (0 for none)."""
        rows = self._query(
            "SELECT COALESCE(SUM(m.size_bytes), 0) FROM model_owners o "
            "JOIN models m ON m.sha256 = o.sha256 WHERE o.client_id = ?",
            (client_id,),
        )
        return int(rows[0][0])

    # -- deployments ----------------------------------------------------------------------

    def create_deployment(self, record: DeploymentRecord) -> None:
        """Store a new deployment. ConstraintError if its id exists already (in any state,
        deleted included), or its client, model or node (when set) is unknown."""
        with self.transaction():
            if self._exists("deployments", "deployment_id", record.deployment_id):
                raise ConstraintError(f"deployment {record.deployment_id!r} exists already")
            self._check_deployment_refs(record)
            self._conn.execute(
                f"INSERT INTO deployments ({_DEPLOYMENT_COLUMNS}) "
                f"VALUES ({_placeholders(_DEPLOYMENT_COLUMNS)})",
                _deployment_params(record),
            )

    def _check_deployment_refs(self, record: DeploymentRecord) -> None:
        self._require("clients", "client_id", record.client_id, "client")
        self._require("models", "sha256", record.model_sha256, "model")
        if record.node_id is not None:
            self._require("nodes", "node_id", record.node_id, "node")

    def update_deployment(self, deployment_id: str, **changes: Any) -> DeploymentRecord:
        """Change the given fields of a deployment and set `updated_at` to now; returns the
        deployment as stored. TypeError for a field that does not exist or cannot change
        (`deployment_id`, `created_at`, `updated_at`); KeyError for an unknown deployment;
        ConstraintError for a value the schema refuses (an unknown node, a negative epoch)."""
        with self.transaction():
            current = self.get_deployment(deployment_id)
            if current is None:
                raise KeyError(f"deployment {deployment_id!r} is unknown")
            updated = self._changed(current, changes, "deployment_id")
            self._check_deployment_refs(updated)
            self._conn.execute(
                f"UPDATE deployments SET "
                f"{_assignments(_DEPLOYMENT_COLUMNS, 'deployment_id')} "
                "WHERE deployment_id = :deployment_id",
                _deployment_params(updated),
            )
            stored = self.get_deployment(deployment_id)
            assert stored is not None
            return stored

    def _changed(self, record: _Record, changes: dict[str, Any], key: str) -> _Record:
        fixed = {key, "created_at", "updated_at"}
        names = {field.name for field in dataclasses.fields(record)}
        if unknown := sorted(changes.keys() - names):
            raise TypeError(f"{type(record).__name__} has no field {', '.join(unknown)}")
        if frozen := sorted(changes.keys() & fixed):
            raise TypeError(f"{', '.join(frozen)} cannot be changed")
        return dataclasses.replace(record, **changes, updated_at=self._clock())

    def get_deployment(self, deployment_id: str) -> DeploymentRecord | None:
        """The deployment of that id, deleted ones included; None if there never was one."""
        rows = self._query(
            f"SELECT {_DEPLOYMENT_COLUMNS} FROM deployments WHERE deployment_id = ?",
            (deployment_id,),
        )
        return _deployment(rows[0]) if rows else None

    def list_deployments(
        self,
        client_id: str | None = None,
        states: Collection[DeploymentState] | None = None,
    ) -> list[DeploymentRecord]:
        """Deployments, oldest first: of one client or all (`client_id` None), and in the
        given states or in any (`states` None, which includes deleted ones)."""
        where: list[str] = []
        params: list[object] = []
        if client_id is not None:
            where.append("client_id = ?")
            params.append(client_id)
        if states is not None:
            values = [_enum(DeploymentState, s, "deployment state").value for s in states]
            if not values:
                return []
            where.append(f"state IN ({', '.join('?' * len(values))})")
            params.extend(values)
        condition = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._query(
            f"SELECT {_DEPLOYMENT_COLUMNS} FROM deployments {condition} "
            "ORDER BY created_at, deployment_id",
            params,
        )
        return [_deployment(row) for row in rows]

    def delete_deployment(self, deployment_id: str) -> DeploymentRecord:
        """Mark a deployment deleted and return it. The row stays, for the audit trail and the
        history of its migrations (which refer to it); its id is never reused. Its offload
        reports and resizes go (they describe a deployment that no longer serves).
        Idempotent: deleting a deleted deployment changes nothing. KeyError for an unknown
        deployment."""
        with self.transaction():
            current = self.get_deployment(deployment_id)
            if current is None:
                raise KeyError(f"deployment {deployment_id!r} is unknown")
            for table in ("offload_reports", "resizes"):
                self._conn.execute(
                    f"DELETE FROM {table} WHERE deployment_id = ?", (deployment_id,)
                )
            if current.state is DeploymentState.DELETED:
                return current
            return self.update_deployment(deployment_id, state=DeploymentState.DELETED)

    # -- migrations -----------------------------------------------------------------------

    def create_migration(self, record: MigrationRecord) -> None:
        """Store a new migration. ConstraintError if its id exists already, or its deployment
        or either node is unknown."""
        with self.transaction():
            if self._exists("migrations", "migration_id", record.migration_id):
                raise ConstraintError(f"migration {record.migration_id!r} exists already")
            self._check_migration_refs(record)
            self._conn.execute(
                f"INSERT INTO migrations ({_MIGRATION_COLUMNS}) "
                f"VALUES ({_placeholders(_MIGRATION_COLUMNS)})",
                _migration_params(record),
            )

    def _check_migration_refs(self, record: MigrationRecord) -> None:
        self._require("deployments", "deployment_id", record.deployment_id, "deployment")
        self._require("nodes", "node_id", record.source_node, "source node")
        self._require("nodes", "node_id", record.target_node, "target node")

    def update_migration(self, migration_id: str, **changes: Any) -> MigrationRecord:
        """Change the given fields of a migration and set `updated_at` to now; returns it as
        stored. Errors as `update_deployment`'s."""
        with self.transaction():
            current = self._migrations("WHERE migration_id = ?", (migration_id,))
            if not current:
                raise KeyError(f"migration {migration_id!r} is unknown")
            updated = self._changed(current[0], changes, "migration_id")
            self._check_migration_refs(updated)
            self._conn.execute(
                f"UPDATE migrations SET {_assignments(_MIGRATION_COLUMNS, 'migration_id')} "
                "WHERE migration_id = :migration_id",
                _migration_params(updated),
            )
            return self._migrations("WHERE migration_id = ?", (migration_id,))[0]

    def list_migrations(self, deployment_id: str | None = None) -> list[MigrationRecord]:
        """Migrations, oldest first: of one deployment, or all (`deployment_id` None)."""
        if deployment_id is None:
            return self._migrations("", ())
        return self._migrations("WHERE deployment_id = ?", (deployment_id,))

    def _migrations(self, condition: str, params: tuple[str, ...]) -> list[MigrationRecord]:
        rows = self._query(
            f"SELECT {_MIGRATION_COLUMNS} FROM migrations {condition} "
            "ORDER BY created_at, migration_id",
            params,
        )
        return [_migration(row) for row in rows]

    # -- standbys -------------------------------------------------------------------------

    def put_standby(self, record: StandbyRecord) -> None:
        """Record a standby replica about to be started. ConstraintError when one of that
        deployment and epoch is recorded already, or its deployment or node is unknown."""
        with self.transaction():
            self._require("deployments", "deployment_id", record.deployment_id, "deployment")
            self._require("nodes", "node_id", record.node_id, "node")
            try:
                self._conn.execute(
                    "INSERT INTO standbys (deployment_id, epoch, node_id, site, gpus_json, "
                    "created_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (
                        record.deployment_id,
                        record.epoch,
                        record.node_id,
                        record.site,
                        json.dumps(list(record.gpus)),
                        record.created_at,
                    ),
                )
            except sqlite3.IntegrityError as err:
                raise ConstraintError(
                    f"standby {record.deployment_id}@{record.epoch} is recorded already"
                ) from err

    def delete_standby(self, deployment_id: str, epoch: int, node_id: str) -> bool:
        """Forget the standby of `deployment_id` at `epoch` if it is the one on `node_id`
        (a caller releases only the standby it owns); whether one was."""
        with self.transaction():
            cursor = self._conn.execute(
                "DELETE FROM standbys WHERE deployment_id = ? AND epoch = ? AND node_id = ?",
                (deployment_id, epoch, node_id),
            )
            return cursor.rowcount > 0

    def list_standbys(self) -> list[StandbyRecord]:
        """Every recorded standby, oldest first."""
        rows = self._query(
            "SELECT deployment_id, epoch, node_id, site, gpus_json, created_at FROM standbys "
            "ORDER BY created_at, deployment_id, epoch"
        )
        return [
            StandbyRecord(
                deployment_id=row["deployment_id"],
                epoch=row["epoch"],
                node_id=row["node_id"],
                site=row["site"],
                gpus=tuple(int(g) for g in json.loads(row["gpus_json"])),
                created_at=row["created_at"],
            )
            for row in rows
        ]

    # -- offload reports ------------------------------------------------------------------

    def put_offload_report(self, record: OffloadReportRecord, keep: int) -> bool:
        """Keep `record` as the latest summary of its session, replacing the stored one, unless
        the stored one counts more requests: counts only grow within a session, so that one is
        newer and `record` arrived late (or twice). Then only the `keep` sessions of the
        deployment and client reported most recently stay. Returns whether `record` was kept.
        ConstraintError for an unknown deployment or client, or a value the schema refuses
        (a negative count or estimate); nothing is written then."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        names = [name.strip() for name in _OFFLOAD_COLUMNS.split(",")]
        updates = ", ".join(f"{n} = excluded.{n}" for n in names if n not in _OFFLOAD_KEY)
        with self.transaction():
            self._require("deployments", "deployment_id", record.deployment_id, "deployment")
            self._require("clients", "client_id", record.client_id, "client")
            cursor = self._conn.execute(
                f"INSERT INTO offload_reports ({_OFFLOAD_COLUMNS}) "
                f"VALUES ({_placeholders(_OFFLOAD_COLUMNS)}) "
                f"ON CONFLICT ({', '.join(_OFFLOAD_KEY)}) DO UPDATE SET {updates} "
                "WHERE excluded.remote_requests + excluded.local_requests >= "
                "offload_reports.remote_requests + offload_reports.local_requests",
                _offload_params(record),
            )
            kept = cursor.rowcount > 0
            self._conn.execute(
                "DELETE FROM offload_reports WHERE deployment_id = :d AND client_id = :c "
                "AND session NOT IN (SELECT session FROM offload_reports "
                "WHERE deployment_id = :d AND client_id = :c "
                "ORDER BY reported_at DESC, session DESC LIMIT :keep)",
                {"d": record.deployment_id, "c": record.client_id, "keep": keep},
            )
        return kept

    def list_offload_reports(self, deployment_id: str | None = None) -> list[OffloadReportRecord]:
        """The stored offload summaries, of one deployment or all (`deployment_id` None): by
        deployment, the most recently reported session first."""
        condition = "" if deployment_id is None else "WHERE deployment_id = ?"
        rows = self._query(
            f"SELECT {_OFFLOAD_COLUMNS} FROM offload_reports {condition} "
            "ORDER BY deployment_id, reported_at DESC, session DESC",
            () if deployment_id is None else (deployment_id,),
        )
        return [_offload(row) for row in rows]

    # -- resizes --------------------------------------------------------------------------

    def put_resizes(self, records: Sequence[ResizeRecord], keep: int) -> list[ResizeRecord]:
        """Record the resizes not recorded yet (a node repeats its recent ones in every
        heartbeat) and return those, in order; then only the `keep` most recent of each
        deployment they touched stay. A record of a deployment or node the store does not
        know is skipped (the deployment was deleted meanwhile). All or none are written."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        added = []
        with self.transaction():
            for r in records:
                if not (
                    self._exists("deployments", "deployment_id", r.deployment_id)
                    and self._exists("nodes", "node_id", r.node_id)
                ):
                    continue
                cursor = self._conn.execute(
                    # Not INSERT OR IGNORE: that would skip a row breaking a CHECK too.
                    f"INSERT INTO resizes ({_RESIZE_COLUMNS}) "
                    f"VALUES ({_placeholders(_RESIZE_COLUMNS)}) "
                    "ON CONFLICT (node_id, event_id) DO NOTHING",
                    (
                        r.node_id,
                        r.event_id,
                        r.deployment_id,
                        r.replica_id,
                        r.cpus_before,
                        r.cpus_after,
                        r.policy,
                        r.reason,
                        r.at,
                    ),
                )
                if cursor.rowcount > 0:
                    added.append(r)
            for deployment_id in sorted({r.deployment_id for r in added}):
                self._conn.execute(
                    "DELETE FROM resizes WHERE deployment_id = :d AND rowid NOT IN "
                    "(SELECT rowid FROM resizes WHERE deployment_id = :d "
                    "ORDER BY at DESC, event_id DESC LIMIT :keep)",
                    {"d": deployment_id, "keep": keep},
                )
        return added

    def list_resizes(
        self, deployment_id: str | None = None, limit: int = 100
    ) -> list[ResizeRecord]:
        """The `limit` most recent resizes, of one deployment or all, oldest first."""
        condition = "" if deployment_id is None else "WHERE deployment_id = ?"
        params: tuple[object, ...] = () if deployment_id is None else (deployment_id,)
        rows = self._query(
            f"SELECT {_RESIZE_COLUMNS} FROM resizes {condition} "
            "ORDER BY at DESC, event_id DESC LIMIT ?",
            (*params, limit),
        )
        return [ResizeRecord(*row) for row in reversed(rows)]

    # -- events ---------------------------------------------------------------------------

    def append_event(self, kind: str, subject: str, detail_json: str) -> EventRecord:
        """Append to the audit log, stamped now, and return the event. Append it inside the
        same `transaction()` as the change it records, so both or neither are kept."""
        at = self._clock()
        with self.transaction():
            cursor = self._conn.execute(
                "INSERT INTO events (at, kind, subject, detail_json) VALUES (?, ?, ?, ?)",
                (at, kind, subject, detail_json),
            )
        assert cursor.lastrowid is not None
        return EventRecord(cursor.lastrowid, at, kind, subject, detail_json)

    def list_events(self, limit: int = 100) -> list[EventRecord]:
        """The `limit` most recent events, newest first."""
        rows = self._query(
            "SELECT seq, at, kind, subject, detail_json FROM events ORDER BY seq DESC LIMIT ?",
            (limit,),
        )
        return [EventRecord(*row) for row in rows]


def _node(row: sqlite3.Row) -> NodeRecord:
    return NodeRecord(
        node_id=row["node_id"],
        address=row["address"],
        site=row["site"],
        state=NodeState(row["state"]),
        inventory_json=row["inventory_json"],
        runtimes=tuple(json.loads(row["runtimes_json"])),
        registered_at=row["registered_at"],
        last_heartbeat_at=row["last_heartbeat_at"],
        usage_json=row["usage_json"],
    )


def _deployment_params(record: DeploymentRecord) -> dict[str, object]:
    return {
        "deployment_id": record.deployment_id,
        "client_id": record.client_id,
        "model_sha256": record.model_sha256,
        "model_name": record.model_name,
        "request_json": record.request_json,
        "priority": record.priority,
        "site": record.site,
        "state": _enum(DeploymentState, record.state, "deployment state").value,
        "node_id": record.node_id,
        "gpus_json": json.dumps(list(record.gpus)),
        "gpu_uuids_json": json.dumps(list(record.gpu_uuids)),
        "endpoint": record.endpoint,
        "token": record.token,
        "epoch": record.epoch,
        "explanation_json": record.explanation_json,
        "reason": record.reason,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
    }


def _deployment(row: sqlite3.Row) -> DeploymentRecord:
    return DeploymentRecord(
        deployment_id=row["deployment_id"],
        client_id=row["client_id"],
        model_sha256=row["model_sha256"],
        model_name=row["model_name"],
        request_json=row["request_json"],
        priority=row["priority"],
        site=row["site"],
        state=DeploymentState(row["state"]),
        node_id=row["node_id"],
        gpus=tuple(json.loads(row["gpus_json"])),
        gpu_uuids=tuple(json.loads(row["gpu_uuids_json"])),
        endpoint=row["endpoint"],
        token=row["token"],
        epoch=row["epoch"],
        explanation_json=row["explanation_json"],
        reason=row["reason"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )


def _migration_params(record: MigrationRecord) -> dict[str, object]:
    params = dataclasses.asdict(record)
    params["trigger"] = _enum(MigrationTrigger, record.trigger, "migration trigger").value
    params["strategy"] = _enum(MigrationStrategy, record.strategy, "migration strategy").value
    params["state"] = _enum(MigrationState, record.state, "migration state").value
    params["prewarmed"] = int(record.prewarmed)
    return params


def _migration(row: sqlite3.Row) -> MigrationRecord:
    subject = f"migration={row['migration_id']}"
    return MigrationRecord(
        migration_id=row["migration_id"],
        deployment_id=row["deployment_id"],
        trigger=MigrationTrigger(row["trigger"]),
        source_node=row["source_node"],
        target_node=row["target_node"],
        strategy=MigrationStrategy(row["strategy"]),
        state=MigrationState(row["state"]),
        timeline_json=row["timeline_json"],
        outcome=row["outcome"],
        reason=row["reason"],
        downtime_ms=_finite_or_none(row["downtime_ms"], "downtime_ms", subject),
        failed_requests=row["failed_requests"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        span_gap_ms=_finite_or_none(row["span_gap_ms"], "span_gap_ms", subject),
        prewarmed=bool(row["prewarmed"]),
    )


def _offload_params(record: OffloadReportRecord) -> dict[str, object]:
    summary = record.summary
    return {
        "deployment_id": record.deployment_id,
        "client_id": record.client_id,
        "session": summary.session,
        "policy": summary.policy,
        "local_model": summary.local_model,
        "decisions_json": json.dumps([dataclasses.asdict(c) for c in summary.decisions]),
        "remote_requests": summary.remote_requests,
        "local_requests": summary.local_requests,
        "fallbacks": summary.fallbacks,
        "remote_estimate_ms": summary.remote_estimate_ms,
        "local_estimate_ms": summary.local_estimate_ms,
        "remote_reachable": int(summary.remote_reachable),
        "reported_at": record.reported_at,
    }


def _offload(row: sqlite3.Row) -> OffloadReportRecord:
    subject = f"deployment={row['deployment_id']} session={row['session']}"
    return OffloadReportRecord(
        deployment_id=row["deployment_id"],
        client_id=row["client_id"],
        summary=OffloadSummary(
            session=row["session"],
            policy=row["policy"],
            local_model=row["local_model"],
            decisions=tuple(
                OffloadCount(str(c["target"]), str(c["reason"]), int(c["requests"]))
                for c in json.loads(row["decisions_json"])
            ),
            remote_requests=row["remote_requests"],
            local_requests=row["local_requests"],
            fallbacks=row["fallbacks"],
            remote_estimate_ms=_finite_or_none(
                row["remote_estimate_ms"], "remote_estimate_ms", subject
            ),
            local_estimate_ms=_finite_or_none(
                row["local_estimate_ms"], "local_estimate_ms", subject
            ),
            remote_reachable=bool(row["remote_reachable"]),
        ),
        reported_at=row["reported_at"],
    )


def _finite_or_none(value: float | None, column: str, subject: str) -> float | None:
    """`value`, or None ("not measured") for an infinity an older broker let in: no read
    path may break on it (JSON has no infinity)."""
    if value is None or math.isfinite(value):
        return value
    logger.warning("state: %s has %s=%r; read as unknown", subject, column, value)
    return None
