"""`StateStore`: the broker's durable state, in SQLite or PostgreSQL.

    store = open_store(location, state_dir)   # "" (SQLite) or a postgresql:// URL (`opener`)

Backends. One store, two databases: an SQLite file in the state dir (`sqlite_backend`, the
default) or a PostgreSQL database (`postgres_backend`). Every rule of the state lives here,
with its SQL written once; a backend (`backend.Backend`), chosen and opened by `opener` and
handed to the store, supplies the connection, the dialect and the mapping of the driver's
errors. Their docstrings say what each guarantees beyond this.

Durability. Every change runs in a transaction (`transaction()`), committed before the method
returns: a crash at any point (a SIGKILL, a lost connection) leaves each change either whole
or absent. SQLite's commit is on disk before it returns (WAL, `synchronous=FULL`);
PostgreSQL's is as durable as the server makes a commit (by default: WAL flushed).

Consistency. A transaction that reads rows to change them holds them against other writers
until it ends (SQLite: the write lock from BEGIN; PostgreSQL: `SELECT ... FOR UPDATE`), and
the schema's constraints (keys, references, CHECKs) are enforced by the database.

Leader leases. `acquire_lease`/`renew_lease`/`release_lease` keep named leases with a holder,
an expiry by the database's clock (one clock for every broker sharing a database) and a term
that grows with every change of holder: a fencing token. A leader's write calls `check_lease`
inside its transaction, which then commits only while that term still holds the lease.

Schema. The scripts of `schema.MIGRATIONS` that a database lacks are applied at open, each in
its own transaction with its version number, one opener at a time. A database of a newer
schema than this broker knows is refused with `SchemaError`, untouched.

Blocking. Every method blocks on the database (and `put_client`/`client_for_api_key` on a
~35 ms key hash): callers on an event loop use `asyncio.to_thread` or one single-thread
executor. One connection serves all threads, serialised by a lock that a transaction holds
from BEGIN to COMMIT.

"Missing". `get_*` and `client_site` return None for an unknown id; methods that change a
row raise `KeyError` for one (`heartbeat` returns False instead: a node that heartbeats
before it registers is routine, not an error). A change that would break the schema's rules
raises `ConstraintError` with nothing written; any other failure of the database is
`StorageError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, TypeVar

from broker.state import api_keys
from broker.state.backend import Backend, Params, Row
from broker.state.errors import (
    ConstraintError,
    LeaseLost,
    SchemaError,
    StateError,
    StorageError,
)
from broker.state.records import (
    ClientRecord,
    DeploymentRecord,
    DeploymentState,
    EventRecord,
    KeyChanges,
    Lease,
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
    ScaleAction,
    ServiceClientRecord,
    ServiceEventRecord,
    ServiceRecord,
    ServiceReplicaRecord,
    StandbyRecord,
)
from broker.state.schema import MIGRATIONS
from runtime.batching import PriorityClass

logger = logging.getLogger(__name__)

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
_SERVICE_COLUMNS = "name, owner, model_sha256, spec_json, created_at"
_SERVICE_REPLICA_COLUMNS = "deployment_id, service, site, created_at"
_SERVICE_EVENT_COLUMNS = "service, at, action, deployment_id, site, reason"
SERVICE_EVENTS_KEPT = 100
"""Scale decisions kept per service (the most recent)."""
_SERVICE_CLIENT_COLUMNS = (
    "service, client_id, token_sha256, priority_class, deployment_id, site, attached_at"
)
_MAX_TTL_S = 86400.0


def _placeholders(columns: str) -> str:
    return ", ".join(f":{name.strip()}" for name in columns.split(","))


def _assignments(columns: str, *key: str) -> str:
    names = [name.strip() for name in columns.split(",")]
    return ", ".join(f"{name} = :{name}" for name in names if name not in key)


_INSERT_DEPLOYMENT = (
    f"INSERT INTO deployments ({_DEPLOYMENT_COLUMNS}) "
    f"VALUES ({_placeholders(_DEPLOYMENT_COLUMNS)})"
)
_UPDATE_DEPLOYMENT = (
    f"UPDATE deployments SET {_assignments(_DEPLOYMENT_COLUMNS, 'deployment_id')} "
    "WHERE deployment_id = :deployment_id"
)


def _enum(cls: type[_E], value: str, what: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(member.value for member in cls)
        raise ConstraintError(f"{what} {value!r} is not one of: {valid}") from None


def _in_states(cls: type[_E], states: Collection[_E], what: str) -> tuple[str, list[str]]:
    """A `state IN (...)` condition and its parameters (each state checked to be one of
    `cls`'s); the condition matches nothing for no states."""
    values = [_enum(cls, s, what).value for s in states]
    if not values:
        return "FALSE", []
    return f"state IN ({', '.join('?' * len(values))})", values


class StateStore:
    """The broker's durable state, on the database of the backend it is given. Open with
    `broker.state.open_store(location, state_dir)`, which chooses the backend; `close()` when
    done (or use it as a context manager). See the module docstring for durability, blocking
    and what "missing" means."""

    def __init__(self, backend: Backend, *, clock: Callable[[], float] = time.time) -> None:
        """Open the state on an opened `backend` (the store owns it from here: closing the
        store closes it; so does a failure to open); bring its schema up to date.
        SchemaError if its schema is newer than this broker knows or a migration fails;
        StorageError if it cannot be opened. Blocking."""
        self._backend = backend
        self.location = self._backend.location
        """Where the state is, for messages: never holds a password."""
        self.path = self._backend.path
        """The SQLite file; None on PostgreSQL."""
        self._clock = clock
        self._lock = threading.RLock()
        self._depth = 0  # transactions open on the connection: 0, or 1 + savepoints
        self._fence: tuple[str, int] | None = None
        """(lease name, term) every write transaction checks first (`fence`); None: none."""
        self._on_lease_lost: Callable[[LeaseLost], None] | None = None
        self._checked_keys: dict[str, str] = {}
        """sha256 of an API key -> the stored hash `replace_client_keys` last made or verified
        for it: a stored hash found here needs no ~35 ms check (it is that key's, or another's)."""
        try:
            self._open()
        except BaseException:
            self._backend.close()
            raise

    def __repr__(self) -> str:
        return f"StateStore({self.location!r})"

    def _open(self) -> None:
        try:
            self._refuse_newer_schema()
            self._backend.configure()
        except StorageError as err:
            detail = err.__cause__ if err.__cause__ is not None else err
            raise StorageError(f"cannot open the state {self.location}: {detail}") from err
        self._migrate()

    def _refuse_newer_schema(self) -> None:
        version = self._backend.schema_version()
        known = len(MIGRATIONS[self._backend.dialect])
        if version > known:
            raise SchemaError(
                f"the state {self.location} has schema version {version}, newer than the "
                f"{known} this broker knows: run the broker that wrote it (or a newer one), or "
                "start from another --state-dir or database"
            )

    def _migrate(self) -> None:
        for target, script in enumerate(MIGRATIONS[self._backend.dialect], start=1):
            try:
                with self.transaction():
                    self._backend.lock_schema()  # one opener migrates at a time
                    self._refuse_newer_schema()
                    if self._backend.schema_version() >= target:
                        continue
                    self._backend.run_script(script)
                    self._backend.set_schema_version(target)
            except (ConstraintError, StorageError) as err:
                raise SchemaError(
                    f"migrating the state {self.location} to schema version {target} failed, "
                    f"it stays at version {target - 1}: {err}"
                ) from err
            logger.info("state: %s migrated to schema version %d", self.location, target)

    def close(self) -> None:
        """Close the connection; idempotent. Blocking (SQLite checkpoints the WAL)."""
        with self._lock:
            self._backend.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- transactions ---------------------------------------------------------------------

    def fence(
        self, name: str, term: int, on_lost: Callable[[LeaseLost], None] | None = None
    ) -> None:
        """Fence every later write with lease `name` at `term`: each `transaction()` checks
        it first (`check_lease`), so nothing commits once another holder has taken the lease
        (a leader paused past its expiry and resumed writes nothing). `on_lost` is called,
        on the writer's thread, with the LeaseLost before it propagates. The lease calls
        themselves are not fenced."""
        with self._lock:
            self._fence = (name, term)
            self._on_lease_lost = on_lost

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the block's changes as one transaction: all of them are committed when it ends,
        none if it raises (the exception propagates). Nested blocks are savepoints: an inner
        block that raises undoes its own changes only. Every method below runs in one, so a
        caller groups several (a deployment and its event) by calling them inside one block.
        Holds the store's lock until the end: keep the block short and free of awaits. Under
        a `fence`, LeaseLost (nothing written) when the lease is no longer held."""
        with self._transaction(fenced=True):
            yield

    @contextmanager
    def _transaction(self, *, fenced: bool) -> Iterator[None]:
        undo: tuple[str, ...]
        with self._lock:
            if self._depth == 0:
                self._backend.recover()
                begin, commit, undo = self._backend.begin, "COMMIT", ("ROLLBACK",)
            else:
                name = f"nested_{self._depth}"
                begin, commit = f"SAVEPOINT {name}", f"RELEASE {name}"
                undo = (f"ROLLBACK TO {name}", f"RELEASE {name}")
            self._backend.execute(begin)
            self._depth += 1
            try:
                if fenced and self._depth == 1 and self._fence is not None:
                    self._check_fence(*self._fence)
                yield
                self._backend.execute(commit)
            except BaseException:
                self._undo(undo)
                raise
            finally:
                self._depth -= 1

    def _check_fence(self, name: str, term: int) -> None:
        try:
            self.check_lease(name, term)
        except LeaseLost as err:
            if self._on_lease_lost is not None:
                self._on_lease_lost(err)
            raise

    def _undo(self, statements: tuple[str, ...]) -> None:
        if not self._backend.in_transaction():
            return  # the database rolled back already (after an I/O error, say)
        try:
            for statement in statements:
                self._backend.execute(statement)
        except StateError:
            logger.exception("state: undoing a failed transaction on %s failed", self.location)

    def _execute(self, sql: str, params: Params = ()) -> int:
        """Run a change inside the caller's `transaction()`; the rows it changed."""
        return self._backend.execute(sql, params).rowcount

    def _query(self, sql: str, params: Params = ()) -> list[Row]:
        with self._lock:
            if self._depth == 0:
                self._backend.recover()
            return self._backend.execute(sql, params).rows

    def _exists(self, table: str, column: str, value: object) -> bool:
        return bool(self._query(f"SELECT 1 AS found FROM {table} WHERE {column} = ?", (value,)))

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
            self._execute(
                "INSERT INTO clients (client_id, key_hash, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT (client_id) DO UPDATE SET key_hash = excluded.key_hash",
                (client_id, key_hash, self._clock()),
            )

    def replace_client_keys(self, keys: Collection[str]) -> KeyChanges:
        """Make `keys` exactly the API keys that authenticate: each one's client gets it
        (created if new), and every other client keeps its row (its deployments refer to it)
        but no key, so nothing authenticates it any more. A key that is already the client's
        keeps its stored hash. ConstraintError, with nothing changed, for a malformed key or two
        keys of one client. Idempotent. Blocking: a key whose client's stored hash this store
        made or verified before (for that key, or for the key it replaces) costs no check; a
        new or changed key one ~35 ms hash, and a key unknown to this process (at start) one
        ~35 ms check, outside the lock. So a reload hashes only the keys that changed."""
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
        hashes: dict[str, str] = {}
        checked: dict[str, str] = {}
        # A stored hash known to be another key's cannot be this one's: no check needed.
        owners = {key_hash: digest for digest, key_hash in self._checked_keys.items()}
        for client_id, secret in wanted.items():
            digest = hashlib.sha256(f"{client_id}.{secret}".encode()).hexdigest()
            stored = current.get(client_id, "")
            owner = owners.get(stored)
            if stored and (
                owner == digest or (owner is None and api_keys.verify_secret(secret, stored))
            ):
                checked[digest] = stored
            else:
                hashes[client_id] = api_keys.hash_secret(secret)
                checked[digest] = hashes[client_id]
        with self.transaction():
            current = self._client_key_hashes(lock=True)
            for client_id, key_hash in hashes.items():
                self._execute(
                    "INSERT INTO clients (client_id, key_hash, created_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (client_id) DO UPDATE SET key_hash = excluded.key_hash",
                    (client_id, key_hash, self._clock()),
                )
            revoked = sorted(c for c, h in current.items() if h and c not in wanted)
            for client_id in revoked:
                self._execute("UPDATE clients SET key_hash = '' WHERE client_id = ?", (client_id,))
        self._checked_keys = checked
        return KeyChanges(
            added=tuple(sorted(c for c in hashes if not current.get(c))),
            replaced=tuple(sorted(c for c in hashes if current.get(c))),
            revoked=tuple(revoked),
        )

    def _client_key_hashes(self, lock: bool = False) -> dict[str, str]:
        """client id -> its key hash ("" for a client with no key); `lock`: held against
        other writers until the transaction ends."""
        rows = self._query(
            f"SELECT client_id, key_hash FROM clients{self._backend.row_lock if lock else ''}"
        )
        return {row["client_id"]: row["key_hash"] for row in rows}

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
            self._execute(
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
            self._execute(
                f"INSERT INTO nodes ({_NODE_COLUMNS}) VALUES ({_placeholders(_NODE_COLUMNS)}) "
                f"ON CONFLICT (node_id) DO UPDATE SET {_assignments(_NODE_COLUMNS, 'node_id')}",
                params,
            )

    def heartbeat(self, node_id: str, at: float, usage_json: str) -> bool:
        """Record a heartbeat of `node_id` at `at` with its usage. False (nothing written) if
        the node is unknown: it must register first. The node's state is left as it is."""
        with self.transaction():
            changed = self._execute(
                "UPDATE nodes SET last_heartbeat_at = ?, usage_json = ? WHERE node_id = ?",
                (at, usage_json, node_id),
            )
        return changed == 1

    def set_node_state(self, node_id: str, state: NodeState) -> None:
        """Set `node_id`'s state; idempotent. KeyError for an unknown node."""
        value = _enum(NodeState, state, "node state").value
        with self.transaction():
            changed = self._execute(
                "UPDATE nodes SET state = ? WHERE node_id = ?", (value, node_id)
            )
            if changed == 0:
                raise KeyError(f"node {node_id!r} is unknown")

    def get_node(self, node_id: str) -> NodeRecord | None:
        rows = self._query(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?", (node_id,))
        return _node(rows[0]) if rows else None

    def list_nodes(self) -> list[NodeRecord]:
        """Every node, in any state, by id."""
        return [_node(row) for row in self._query(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY 1")]

    def node_secrets(self) -> dict[str, str]:
        """node id -> the sha256 (hex) of the secret it is bound to, for every bound id."""
        rows = self._query("SELECT node_id, secret_sha256 FROM node_secrets")
        return {row["node_id"]: row["secret_sha256"] for row in rows}

    def bind_node_secret(
        self, node_id: str, expected: str | None, secret_sha256: str, at: float
    ) -> bool:
        """Bind `node_id` to `secret_sha256` if it is bound to `expected` now (None: not
        bound at all): a compare-and-swap, so of two daemons claiming one id at once only one
        wins. False (nothing written) when the binding was not `expected`."""
        with self.transaction():
            if expected is None:
                changed = self._execute(
                    "INSERT INTO node_secrets (node_id, secret_sha256, bound_at) VALUES (?, ?, ?) "
                    "ON CONFLICT (node_id) DO NOTHING",
                    (node_id, secret_sha256, at),
                )
            else:
                changed = self._execute(
                    "UPDATE node_secrets SET secret_sha256 = ?, bound_at = ? "
                    "WHERE node_id = ? AND secret_sha256 = ?",
                    (secret_sha256, at, node_id, expected),
                )
        return changed == 1

    def forget_node_secret(self, node_id: str) -> bool:
        """Unbind `node_id` (retired: the next daemon to register it binds it afresh).
        Idempotent: False when it was not bound."""
        with self.transaction():
            changed = self._execute("DELETE FROM node_secrets WHERE node_id = ?", (node_id,))
        return changed == 1

    # -- models ---------------------------------------------------------------------------

    def put_model(self, record: ModelRecord) -> bool:
        """Record a stored model. True if it is new; False if that sha256 was recorded already
        (the first record stays: same hash, same content). ConstraintError if the sizes of the
        two differ, which means one of them is wrong."""
        with self.transaction():
            changed = self._execute(
                "INSERT INTO models (sha256, name, size_bytes, created_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (sha256) DO NOTHING",
                (record.sha256, record.name, record.size_bytes, record.created_at),
            )
            if changed == 1:
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
        return ModelRecord(**rows[0]) if rows else None

    def list_models(self) -> list[ModelRecord]:
        """Every model, oldest first."""
        rows = self._query(
            "SELECT sha256, name, size_bytes, created_at FROM models ORDER BY created_at, sha256"
        )
        return [ModelRecord(**row) for row in rows]

    def add_model_owner(self, sha256: str, client_id: str) -> bool:
        """Record that `client_id` uploaded the model `sha256`: True if it had not before.
        ConstraintError for an unknown model or client."""
        with self.transaction():
            self._require("models", "sha256", sha256, "model")
            self._require("clients", "client_id", client_id, "client")
            changed = self._execute(
                "INSERT INTO model_owners (sha256, client_id, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT (sha256, client_id) DO NOTHING",
                (sha256, client_id, self._clock()),
            )
        return changed == 1

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
            "SELECT COALESCE(SUM(m.size_bytes), 0) AS total FROM model_owners o "
            "JOIN models m ON m.sha256 = o.sha256 WHERE o.client_id = ?",
            (client_id,),
        )
        return int(rows[0]["total"])

    # -- deployments ----------------------------------------------------------------------

    def create_deployment(self, record: DeploymentRecord) -> None:
        """Store a new deployment. ConstraintError if its id exists already (in any state,
        deleted included), or its client, model or node (when set) is unknown."""
        try:
            with self.transaction():
                self._execute(_INSERT_DEPLOYMENT, _deployment_params(record))
        except ConstraintError as err:
            raise self._refused(record, None, err) from err

    def _refused(
        self, record: DeploymentRecord, before: DeploymentRecord | None, err: ConstraintError
    ) -> ConstraintError:
        """Why the database refused to write `record` (`before`: the row it replaces; None:
        a new one), by name: its id taken, or a client, model or node it names (only those
        it changes) unknown; else `err` itself. Called after the write's transaction is
        undone: the schema's keys did the checking, and these reads are paid only by a write
        that failed, not by every write on the state thread."""
        if before is None and self._exists("deployments", "deployment_id", record.deployment_id):
            return ConstraintError(f"deployment {record.deployment_id!r} exists already")
        references = (
            ("clients", "client_id", record.client_id, before and before.client_id, "client"),
            ("models", "sha256", record.model_sha256, before and before.model_sha256, "model"),
            ("nodes", "node_id", record.node_id, before and before.node_id, "node"),
        )
        for table, column, value, was, what in references:
            if value is not None and value != was and not self._exists(table, column, value):
                return ConstraintError(f"{what} {value!r} is unknown")
        return err

    def update_deployment(self, deployment_id: str, **changes: Any) -> DeploymentRecord:
        """Change the given fields of a deployment and set `updated_at` to now; returns the
        deployment as stored. TypeError for a field that does not exist or cannot change
        (`deployment_id`, `created_at`, `updated_at`); KeyError for an unknown deployment;
        ConstraintError for a value the schema refuses (an unknown node, a negative epoch)."""
        current = updated = None
        try:
            with self.transaction():
                current = self._deployment_to_change(deployment_id)
                updated = self._changed(current, changes, "deployment_id")
                return self._rewrite_deployment(updated)
        except ConstraintError as err:
            if updated is None:
                raise
            raise self._refused(updated, current, err) from err

    def _rewrite_deployment(self, updated: DeploymentRecord) -> DeploymentRecord:
        """Inside a transaction that holds the deployment's row (`_deployment_to_change`):
        write `updated` over it; the record as stored. The row is not read back: it is the
        values written, parsed as a read parses them (a round trip less on every update)."""
        params = _deployment_params(updated)
        self._execute(_UPDATE_DEPLOYMENT, params)
        return _deployment(params)

    def _changed(self, record: _Record, changes: dict[str, Any], key: str) -> _Record:
        fixed = {key, "created_at", "updated_at"}
        names = {field.name for field in dataclasses.fields(record)}
        if unknown := sorted(changes.keys() - names):
            raise TypeError(f"{type(record).__name__} has no field {', '.join(unknown)}")
        if frozen := sorted(changes.keys() & fixed):
            raise TypeError(f"{', '.join(frozen)} cannot be changed")
        return dataclasses.replace(record, **changes, updated_at=self._clock())

    def _deployment_to_change(self, deployment_id: str) -> DeploymentRecord:
        """Inside a transaction: the deployment, held against other writers until the end.
        KeyError for an unknown one."""
        rows = self._query(
            f"SELECT {_DEPLOYMENT_COLUMNS} FROM deployments WHERE deployment_id = ?"
            f"{self._backend.row_lock}",
            (deployment_id,),
        )
        if not rows:
            raise KeyError(f"deployment {deployment_id!r} is unknown")
        return _deployment(rows[0])

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
            condition, values = _in_states(DeploymentState, states, "deployment state")
            where.append(condition)
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
            current = self._deployment_to_change(deployment_id)
            for table in ("offload_reports", "resizes"):
                self._execute(f"DELETE FROM {table} WHERE deployment_id = ?", (deployment_id,))
            if current.state is DeploymentState.DELETED:
                return current
            deleted = {"state": DeploymentState.DELETED}
            return self._rewrite_deployment(self._changed(current, deleted, "deployment_id"))

    # -- migrations -----------------------------------------------------------------------

    def create_migration(self, record: MigrationRecord) -> None:
        """Store a new migration. ConstraintError if its id exists already, or its deployment
        or either node is unknown."""
        with self.transaction():
            if self._exists("migrations", "migration_id", record.migration_id):
                raise ConstraintError(f"migration {record.migration_id!r} exists already")
            self._check_migration_refs(record)
            self._execute(
                f"INSERT INTO migrations ({_MIGRATION_COLUMNS}) "
                f"VALUES ({_placeholders(_MIGRATION_COLUMNS)})",
                _migration_params(record),
            )

    def _check_migration_refs(
        self, record: MigrationRecord, before: MigrationRecord | None = None
    ) -> None:
        """Each deployment and node `record` names exists (ConstraintError, by name); with
        `before`, the record as stored, only those it changes: the database's foreign keys
        kept the others."""
        if before is None or record.deployment_id != before.deployment_id:
            self._require("deployments", "deployment_id", record.deployment_id, "deployment")
        if before is None or record.source_node != before.source_node:
            self._require("nodes", "node_id", record.source_node, "source node")
        if before is None or record.target_node != before.target_node:
            self._require("nodes", "node_id", record.target_node, "target node")

    def update_migration(self, migration_id: str, **changes: Any) -> MigrationRecord:
        """Change the given fields of a migration and set `updated_at` to now; returns it as
        stored. Errors as `update_deployment`'s."""
        with self.transaction():
            current = self._migrations("WHERE migration_id = ?", (migration_id,), lock=True)
            if not current:
                raise KeyError(f"migration {migration_id!r} is unknown")
            updated = self._changed(current[0], changes, "migration_id")
            self._check_migration_refs(updated, current[0])
            self._execute(
                f"UPDATE migrations SET {_assignments(_MIGRATION_COLUMNS, 'migration_id')} "
                "WHERE migration_id = :migration_id",
                _migration_params(updated),
            )
            return self._migrations("WHERE migration_id = ?", (migration_id,))[0]

    def list_migrations(
        self,
        deployment_id: str | None = None,
        *,
        states: Collection[MigrationState] | None = None,
        updated_since: float | None = None,
    ) -> list[MigrationRecord]:
        """Migrations, oldest first: of one deployment or all (`deployment_id` None), in the
        given states or any (`states` None), changed at or after `updated_since` or at any
        time (None). The filters run in the database: a history of thousands of migrations
        costs a caller that wants the few in flight no records."""
        where: list[str] = []
        params: list[str | float] = []
        if deployment_id is not None:
            where.append("deployment_id = ?")
            params.append(deployment_id)
        if states is not None:
            condition, values = _in_states(MigrationState, states, "migration state")
            where.append(condition)
            params.extend(values)
        if updated_since is not None:
            where.append("updated_at >= ?")
            params.append(updated_since)
        return self._migrations(f"WHERE {' AND '.join(where)}" if where else "", tuple(params))

    def get_migration(self, migration_id: str) -> MigrationRecord | None:
        """The migration of that id; None if there is none."""
        found = self._migrations("WHERE migration_id = ?", (migration_id,))
        return found[0] if found else None

    def _migrations(
        self, condition: str, params: tuple[str | float, ...], lock: bool = False
    ) -> list[MigrationRecord]:
        """`lock`: inside a transaction, hold the rows against other writers until its end."""
        rows = self._query(
            f"SELECT {_MIGRATION_COLUMNS} FROM migrations {condition} "
            f"ORDER BY created_at, migration_id{self._backend.row_lock if lock else ''}",
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
                self._execute(
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
            except ConstraintError as err:
                raise ConstraintError(
                    f"standby {record.deployment_id}@{record.epoch} is recorded already"
                ) from err

    def delete_standby(self, deployment_id: str, epoch: int, node_id: str) -> bool:
        """Forget the standby of `deployment_id` at `epoch` if it is the one on `node_id`
        (a caller releases only the standby it owns); whether one was."""
        with self.transaction():
            changed = self._execute(
                "DELETE FROM standbys WHERE deployment_id = ? AND epoch = ? AND node_id = ?",
                (deployment_id, epoch, node_id),
            )
            return changed > 0

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
            changed = self._execute(
                f"INSERT INTO offload_reports ({_OFFLOAD_COLUMNS}) "
                f"VALUES ({_placeholders(_OFFLOAD_COLUMNS)}) "
                f"ON CONFLICT ({', '.join(_OFFLOAD_KEY)}) DO UPDATE SET {updates} "
                "WHERE excluded.remote_requests + excluded.local_requests >= "
                "offload_reports.remote_requests + offload_reports.local_requests",
                _offload_params(record),
            )
            kept = changed > 0
            self._execute(
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
                changed = self._execute(
                    # Not INSERT OR IGNORE: that would skip a row breaking a CHECK too.
                    f"INSERT INTO resizes ({_RESIZE_COLUMNS}) "
                    f"VALUES ({_placeholders(_RESIZE_COLUMNS)}) "
                    "ON CONFLICT (node_id, event_id) DO NOTHING",
                    dataclasses.asdict(r),
                )
                if changed > 0:
                    added.append(r)
            for deployment_id in sorted({r.deployment_id for r in added}):
                self._execute(
                    "DELETE FROM resizes WHERE deployment_id = :d AND (node_id, event_id) NOT IN "
                    "(SELECT node_id, event_id FROM resizes WHERE deployment_id = :d "
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
        return [ResizeRecord(**row) for row in reversed(rows)]

    # -- services -------------------------------------------------------------------------

    def create_service(self, record: ServiceRecord) -> None:
        """Store a new service. ConstraintError, with nothing written, when its name is
        taken ("service NAME exists already"), its model is unknown, or the schema refuses a
        value (an empty name or owner, a spec that is not a JSON object)."""
        with self.transaction():
            self._require("models", "sha256", record.model_sha256, "model")
            changed = self._execute(
                f"INSERT INTO services ({_SERVICE_COLUMNS}) "
                f"VALUES ({_placeholders(_SERVICE_COLUMNS)}) ON CONFLICT (name) DO NOTHING",
                dataclasses.asdict(record),
            )
            if changed == 0:
                raise ConstraintError(f"service {record.name!r} exists already")

    def get_service(self, name: str) -> ServiceRecord | None:
        """The service of that name; None if there is none."""
        rows = self._query(f"SELECT {_SERVICE_COLUMNS} FROM services WHERE name = ?", (name,))
        return ServiceRecord(**rows[0]) if rows else None

    def list_services(self) -> list[ServiceRecord]:
        """Every service, by name."""
        rows = self._query(f"SELECT {_SERVICE_COLUMNS} FROM services ORDER BY name")
        return [ServiceRecord(**row) for row in rows]

    def delete_service(self, name: str) -> bool:
        """Forget the service `name` with the records of its replicas and of its attached
        clients, all in one transaction (the replicas' deployments are the caller's to
        stop). Idempotent: whether it existed."""
        with self.transaction():
            for table in ("service_clients", "service_replicas", "service_events"):
                self._execute(f"DELETE FROM {table} WHERE service = ?", (name,))
            changed = self._execute("DELETE FROM services WHERE name = ?", (name,))
        return changed == 1

    def add_service_replica(self, record: ServiceReplicaRecord) -> None:
        """Record a replica of a service, before it is started. ConstraintError, with
        nothing written, for an unknown service, or a deployment that is a replica (of any
        service) already."""
        with self.transaction():
            self._require("services", "name", record.service, "service")
            changed = self._execute(
                f"INSERT INTO service_replicas ({_SERVICE_REPLICA_COLUMNS}) "
                f"VALUES ({_placeholders(_SERVICE_REPLICA_COLUMNS)}) "
                "ON CONFLICT (deployment_id) DO NOTHING",
                dataclasses.asdict(record),
            )
            if changed == 0:
                raise ConstraintError(f"deployment {record.deployment_id!r} is a replica already")

    def remove_service_replica(self, deployment_id: str) -> bool:
        """Forget the replica `deployment_id`; whether it was one. The clients on it keep
        their records (`list_service_clients(deployment_id=...)` finds them to move)."""
        with self.transaction():
            changed = self._execute(
                "DELETE FROM service_replicas WHERE deployment_id = ?", (deployment_id,)
            )
        return changed == 1

    def list_service_replicas(self, service: str | None = None) -> list[ServiceReplicaRecord]:
        """The replicas of one service or of all (`service` None), oldest first."""
        condition = "" if service is None else "WHERE service = ?"
        rows = self._query(
            f"SELECT {_SERVICE_REPLICA_COLUMNS} FROM service_replicas {condition} "
            "ORDER BY created_at, deployment_id",
            () if service is None else (service,),
        )
        return [ServiceReplicaRecord(**row) for row in rows]

    def add_service_event(self, record: ServiceEventRecord) -> None:
        """Record a scale decision of a service, keeping its `SERVICE_EVENTS_KEPT` most
        recent. ConstraintError, with nothing written, for an unknown service or a value
        the schema refuses (an unknown action, an empty deployment id or reason)."""
        params = dataclasses.asdict(record)
        params["action"] = _enum(ScaleAction, record.action, "scale action").value
        with self.transaction():
            self._require("services", "name", record.service, "service")
            self._execute(
                f"INSERT INTO service_events ({_SERVICE_EVENT_COLUMNS}) "
                f"VALUES ({_placeholders(_SERVICE_EVENT_COLUMNS)})",
                params,
            )
            self._execute(
                "DELETE FROM service_events WHERE service = :s AND seq NOT IN "
                "(SELECT seq FROM service_events WHERE service = :s "
                "ORDER BY seq DESC LIMIT :keep)",
                {"s": record.service, "keep": SERVICE_EVENTS_KEPT},
            )

    def list_service_events(self, service: str, limit: int = 20) -> list[ServiceEventRecord]:
        """The `limit` most recent scale decisions of `service`, oldest first."""
        rows = self._query(
            f"SELECT {_SERVICE_EVENT_COLUMNS} FROM service_events WHERE service = ? "
            "ORDER BY seq DESC LIMIT ?",
            (service, limit),
        )
        return [
            ServiceEventRecord(**{**row, "action": ScaleAction(row["action"])})
            for row in reversed(rows)
        ]

    def put_service_client(self, record: ServiceClientRecord) -> None:
        """Record a client attached to a service; a record of that service and client is
        replaced (a re-attach: new token, replica, site, class). ConstraintError, with
        nothing written (a replaced record stays as it was), for an unknown service, a
        token hash that is not 64 lowercase hex digits or an unknown priority class. The
        replica is not checked: the caller chose it."""
        params = dataclasses.asdict(record)
        params["priority_class"] = _enum(
            PriorityClass, record.priority_class, "priority class"
        ).value
        with self.transaction():
            self._require("services", "name", record.service, "service")
            self._execute(
                f"INSERT INTO service_clients ({_SERVICE_CLIENT_COLUMNS}) "
                f"VALUES ({_placeholders(_SERVICE_CLIENT_COLUMNS)}) "
                "ON CONFLICT (service, client_id) DO UPDATE SET "
                f"{_assignments(_SERVICE_CLIENT_COLUMNS, 'service', 'client_id')}",
                params,
            )

    def delete_service_client(self, service: str, client_id: str) -> bool:
        """Detach `client_id` from `service`; whether it was attached."""
        with self.transaction():
            changed = self._execute(
                "DELETE FROM service_clients WHERE service = ? AND client_id = ?",
                (service, client_id),
            )
        return changed == 1

    def list_service_clients(
        self, service: str | None = None, deployment_id: str | None = None
    ) -> list[ServiceClientRecord]:
        """The attached clients, of one service or all (`service` None), on one replica or
        any (`deployment_id` None), the earliest attached first."""
        where: list[str] = []
        params: list[str] = []
        if service is not None:
            where.append("service = ?")
            params.append(service)
        if deployment_id is not None:
            where.append("deployment_id = ?")
            params.append(deployment_id)
        condition = f"WHERE {' AND '.join(where)}" if where else ""
        rows = self._query(
            f"SELECT {_SERVICE_CLIENT_COLUMNS} FROM service_clients {condition} "
            "ORDER BY attached_at, service, client_id",
            params,
        )
        return [_service_client(row) for row in rows]

    # -- events ---------------------------------------------------------------------------

    def append_event(self, kind: str, subject: str, detail_json: str) -> EventRecord:
        """Append to the audit log, stamped now, and return the event. Append it inside the
        same `transaction()` as the change it records, so both or neither are kept."""
        at = self._clock()
        with self.transaction():
            (row,) = self._backend.execute(
                "INSERT INTO events (at, kind, subject, detail_json) VALUES (?, ?, ?, ?) "
                "RETURNING seq",
                (at, kind, subject, detail_json),
            ).rows
        return EventRecord(row["seq"], at, kind, subject, detail_json)

    def list_events(self, limit: int = 100) -> list[EventRecord]:
        """The `limit` most recent events, newest first."""
        rows = self._query(
            "SELECT seq, at, kind, subject, detail_json FROM events ORDER BY seq DESC LIMIT ?",
            (limit,),
        )
        return [EventRecord(**row) for row in rows]

    # -- leader leases --------------------------------------------------------------------

    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> Lease | None:
        """Take the lease `name` for `holder` for `ttl_s` seconds of the database's clock, or
        extend it when `holder` holds it already (same term); None while another holder's is
        unexpired. Taking it after another holder, an expiry or a release starts a new term,
        higher than every earlier one. ValueError unless 0 < `ttl_s` <= 1 day."""
        _check_ttl(ttl_s)
        with self._transaction(fenced=False):
            self._execute(  # a lease never held: term 0, expired
                "INSERT INTO leases (name, holder, term, expires_at) VALUES (?, '', 0, 0) "
                "ON CONFLICT (name) DO NOTHING",
                (name,),
            )
            (row,) = self._query(
                f"SELECT holder, term, expires_at FROM leases WHERE name = ?"
                f"{self._backend.row_lock}",
                (name,),
            )
            now = self._database_time()
            if row["expires_at"] > now and row["holder"] != holder:
                return None
            term = row["term"] if row["expires_at"] > now else row["term"] + 1
            lease = Lease(name, holder, term, now + ttl_s)
            self._execute(
                "UPDATE leases SET holder = ?, term = ?, expires_at = ? WHERE name = ?",
                (holder, term, lease.expires_at, name),
            )
        return lease

    def renew_lease(self, lease: Lease, ttl_s: float) -> Lease | None:
        """Extend `lease` to `ttl_s` seconds from now, if it is still held (unexpired, same
        term); None if it was lost: the holder must stop acting as leader. ValueError as
        `acquire_lease`."""
        _check_ttl(ttl_s)
        with self._transaction(fenced=False):
            now = self._database_time()
            changed = self._execute(
                "UPDATE leases SET expires_at = ? WHERE name = ? AND holder = ? AND term = ? "
                "AND expires_at > ?",
                (now + ttl_s, lease.name, lease.holder, lease.term, now),
            )
        return dataclasses.replace(lease, expires_at=now + ttl_s) if changed == 1 else None

    def release_lease(self, lease: Lease) -> bool:
        """End `lease` now, so another holder need not wait for its expiry; whether it was
        still held. The term is kept: the next holder's is higher."""
        with self._transaction(fenced=False):
            now = self._database_time()
            changed = self._execute(
                "UPDATE leases SET expires_at = ? WHERE name = ? AND holder = ? AND term = ? "
                "AND expires_at > ?",
                (now, lease.name, lease.holder, lease.term, now),
            )
        return changed == 1

    def get_lease(self, name: str) -> Lease | None:
        """Lease `name` as it stands: its holder, term and expiry; None when it is expired,
        released or was never taken."""
        rows = self._query(
            f"SELECT holder, term, expires_at, {self._backend.clock} AS now FROM leases "
            "WHERE name = ?",
            (name,),
        )
        if not rows or rows[0]["expires_at"] <= rows[0]["now"]:
            return None
        return Lease(name, rows[0]["holder"], rows[0]["term"], rows[0]["expires_at"])

    def check_lease(self, name: str, term: int) -> None:
        """The fence of a leader's write: call it inside the write's `transaction()`, which
        then commits only while lease `name` is unexpired at `term`. LeaseLost otherwise
        (the block's changes are undone as it propagates). On PostgreSQL the lease's row
        stays locked until the transaction ends, so no other holder takes it in between;
        on SQLite the write lock does the same. RuntimeError outside a transaction."""
        with self._lock:
            if self._depth == 0:
                raise RuntimeError("check_lease fences a write: call it inside transaction()")
            rows = self._query(
                f"SELECT holder, term, expires_at FROM leases WHERE name = ?"
                f"{self._backend.row_lock}",
                (name,),
            )
            now = self._database_time()
        if not rows or rows[0]["term"] != term or rows[0]["expires_at"] <= now:
            current = f"term {rows[0]['term']} of {rows[0]['holder']!r}" if rows else "none"
            raise LeaseLost(f"lease {name!r} is no longer held at term {term} (now: {current})")

    def _database_time(self) -> float:
        (row,) = self._query(f"SELECT {self._backend.clock} AS now")
        return float(row["now"])


def _node(row: Row) -> NodeRecord:
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


def _deployment(row: Row) -> DeploymentRecord:
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


def _migration(row: Row) -> MigrationRecord:
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


def _offload(row: Row) -> OffloadReportRecord:
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


def _service_client(row: Row) -> ServiceClientRecord:
    return ServiceClientRecord(
        service=row["service"],
        client_id=row["client_id"],
        token_sha256=row["token_sha256"],
        priority_class=PriorityClass(row["priority_class"]),
        deployment_id=row["deployment_id"],
        site=row["site"],
        attached_at=row["attached_at"],
    )


def _check_ttl(ttl_s: float) -> None:
    if not (math.isfinite(ttl_s) and 0 < ttl_s <= _MAX_TTL_S):
        raise ValueError(f"a lease's ttl must be over 0 and at most {_MAX_TTL_S} s, not {ttl_s!r}")


def _finite_or_none(value: float | None, column: str, subject: str) -> float | None:
    """`value`, or None ("not measured") for an infinity an older broker let in: no read
    path may break on it (JSON has no infinity)."""
    if value is None or math.isfinite(value):
        return value
    logger.warning("state: %s has %s=%r; read as unknown", subject, column, value)
    return None
