"""The broker's state in a real SQLite file and a real PostgreSQL database: schema, every
method, transactions, crashes.

Every test of the store's behaviour runs against both backends (the `database` fixture's
params); tests of what only one database has (SQLite's file, its modes and PRAGMAs;
PostgreSQL's version table, advisory lock, URLs and connections) say so in their names."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from broker.state import (
    ConstraintError,
    DeploymentRecord,
    DeploymentState,
    LeaseLost,
    MigrationRecord,
    MigrationState,
    MigrationStrategy,
    MigrationTrigger,
    ModelRecord,
    NodeRecord,
    NodeState,
    OffloadReportRecord,
    ResizeRecord,
    SchemaError,
    StandbyRecord,
    StateStore,
    StorageError,
    api_keys,
    new_api_key,
    parse_api_key,
    parse_api_keys_file,
)
from broker.state.opener import open_store
from broker.state.schema import MIGRATIONS
from broker.state.sqlite_backend import DB_FILENAME
from tests.broker_support import offload_summary
from tests.pg_support import PostgresServer

REPO = Path(__file__).resolve().parents[2]
SHA = hashlib.sha256(b"model").hexdigest()
KEY = "alice.s3cret-s3cret-s3cret-0123456789"
LATEST = len(MIGRATIONS["sqlite"])
# How each database words a broken CHECK: SQLite's, PostgreSQL's, and PostgreSQL's for text
# that a JSON column's cast refuses.
CHECK_FAILED = (
    "CHECK constraint failed|violates check constraint|invalid input syntax for type json"
)


class Clock:
    """A clock the test moves by hand, so `updated_at` values are known."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@dataclass(frozen=True, slots=True)
class Database:
    """Where a test's state lives, and a way to look at it from outside the store."""

    backend: str
    """"sqlite" or "postgresql": the key of its scripts in `MIGRATIONS`."""
    location: str
    """What `open_store` takes: "" (the SQLite file in `state_dir`) or the database's URL."""
    state_dir: Path

    def open(self, clock: Callable[[], float] = time.time) -> StateStore:
        return open_store(self.location, self.state_dir, clock=clock)

    def query(self, sql: str) -> list[tuple[object, ...]]:
        """Run `sql` on a connection of its own, as another process would; its rows."""
        if self.backend == "sqlite":
            with closing(sqlite3.connect(self.state_dir / DB_FILENAME)) as conn, conn:
                return conn.execute(sql).fetchall()
        with psycopg.connect(self.location, autocommit=True) as conn:
            cursor = conn.execute(sql)
            return cursor.fetchall() if cursor.description is not None else []

    def schema_version(self) -> int:
        if self.backend == "sqlite":
            sql = "PRAGMA user_version"
        else:
            sql = "SELECT version FROM schema_version"
        ((version,),) = self.query(sql)
        assert isinstance(version, int)
        return version

    def tables(self) -> set[str]:
        if self.backend == "sqlite":
            sql = "SELECT name FROM sqlite_master WHERE type = 'table'"
        else:
            sql = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
        return {str(name) for (name,) in self.query(sql)}

    def schema(self) -> list[tuple[object, ...]]:
        """Every table, index and column with its definition."""
        if self.backend == "sqlite":
            return self.query("SELECT sql FROM sqlite_master ORDER BY name")
        return self.query(
            "SELECT table_name, column_name, data_type, collation_name FROM "
            "information_schema.columns WHERE table_schema = current_schema() ORDER BY 1, 2"
        ) + self.query(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = current_schema() "
            "ORDER BY 1"
        )

    def use_migrations(self, monkeypatch: pytest.MonkeyPatch, scripts: tuple[str, ...]) -> None:
        """Make the store know only `scripts`, as a broker of that version did."""
        monkeypatch.setitem(MIGRATIONS, self.backend, scripts)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    """Each backend in turn: an SQLite file in tmp_path, an empty PostgreSQL database."""
    if request.param == "sqlite":
        return Database("sqlite", "", tmp_path)
    return Database("postgresql", request.getfixturevalue("postgresql_url"), tmp_path)


@pytest.fixture
def store(database: Database, clock: Clock) -> Iterator[StateStore]:
    with database.open(clock) as opened:
        yield opened


def inspect(path: Path, sql: str) -> list[tuple[object, ...]]:
    """Read the SQLite file through a connection of its own, as another process would."""
    with closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql).fetchall()


def node(node_id: str = "n1", **changes: Any) -> NodeRecord:
    record = NodeRecord(
        node_id=node_id,
        address="10.0.0.1:7000",
        site="site-a",
        state=NodeState.READY,
        inventory_json='{"gpus": [{"index": 0}]}',
        runtimes=("docker", "process"),
        registered_at=10.0,
        last_heartbeat_at=10.0,
        usage_json="{}",
    )
    return dataclasses.replace(record, **changes)


def model(sha: str = SHA, **changes: Any) -> ModelRecord:
    return dataclasses.replace(ModelRecord(sha, "mlp", 1234, 20.0), **changes)


def deployment(deployment_id: str = "d1", **changes: Any) -> DeploymentRecord:
    record = DeploymentRecord(
        deployment_id=deployment_id,
        client_id="alice",
        model_sha256=SHA,
        model_name="mlp",
        request_json='{"gpus": 1}',
        priority=1,
        site="site-a",
        state=DeploymentState.PENDING,
        node_id=None,
        gpus=(),
        gpu_uuids=(),
        endpoint="",
        token="",
        epoch=0,
        explanation_json="null",
        reason="waiting for a node",
        created_at=30.0,
        updated_at=30.0,
    )
    return dataclasses.replace(record, **changes)


def migration(migration_id: str = "m1", **changes: Any) -> MigrationRecord:
    record = MigrationRecord(
        migration_id=migration_id,
        deployment_id="d1",
        trigger=MigrationTrigger.MOBILITY,
        source_node="n1",
        target_node="n2",
        strategy=MigrationStrategy.MAKE_BEFORE_BREAK,
        state=MigrationState.PREPARING,
        timeline_json="[]",
        outcome="",
        reason="client moved to site-b",
        downtime_ms=None,
        failed_requests=None,
        created_at=40.0,
        updated_at=40.0,
    )
    return dataclasses.replace(record, **changes)


@pytest.fixture
def populated(store: StateStore) -> StateStore:
    """A client, a model and two nodes: what a deployment refers to."""
    store.put_client("alice", KEY)
    store.put_model(model())
    store.upsert_node(node("n1"))
    store.upsert_node(node("n2", site="site-b"))
    return store


# -- the file -----------------------------------------------------------------------------


def test_a_new_state_is_at_the_latest_schema(store: StateStore, database: Database) -> None:
    assert database.schema_version() == LATEST
    assert {"clients", "client_sites", "nodes", "models", "deployments", "migrations"} <= (
        database.tables()
    )
    assert {"events", "model_owners", "offload_reports", "standbys", "resizes"} <= (
        database.tables()
    )


def test_sqlite_a_new_file_is_in_wal_mode_with_its_pragmas(tmp_path: Path) -> None:
    with open_store("", tmp_path) as store:
        path = tmp_path / DB_FILENAME
        assert store.path == path
        assert inspect(path, "PRAGMA journal_mode") == [("wal",)]
        # foreign_keys is a per-connection setting: only the store's own connection can tell.
        backend = store._backend
        assert backend.execute("PRAGMA foreign_keys").rows == [{"foreign_keys": 1}]
        assert backend.execute("PRAGMA synchronous").rows == [{"synchronous": 2}]  # FULL


def test_reopening_applies_nothing_twice_and_keeps_the_data(database: Database) -> None:
    with database.open() as store:
        store.put_model(model())
    schema = database.schema()
    for _ in range(2):
        with database.open() as store:
            assert store.list_models() == [model()]
    assert database.schema_version() == LATEST
    assert database.schema() == schema


def test_sqlite_a_newer_schema_is_refused_and_left_untouched(tmp_path: Path) -> None:
    path = tmp_path / DB_FILENAME
    with closing(sqlite3.connect(path)) as conn:
        conn.execute(f"PRAGMA user_version = {LATEST + 1}")
    with pytest.raises(SchemaError, match=f"schema version {LATEST + 1}, newer than"):
        open_store("", tmp_path)
    assert inspect(path, "SELECT name FROM sqlite_master") == []
    assert inspect(path, "PRAGMA journal_mode") == [("delete",)]


def test_a_later_migration_applies_once_and_then_older_brokers_refuse_the_file(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    database.open().close()
    newer = (*MIGRATIONS[database.backend], "CREATE TABLE extra (a INTEGER);\n"
             "INSERT INTO extra VALUES (1);")  # fmt: skip
    database.use_migrations(monkeypatch, newer)
    for _ in range(2):
        database.open().close()
    assert database.query("SELECT a FROM extra") == [(1,)]
    assert database.schema_version() == len(newer)
    database.use_migrations(monkeypatch, newer[:-1])
    with pytest.raises(SchemaError, match="newer than"):
        database.open()


def test_a_failing_migration_leaves_the_file_at_the_previous_version(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    database.open().close()
    broken = (*MIGRATIONS[database.backend], "CREATE TABLE extra (a INTEGER);\n"
              "CREATE TABLE clients (b INTEGER);")  # fmt: skip
    database.use_migrations(monkeypatch, broken)
    with pytest.raises(
        SchemaError, match=f"to schema version {LATEST + 1} failed, it stays at version {LATEST}"
    ):
        database.open()
    assert database.schema_version() == LATEST
    assert "extra" not in database.tables()


def test_sqlite_a_location_that_is_not_a_url_is_the_folder_of_the_file(tmp_path: Path) -> None:
    with open_store(str(tmp_path / "elsewhere"), tmp_path / "unused") as store:
        assert store.path == tmp_path / "elsewhere" / DB_FILENAME
        assert store.location == f"file {store.path}"
    assert not (tmp_path / "unused").exists()


def test_sqlite_a_file_that_is_not_sqlite_is_refused(tmp_path: Path) -> None:
    (tmp_path / DB_FILENAME).write_bytes(b"not a database" * 100)
    with pytest.raises(StorageError, match="cannot open the state file"):
        open_store("", tmp_path)


# -- clients and API keys -----------------------------------------------------------------


def test_the_right_key_authenticates_its_client(store: StateStore) -> None:
    store.put_client("alice", KEY)
    assert store.client_for_api_key(KEY) == "alice"
    assert store.list_clients()[0].client_id == "alice"


@pytest.mark.parametrize(
    "api_key",
    [
        "alice.s3cret-s3cret-s3cret-0123456780",  # wrong secret
        "bob.s3cret-s3cret-s3cret-0123456789",  # unknown client, same secret
        "",
        "alice",
        "alice.",
        ".s3cret-s3cret-s3cret-0123456789",
        "alice.short",
        "alice.s3cret-s3cret-s3cret-0123456789.more",
        "al ice.s3cret-s3cret-s3cret-0123456789",
        "alice.s3cret-s3cret-s3cret-012345678\u00e9",
    ],
    ids=["wrong-secret", "unknown-client", "empty", "no-dot", "no-secret", "no-id", "short",
         "two-dots", "space", "non-ascii"],
)  # fmt: skip
def test_any_other_key_authenticates_nobody(store: StateStore, api_key: str) -> None:
    store.put_client("alice", KEY)
    assert store.client_for_api_key(api_key) is None


def test_only_a_salted_hash_is_stored_and_a_new_key_replaces_the_old(
    store: StateStore, clock: Clock, database: Database
) -> None:
    store.put_client("alice", KEY)
    store.put_client("bob", "bob." + KEY.split(".")[1])
    hashes = list(key_hashes(database).values())
    secret = KEY.split(".")[1]
    assert all(secret not in h for h in hashes)
    assert hashes[0].split("$")[-2:] != hashes[1].split("$")[-2:]  # same secret, other salt
    if store.path is not None:
        assert secret.encode() not in store.path.read_bytes()

    rotated = new_api_key("alice")
    clock.now += 5
    store.put_client("alice", rotated)
    assert store.client_for_api_key(rotated) == "alice"
    assert store.client_for_api_key(KEY) is None
    assert [(c.client_id, c.created_at) for c in store.list_clients()] == [
        ("alice", 1000.0),
        ("bob", 1000.0),
    ]


def test_replacing_the_keys_makes_exactly_them_work(store: StateStore, database: Database) -> None:
    alice, bob, carol = new_api_key("alice"), new_api_key("bob"), new_api_key("carol")
    changes = store.replace_client_keys([alice, bob])
    assert (changes.added, changes.replaced, changes.revoked) == (("alice", "bob"), (), ())

    alice2 = new_api_key("alice")
    changes = store.replace_client_keys([alice2, carol])
    assert (changes.added, changes.replaced, changes.revoked) == (("carol",), ("alice",), ("bob",))
    assert [store.client_for_api_key(k) for k in (alice, alice2, bob, carol)] == [
        None, "alice", None, "carol",
    ]  # fmt: skip
    # Revoked clients keep their row: their deployments refer to it.
    assert [c.client_id for c in store.list_clients()] == ["alice", "bob", "carol"]

    hashes = key_hashes(database)
    assert not store.replace_client_keys([alice2, carol])
    assert key_hashes(database) == hashes  # a key given again keeps its hash
    store.replace_client_keys([bob])
    assert store.client_for_api_key(bob) == "bob"
    assert key_hashes(database)["alice"] == key_hashes(database)["carol"] == ""


def test_a_reload_hashes_only_the_keys_that_changed(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [new_api_key(f"client{n}") for n in range(5)]
    store.replace_client_keys(keys)
    hashed: list[str] = []
    verified: list[str] = []
    hash_secret, verify_secret = api_keys.hash_secret, api_keys.verify_secret
    monkeypatch.setattr(api_keys, "hash_secret", lambda s: hashed.append(s) or hash_secret(s))
    monkeypatch.setattr(
        api_keys, "verify_secret", lambda s, h: verified.append(s) or verify_secret(s, h)
    )
    rotated = new_api_key("client1")
    changes = store.replace_client_keys([keys[0], rotated, *keys[3:]])
    assert (changes.added, changes.replaced, changes.revoked) == ((), ("client1",), ("client2",))
    assert (hashed, verified) == ([rotated.partition(".")[2]], [])


def key_hashes(database: Database) -> dict[str, str]:
    rows = database.query("SELECT client_id, key_hash FROM clients ORDER BY client_id")
    return {str(client_id): str(key_hash) for client_id, key_hash in rows}


def test_a_bad_set_of_keys_changes_nothing(store: StateStore) -> None:
    alice = new_api_key("alice")
    store.replace_client_keys([alice])
    with pytest.raises(ConstraintError, match="two API keys of client 'bob'"):
        store.replace_client_keys([new_api_key("bob"), new_api_key("bob")])
    with pytest.raises(ConstraintError, match="must look like") as refused:
        store.replace_client_keys(["alice.short"])
    assert "short" not in str(refused.value)
    assert store.client_for_api_key(alice) == "alice"


def test_a_keys_file_is_parsed_with_line_numbers() -> None:
    alice, bob = new_api_key("alice"), new_api_key("bob")
    text = f"# clients\n\n{alice}\n  {bob}  \n"
    assert parse_api_keys_file(text, "keys") == (alice, bob)
    with pytest.raises(ValueError, match=r"^keys, line 2: not an API key") as refused:
        parse_api_keys_file(f"{alice}\nalice.sec ret-0123456789abcdef\n", "keys")
    assert "sec ret" not in str(refused.value)
    with pytest.raises(ValueError, match="keys, line 3: a second key of client 'alice' \\(line 1"):
        parse_api_keys_file(f"{alice}\n{bob}\n{new_api_key('alice')}\n", "keys")


def test_sqlite_the_state_dir_and_its_files_are_private(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    with open_store("", state_dir) as opened:
        opened.put_client("alice", KEY)
        modes = {p.name: p.stat().st_mode & 0o777 for p in state_dir.iterdir()}
    assert state_dir.stat().st_mode & 0o777 == 0o700
    assert {DB_FILENAME, f"{DB_FILENAME}-wal", f"{DB_FILENAME}-shm"} <= modes.keys()
    assert set(modes.values()) == {0o600}


def test_sqlite_looser_modes_are_tightened_at_open_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    open_store("", state_dir).close()
    wal = state_dir / f"{DB_FILENAME}-wal"
    wal.write_bytes(b"")
    state_dir.chmod(0o755)
    (state_dir / DB_FILENAME).chmod(0o644)
    wal.chmod(0o666)
    with open_store("", state_dir):
        pass
    assert state_dir.stat().st_mode & 0o777 == 0o700
    assert (state_dir / DB_FILENAME).stat().st_mode & 0o777 == 0o600
    assert not wal.exists() or wal.stat().st_mode & 0o777 == 0o600
    for path in (state_dir, state_dir / DB_FILENAME, wal):
        assert f"state: {path} was readable by others" in caplog.text


@pytest.mark.parametrize(
    ("client_id", "api_key", "message"),
    [
        ("alice", "bob.s3cret-s3cret-s3cret-0123456789", "must look like 'alice.<secret>'"),
        ("alice", "alice.short", "must look like"),
        ("al.ice", "al.ice.s3cret-s3cret-s3cret-0123456789", "must be 1 to 64 characters"),
        ("", ".s3cret-s3cret-s3cret-0123456789", "must be 1 to 64 characters"),
    ],
)
def test_malformed_clients_and_keys_are_refused(
    store: StateStore, client_id: str, api_key: str, message: str
) -> None:
    with pytest.raises(ConstraintError, match=message):
        store.put_client(client_id, api_key)
    assert store.list_clients() == []


def test_new_api_keys_parse_back() -> None:
    key = new_api_key("edge-7")
    assert parse_api_key(key) == ("edge-7", key.removeprefix("edge-7."))
    assert key != new_api_key("edge-7")
    with pytest.raises(ValueError, match="client id"):
        new_api_key("no.dots")


def test_client_sites(store: StateStore) -> None:
    store.put_client("alice", KEY)
    assert store.client_site("alice") is None
    store.set_client_site("alice", "site-a")
    store.set_client_site("alice", "site-b")
    assert store.client_site("alice") == "site-b"
    assert store.client_site("nobody") is None
    with pytest.raises(KeyError, match="client 'nobody' is unknown"):
        store.set_client_site("nobody", "site-a")
    with pytest.raises(ConstraintError):
        store.set_client_site("alice", "")
    assert store.client_site("alice") == "site-b"


# -- nodes --------------------------------------------------------------------------------


def test_a_node_id_is_bound_once_and_forgotten_when_retired(store: StateStore) -> None:
    first, second = "a" * 64, "b" * 64
    assert store.bind_node_secret("n1", None, first, 1.0)
    # Of two claims of an unbound id, the second finds it bound: a compare-and-swap.
    assert not store.bind_node_secret("n1", None, second, 2.0)
    assert not store.bind_node_secret("n1", second, second, 2.0)
    assert store.node_secrets() == {"n1": first}
    assert store.bind_node_secret("n1", first, second, 3.0)  # taken over with a certificate
    assert store.node_secrets() == {"n1": second}
    with pytest.raises(ConstraintError):
        store.bind_node_secret("n2", None, "not-a-sha256", 4.0)
    assert store.forget_node_secret("n1")
    assert not store.forget_node_secret("n1")
    assert store.node_secrets() == {}


def test_nodes_register_heartbeat_and_change_state(store: StateStore) -> None:
    store.upsert_node(node("n2"))
    store.upsert_node(node("n1"))
    assert store.get_node("n1") == node("n1")
    assert isinstance(store.get_node("n1").state, NodeState)  # type: ignore[union-attr]
    assert [n.node_id for n in store.list_nodes()] == ["n1", "n2"]

    assert store.heartbeat("n1", 55.5, '{"gpu_util": [0.5]}')
    assert not store.heartbeat("ghost", 55.5, "{}")
    stored = store.get_node("n1")
    assert stored is not None
    assert (stored.last_heartbeat_at, stored.usage_json) == (55.5, '{"gpu_util": [0.5]}')

    store.set_node_state("n1", NodeState.LOST)
    store.set_node_state("n1", NodeState.LOST)
    assert store.get_node("n1") == node("n1", state=NodeState.LOST, last_heartbeat_at=55.5,
                                        usage_json='{"gpu_util": [0.5]}')  # fmt: skip
    with pytest.raises(KeyError, match="node 'ghost' is unknown"):
        store.set_node_state("ghost", NodeState.READY)
    with pytest.raises(ConstraintError, match="'gone' is not one of: ready, lost, draining"):
        store.set_node_state("n1", "gone")  # type: ignore[arg-type]

    # A node that registers again replaces its record wholesale.
    store.upsert_node(node("n1", address="10.0.0.9:7000", runtimes=("process",)))
    assert store.get_node("n1") == node("n1", address="10.0.0.9:7000", runtimes=("process",))
    assert store.get_node("ghost") is None


def test_a_node_with_invalid_json_is_refused(store: StateStore) -> None:
    with pytest.raises(ConstraintError, match=CHECK_FAILED):
        store.upsert_node(node(inventory_json="{not json"))
    assert store.list_nodes() == []


# -- models -------------------------------------------------------------------------------


def test_models_are_deduplicated_by_hash(store: StateStore) -> None:
    other = hashlib.sha256(b"other").hexdigest()
    assert store.put_model(model())
    assert not store.put_model(model(name="renamed", created_at=99.0))
    assert store.put_model(model(other, created_at=10.0))
    assert store.get_model(SHA) == model()
    assert store.get_model(hashlib.sha256(b"none").hexdigest()) is None
    assert [m.sha256 for m in store.list_models()] == [other, SHA]
    with pytest.raises(ConstraintError, match="recorded with 1234 bytes, not 5"):
        store.put_model(model(size_bytes=5))


def test_model_owners_and_their_bytes(populated: StateStore) -> None:
    store = populated
    other = hashlib.sha256(b"other").hexdigest()
    store.put_model(model(other, size_bytes=100))
    store.put_client("bob", new_api_key("bob"))
    assert not store.owns_model("alice", SHA)
    assert store.client_model_bytes("alice") == 0
    assert store.add_model_owner(SHA, "alice")
    assert not store.add_model_owner(SHA, "alice")
    store.add_model_owner(other, "alice")
    store.add_model_owner(other, "bob")
    assert store.owns_model("alice", SHA) and not store.owns_model("bob", SHA)
    assert (store.client_model_bytes("alice"), store.client_model_bytes("bob")) == (1334, 100)
    with pytest.raises(ConstraintError, match=r"model 'f+' is unknown"):
        store.add_model_owner("f" * 64, "alice")
    with pytest.raises(ConstraintError, match="client 'carol' is unknown"):
        store.add_model_owner(SHA, "carol")


def test_the_owners_migration_gives_deployed_models_to_their_clients(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = MIGRATIONS[database.backend]
    database.use_migrations(monkeypatch, scripts[:1])
    with database.open() as old:
        old.put_client("alice", KEY)
        old.put_model(model())
        old.create_deployment(deployment())
    database.use_migrations(monkeypatch, scripts)
    with database.open() as upgraded:
        assert upgraded.owns_model("alice", SHA)
        assert upgraded.client_model_bytes("alice") == 1234


@pytest.mark.parametrize("sha", ["abc", SHA.upper(), SHA[:-1] + "g"])
def test_a_malformed_model_hash_is_refused(store: StateStore, sha: str) -> None:
    with pytest.raises(ConstraintError):
        store.put_model(model(sha))
    assert store.list_models() == []


# -- deployments --------------------------------------------------------------------------


def test_deployments_are_created_listed_and_filtered(populated: StateStore) -> None:
    store = populated
    store.put_client("bob", new_api_key("bob"))
    running = deployment("d2", client_id="bob", state=DeploymentState.RUNNING, node_id="n1",
                         gpus=(0, 3), gpu_uuids=("GPU-a", "GPU-b"), created_at=31.0)  # fmt: skip
    store.create_deployment(deployment("d1"))
    store.create_deployment(running)
    assert store.get_deployment("d2") == running
    assert store.get_deployment("nope") is None
    assert [d.deployment_id for d in store.list_deployments()] == ["d1", "d2"]
    assert store.list_deployments(client_id="bob") == [running]
    assert store.list_deployments(states={DeploymentState.RUNNING}) == [running]
    assert store.list_deployments(client_id="alice", states=[DeploymentState.RUNNING]) == []
    assert store.list_deployments(states=()) == []


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (deployment(client_id="mallory"), "client 'mallory' is unknown"),
        (deployment(model_sha256=hashlib.sha256(b"x").hexdigest()), "model '.*' is unknown"),
        (deployment(node_id="ghost"), "node 'ghost' is unknown"),
        (deployment(epoch=-1), CHECK_FAILED),
        (deployment(request_json="{"), CHECK_FAILED),
        (deployment(state="lost"), "'lost' is not one of: pending, starting"),
    ],
)
def test_a_deployment_breaking_a_rule_is_refused(
    populated: StateStore, record: DeploymentRecord, message: str
) -> None:
    with pytest.raises(ConstraintError, match=message):
        populated.create_deployment(record)
    assert populated.list_deployments() == []


def test_a_deployment_id_is_never_reused(populated: StateStore) -> None:
    populated.create_deployment(deployment())
    populated.delete_deployment("d1")
    with pytest.raises(ConstraintError, match="deployment 'd1' exists already"):
        populated.create_deployment(deployment())


def test_updates_change_the_named_fields_and_bump_updated_at(
    populated: StateStore, clock: Clock
) -> None:
    store = populated
    store.create_deployment(deployment())
    clock.now = 2000.0
    updated = store.update_deployment(
        "d1", state=DeploymentState.RUNNING, node_id="n2", gpus=(1,), gpu_uuids=("GPU-x",),
        endpoint="10.0.0.2:9000", token="t0k", epoch=1, reason="",
    )  # fmt: skip
    expected = deployment(state=DeploymentState.RUNNING, node_id="n2", gpus=(1,),
                          gpu_uuids=("GPU-x",), endpoint="10.0.0.2:9000", token="t0k", epoch=1,
                          reason="", updated_at=2000.0)  # fmt: skip
    assert updated == expected
    assert store.get_deployment("d1") == expected


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"colour": "red"}, TypeError, "DeploymentRecord has no field colour"),
        ({"created_at": 1.0}, TypeError, "created_at cannot be changed"),
        ({"deployment_id": "d9"}, TypeError, "deployment_id"),
        ({"node_id": "ghost"}, ConstraintError, "node 'ghost' is unknown"),
        ({"state": "bogus"}, ConstraintError, "'bogus' is not one of"),
        (
            {"priority": "high"},
            ConstraintError,
            "cannot store TEXT value in INTEGER column|invalid input syntax for type bigint",
        ),
    ],
)
def test_a_wrong_update_changes_nothing(
    populated: StateStore, changes: dict[str, object], error: type[Exception], message: str
) -> None:
    populated.create_deployment(deployment())
    with pytest.raises(error, match=message):
        populated.update_deployment("d1", **changes)
    assert populated.get_deployment("d1") == deployment()


def test_unknown_deployments_are_key_errors(populated: StateStore) -> None:
    with pytest.raises(KeyError, match="deployment 'ghost' is unknown"):
        populated.update_deployment("ghost", epoch=2)
    with pytest.raises(KeyError, match="deployment 'ghost' is unknown"):
        populated.delete_deployment("ghost")


def test_delete_marks_the_deployment_deleted_once(populated: StateStore, clock: Clock) -> None:
    store = populated
    store.create_deployment(deployment())
    clock.now = 3000.0
    deleted = store.delete_deployment("d1")
    assert deleted == deployment(state=DeploymentState.DELETED, updated_at=3000.0)
    clock.now = 4000.0
    assert store.delete_deployment("d1") == deleted
    assert store.list_deployments(states=[DeploymentState.DELETED]) == [deleted]


# -- migrations ---------------------------------------------------------------------------


def test_migrations_are_recorded_and_updated(populated: StateStore, clock: Clock) -> None:
    store = populated
    store.create_deployment(deployment())
    store.create_deployment(deployment("d2"))
    store.create_migration(migration())
    store.create_migration(migration("m2", deployment_id="d2", created_at=41.0))
    assert store.list_migrations() == [migration(), migration("m2", deployment_id="d2",
                                                              created_at=41.0)]  # fmt: skip
    clock.now = 5000.0
    done = store.update_migration(
        "m1", state=MigrationState.COMPLETED, outcome="moved to n2", downtime_ms=12.5,
        failed_requests=0, timeline_json='[["prepare", 1.0], ["switch", 2.0]]',
    )  # fmt: skip
    assert done == migration(state=MigrationState.COMPLETED, outcome="moved to n2",
                             downtime_ms=12.5, failed_requests=0, updated_at=5000.0,
                             timeline_json='[["prepare", 1.0], ["switch", 2.0]]')  # fmt: skip
    assert store.list_migrations("d1") == [done]
    assert store.list_migrations("d3") == []
    with pytest.raises(KeyError, match="migration 'ghost' is unknown"):
        store.update_migration("ghost", outcome="x")
    with pytest.raises(ConstraintError, match="'teleport' is not one of"):
        store.update_migration("m1", strategy="teleport")
    with pytest.raises(ConstraintError, match="exists already"):
        store.create_migration(migration())
    with pytest.raises(ConstraintError, match="deployment 'd9' is unknown"):
        store.create_migration(migration("m3", deployment_id="d9"))
    with pytest.raises(ConstraintError, match="target node 'ghost' is unknown"):
        store.create_migration(migration("m3", target_node="ghost"))
    with pytest.raises(ConstraintError, match=CHECK_FAILED):
        store.update_migration("m1", downtime_ms=-1.0)
    assert store.list_migrations("d1") == [done]


def test_migrations_are_filtered_by_state_and_change_time_in_the_database(
    populated: StateStore, clock: Clock
) -> None:
    store = populated
    store.create_deployment(deployment())
    store.create_deployment(deployment("d2"))
    store.create_migration(migration())
    store.create_migration(migration("m2", deployment_id="d2", created_at=41.0))
    clock.now = 5000.0
    done = store.update_migration("m1", state=MigrationState.COMPLETED)
    (in_flight,) = store.list_migrations(states=[MigrationState.PREPARING])
    assert in_flight.migration_id == "m2"
    assert store.list_migrations(updated_since=4000.0) == [done]
    assert store.list_migrations("d2", updated_since=4000.0) == []
    assert store.list_migrations(states=[]) == []
    assert store.get_migration("m1") == done
    assert store.get_migration("ghost") is None
    with pytest.raises(ConstraintError, match="'moving' is not one of"):
        store.list_migrations(states=["moving"])  # type: ignore[list-item]


def test_an_infinite_downtime_slipped_in_earlier_reads_as_unknown(
    populated: StateStore, database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    populated.create_deployment(deployment())
    populated.create_migration(migration())
    populated.update_migration("m1", downtime_ms=float("inf"))
    assert database.query("SELECT downtime_ms FROM migrations") == [(float("inf"),)]
    assert populated.list_migrations() == [migration(downtime_ms=None, updated_at=1000.0)]
    assert "migration=m1 has downtime_ms=inf; read as unknown" in caplog.text


# -- events -------------------------------------------------------------------------------


def test_events_are_appended_and_listed_newest_first(store: StateStore, clock: Clock) -> None:
    first = store.append_event("node.registered", "n1", '{"site": "a"}')
    clock.now += 1
    second = store.append_event("node.lost", "n1", "{}")
    assert second.seq > first.seq
    assert (second.at, second.kind, second.subject) == (1001.0, "node.lost", "n1")
    assert store.list_events() == [second, first]
    assert store.list_events(limit=1) == [second]
    with pytest.raises(ConstraintError):
        store.append_event("node.lost", "n1", "not json")
    assert store.list_events() == [second, first]


# -- transactions -------------------------------------------------------------------------


def test_a_transaction_that_raises_leaves_nothing(populated: StateStore) -> None:
    store = populated
    with pytest.raises(RuntimeError, match="crash mid-way"), store.transaction():
        store.create_deployment(deployment())
        store.set_node_state("n1", NodeState.DRAINING)
        store.append_event("deployment.created", "d1", "{}")
        raise RuntimeError("crash mid-way")
    assert store.list_deployments() == []
    assert store.get_node("n1") == node("n1")
    assert store.list_events() == []


def test_a_failing_change_undoes_the_ones_before_it(populated: StateStore) -> None:
    store = populated
    with pytest.raises(ConstraintError), store.transaction():
        store.create_deployment(deployment())
        store.append_event("deployment.created", "d1", "{}")
        store.create_deployment(deployment("d2", node_id="ghost"))
    assert store.list_deployments() == []
    assert store.list_events() == []


def test_a_nested_block_that_raises_undoes_only_itself(populated: StateStore) -> None:
    store = populated
    with store.transaction():
        store.create_deployment(deployment())
        with pytest.raises(KeyError), store.transaction():
            store.append_event("deployment.placed", "d1", "{}")
            store.update_deployment("ghost", epoch=1)
        store.append_event("deployment.created", "d1", "{}")
    assert [d.deployment_id for d in store.list_deployments()] == ["d1"]
    assert [e.kind for e in store.list_events()] == ["deployment.created"]


def test_worker_threads_share_one_store(store: StateStore) -> None:
    def append(i: int) -> int:
        with store.transaction():
            return store.append_event("tick", str(i), "{}").seq

    with ThreadPoolExecutor(max_workers=4) as pool:
        seqs = list(pool.map(append, range(200)))
    assert len(set(seqs)) == 200
    assert len(store.list_events(limit=1000)) == 200


CRASHING_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from broker.state.opener import open_store
    from tests.unit.test_state import KEY, deployment, model, node

    store = open_store(sys.argv[1], Path(sys.argv[2]))
    store.put_client("alice", KEY)
    store.put_model(model())
    store.upsert_node(node("n1"))
    with store.transaction():
        store.create_deployment(deployment())
        store.set_node_state("n1", "draining")
        for i in range(5000):  # 5 MB: more than SQLite's page cache, so some reaches the WAL
            store.append_event("bulk", str(i), '{"pad": "%s"}' % ("x" * 1000))
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_process_killed_mid_transaction_leaves_nothing_of_it(database: Database) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, database.location, str(database.state_dir)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == -signal.SIGKILL, result.stderr
    if database.backend == "sqlite":
        # Uncommitted pages spilled into the WAL before the kill: recovery must ignore them.
        assert (database.state_dir / f"{DB_FILENAME}-wal").stat().st_size > 2**20
    with database.open() as store:
        assert store.client_for_api_key(KEY) == "alice"
        assert store.list_models() == [model()]
        assert store.get_node("n1") == node("n1")
        assert store.list_deployments() == []
        assert store.list_events() == []
    if database.backend == "sqlite":
        assert database.query("PRAGMA integrity_check") == [("ok",)]


def test_the_span_gap_migration_keeps_older_migrations_unmeasured(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = MIGRATIONS[database.backend]
    database.use_migrations(monkeypatch, scripts[:2])
    with database.open() as old:
        old.put_client("alice", KEY)
        old.put_model(model())
        old.upsert_node(node("n1"))
        old.upsert_node(node("n2", site="site-b"))
        old.create_deployment(deployment())
    # Written as a version-2 broker did: without the column.
    database.query(
        "INSERT INTO migrations (migration_id, deployment_id, trigger, source_node, "
        "target_node, strategy, state, timeline_json, outcome, reason, downtime_ms, "
        "failed_requests, created_at, updated_at) VALUES ('m1', 'd1', 'mobility', 'n1', "
        "'n2', 'make_before_break', 'completed', '[]', 'succeeded', '', 80.0, 0, 40.0, 40.0)"
    )
    database.use_migrations(monkeypatch, scripts)
    with database.open() as upgraded:
        (before,) = upgraded.list_migrations()
        assert (before.downtime_ms, before.span_gap_ms) == (80.0, None)
        after = upgraded.update_migration("m1", span_gap_ms=140.0)
        assert (after.downtime_ms, after.span_gap_ms) == (80.0, 140.0)
        assert upgraded.list_migrations() == [after]
    assert database.schema_version() == LATEST


def test_a_negative_span_gap_is_refused(populated: StateStore) -> None:
    populated.create_deployment(deployment())
    populated.create_migration(migration())
    with pytest.raises(ConstraintError):
        populated.update_migration("m1", span_gap_ms=-1.0)


# -- offload reports ----------------------------------------------------------------------


def report(at: float, deployment_id: str = "d1", **changes: Any) -> OffloadReportRecord:
    return OffloadReportRecord(deployment_id, "alice", offload_summary(**changes), at)


def test_the_latest_offload_report_of_a_session_replaces_the_earlier(
    populated: StateStore,
) -> None:
    store = populated
    store.create_deployment(deployment())
    store.create_deployment(deployment("d2"))
    assert store.put_offload_report(report(50.0), keep=8)
    assert store.put_offload_report(report(60.0, remote=5, local=9, remote_reachable=False), 8)
    assert store.put_offload_report(report(61.0, "d2", session="s9"), keep=8)
    assert store.list_offload_reports("d1") == [
        report(60.0, remote=5, local=9, remote_reachable=False)
    ]
    # A report that arrives late (fewer requests than the stored one) changes nothing; the
    # same report twice is kept (its time only moves on).
    assert not store.put_offload_report(report(70.0, remote=4, local=9), keep=8)
    assert store.put_offload_report(report(71.0, remote=5, local=9, remote_reachable=False), 8)
    assert store.list_offload_reports() == [
        report(71.0, remote=5, local=9, remote_reachable=False),
        report(61.0, "d2", session="s9"),
    ]
    (stored,) = store.list_offload_reports("d2")
    assert stored.summary.decisions == offload_summary().decisions
    assert store.list_offload_reports("d3") == []


def test_only_the_newest_sessions_of_a_deployment_are_kept(populated: StateStore) -> None:
    store = populated
    store.create_deployment(deployment())
    store.create_deployment(deployment("d2"))
    store.put_offload_report(report(10.0, "d2", session="other"), keep=3)
    for i in range(5):
        store.put_offload_report(report(20.0 + i, session=f"s{i}"), keep=3)
    assert [r.summary.session for r in store.list_offload_reports("d1")] == ["s4", "s3", "s2"]
    # A late report of a session still kept does not push others out.
    assert not store.put_offload_report(report(30.0, session="s2", remote=0, local=0), keep=3)
    assert [r.summary.session for r in store.list_offload_reports("d1")] == ["s4", "s3", "s2"]
    assert [r.summary.session for r in store.list_offload_reports("d2")] == ["other"]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        store.put_offload_report(report(40.0), keep=0)


def test_deleting_a_deployment_drops_its_offload_reports(
    populated: StateStore, database: Database
) -> None:
    store = populated
    store.create_deployment(deployment())
    store.create_deployment(deployment("d2"))
    store.put_offload_report(report(10.0), keep=8)
    store.put_offload_report(report(11.0, session="s2"), keep=8)
    store.put_offload_report(report(12.0, "d2"), keep=8)
    store.delete_deployment("d1")
    assert store.list_offload_reports() == [report(12.0, "d2")]
    assert database.query("SELECT COUNT(*) FROM offload_reports") == [(1,)]


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        (report(10.0, "d9"), "deployment 'd9' is unknown"),
        (dataclasses.replace(report(10.0), client_id="carol"), "client 'carol' is unknown"),
        (report(10.0, fallbacks=-1), CHECK_FAILED),
        (report(10.0, local_estimate_ms=-0.5), CHECK_FAILED),
        (report(10.0, session=""), CHECK_FAILED),
    ],
)
def test_an_offload_report_breaking_a_rule_is_refused(
    populated: StateStore, bad: OffloadReportRecord, error: str
) -> None:
    populated.create_deployment(deployment())
    with pytest.raises(ConstraintError, match=error):
        populated.put_offload_report(bad, keep=8)
    assert populated.list_offload_reports() == []


def test_a_version_3_file_gains_offload_reports(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = MIGRATIONS[database.backend]
    database.use_migrations(monkeypatch, scripts[:3])
    with database.open() as old:
        old.put_client("alice", KEY)
        old.put_model(model())
        old.upsert_node(node("n1"))
        old.upsert_node(node("n2", site="site-b"))
        old.create_deployment(deployment())
    # Written as a version-3 broker did: with the span gap, without `prewarmed`.
    database.query(
        "INSERT INTO migrations (migration_id, deployment_id, trigger, source_node, "
        "target_node, strategy, state, timeline_json, outcome, reason, downtime_ms, "
        "failed_requests, created_at, updated_at, span_gap_ms) SELECT 'm1', 'd1', "
        f"'mobility', 'n1', 'n2', 'make_before_break', '{MigrationState.PREPARING}', '[]', "
        f"'', '{migration().reason}', NULL, NULL, 40.0, 40.0, 140.0"
    )
    assert database.schema_version() == 3
    assert "offload_reports" not in database.tables()
    database.use_migrations(monkeypatch, scripts)
    with database.open() as upgraded:
        assert upgraded.list_offload_reports() == []
        assert upgraded.list_migrations() == [migration(span_gap_ms=140.0)]
        assert upgraded.put_offload_report(report(50.0), keep=8)
        assert upgraded.list_offload_reports() == [report(50.0)]
    assert database.schema_version() == LATEST


# -- standbys -----------------------------------------------------------------------------


def standby(epoch: int = 2, node_id: str = "n2", **changes: Any) -> StandbyRecord:
    record = StandbyRecord(
        deployment_id="d1",
        epoch=epoch,
        node_id=node_id,
        site="site-b",
        gpus=(0, 1),
        created_at=50.0,
    )
    return dataclasses.replace(record, **changes)


def test_a_standby_is_recorded_once_and_deleted_only_by_its_owner(populated: StateStore) -> None:
    populated.create_deployment(deployment())
    populated.put_standby(standby())
    assert populated.list_standbys() == [standby()]
    with pytest.raises(ConstraintError, match="d1@2 is recorded already"):
        populated.put_standby(standby(node_id="n1"))
    # Another epoch's or another node's standby of the deployment is not this one.
    assert not populated.delete_standby("d1", 3, "n2")
    assert not populated.delete_standby("d1", 2, "n1")
    assert populated.list_standbys() == [standby()]
    assert populated.delete_standby("d1", 2, "n2")
    assert populated.list_standbys() == []


def test_a_standby_of_an_unknown_deployment_or_node_is_refused(populated: StateStore) -> None:
    with pytest.raises(ConstraintError, match="deployment 'd1' is unknown"):
        populated.put_standby(standby())
    populated.create_deployment(deployment())
    with pytest.raises(ConstraintError, match="node 'n9' is unknown"):
        populated.put_standby(standby(node_id="n9"))
    assert populated.list_standbys() == []


def test_a_version_4_file_gains_standbys_and_its_migrations_read_not_prewarmed(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = MIGRATIONS[database.backend]
    database.use_migrations(monkeypatch, scripts[:4])
    with database.open() as old:
        old.put_client("alice", KEY)
        old.put_model(model())
        old.upsert_node(node("n1"))
        old.upsert_node(node("n2", site="site-b"))
        old.create_deployment(deployment())
    database.query(
        "INSERT INTO migrations (migration_id, deployment_id, trigger, source_node, "
        "target_node, strategy, state, timeline_json, outcome, reason, downtime_ms, "
        "failed_requests, created_at, updated_at, span_gap_ms) VALUES ('m1', 'd1', "
        "'mobility', 'n1', 'n2', 'make_before_break', 'completed', '[]', 'succeeded', '', "
        "80.0, 0, 40.0, 40.0, 90.0)"
    )
    assert "standbys" not in database.tables()
    database.use_migrations(monkeypatch, scripts)
    with database.open() as upgraded:
        (before,) = upgraded.list_migrations()
        assert before.prewarmed is False
        upgraded.create_migration(migration("m2", prewarmed=True))
        assert [m.prewarmed for m in upgraded.list_migrations()] == [False, True]
        upgraded.put_standby(standby())
        assert upgraded.list_standbys() == [standby()]
    assert database.schema_version() == LATEST


# -- resizes ------------------------------------------------------------------------------


def resize(event_id: str, at: float, deployment_id: str = "d1", **changes: Any) -> ResizeRecord:
    record = ResizeRecord(
        node_id="n1",
        event_id=event_id,
        deployment_id=deployment_id,
        replica_id=f"{deployment_id}-e1",
        cpus_before=0.5,
        cpus_after=1.25,
        policy="usage",
        reason="throttled 60% at 0.50 cores",
        at=at,
    )
    return dataclasses.replace(record, **changes)


def test_a_resize_reported_again_counts_once(populated: StateStore) -> None:
    store = populated
    store.create_deployment(deployment())
    first = [resize("r-1", 10.0), resize("r-2", 11.0)]
    assert store.put_resizes(first, keep=8) == first
    # The next heartbeat repeats the window with one new event.
    assert store.put_resizes([*first, resize("r-3", 12.0)], keep=8) == [resize("r-3", 12.0)]
    assert [r.event_id for r in store.list_resizes("d1")] == ["r-1", "r-2", "r-3"]
    # Another node may use the same event id: the key is (node, event).
    other = resize("r-1", 13.0, node_id="n2")
    assert store.put_resizes([other], keep=8) == [other]


def test_only_the_most_recent_resizes_of_a_deployment_stay(populated: StateStore) -> None:
    store = populated
    store.create_deployment(deployment())
    store.create_deployment(deployment("d2"))
    store.put_resizes([resize("x", 1.0, "d2")], keep=2)
    store.put_resizes([resize(f"r-{i}", float(i)) for i in range(5)], keep=2)
    assert [r.event_id for r in store.list_resizes("d1")] == ["r-3", "r-4"]
    assert [r.event_id for r in store.list_resizes()] == ["x", "r-3", "r-4"]
    assert [r.event_id for r in store.list_resizes(limit=1)] == ["r-4"]


def test_resizes_of_unknown_deployments_are_skipped_and_deleting_drops_them(
    populated: StateStore, database: Database
) -> None:
    store = populated
    store.create_deployment(deployment())
    assert store.put_resizes([resize("r-1", 1.0, "d9"), resize("r-2", 2.0)], keep=8) == [
        resize("r-2", 2.0)
    ]
    store.delete_deployment("d1")
    assert store.list_resizes() == []
    assert database.query("SELECT COUNT(*) FROM resizes") == [(0,)]


def test_a_resize_breaking_a_rule_writes_nothing(populated: StateStore) -> None:
    store = populated
    store.create_deployment(deployment())
    with pytest.raises(ConstraintError, match=CHECK_FAILED):
        store.put_resizes([resize("r-1", 1.0), resize("r-2", 2.0, cpus_after=-1.0)], keep=8)
    assert store.list_resizes() == []
    with pytest.raises(ValueError, match="keep must be at least 1"):
        store.put_resizes([resize("r-1", 1.0)], keep=0)


# -- PostgreSQL only ----------------------------------------------------------------------


@pytest.fixture
def pg(postgresql_url: str, tmp_path: Path) -> Database:
    return Database("postgresql", postgresql_url, tmp_path)


def test_postgresql_keeps_the_schema_version_in_a_table_of_one_row(pg: Database) -> None:
    pg.open().close()
    assert pg.query("SELECT version FROM schema_version") == [(LATEST,)]
    # Text keys sort bytewise, as SQLite's do, whatever the database's locale.
    collations = pg.query(
        "SELECT DISTINCT collation_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND column_name = 'deployment_id'"
    )
    assert collations == [("C",)]


def test_postgresql_a_newer_schema_is_refused_and_left_untouched(pg: Database) -> None:
    pg.query("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    pg.query(f"INSERT INTO schema_version VALUES ({LATEST + 1})")
    with pytest.raises(SchemaError, match=f"schema version {LATEST + 1}, newer than"):
        pg.open()
    assert pg.tables() == {"schema_version"}
    assert pg.schema_version() == LATEST + 1


def test_postgresql_openers_racing_on_an_empty_database_migrate_it_once(
    pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="broker.state.store")
    start = threading.Barrier(4)

    def open_and_close(_: int) -> None:
        start.wait()
        pg.open().close()

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(open_and_close, range(4)))
    # A script applied twice would have failed ("relation already exists"), and its opener
    # raised SchemaError: each version was reached once, by one of them.
    migrated = [r.getMessage() for r in caplog.records if "migrated to schema" in r.message]
    assert len(migrated) == LATEST
    assert pg.schema_version() == LATEST


def test_postgresql_a_writer_waits_for_the_rows_another_is_changing(
    pg: Database, postgresql_url: str
) -> None:
    with pg.open() as first, pg.open() as second:
        first.put_client("alice", KEY)
        first.put_model(model())
        first.create_deployment(deployment())
        with ThreadPoolExecutor(max_workers=1) as pool, first.transaction():
            first.update_deployment("d1", epoch=1)
            waiting = pool.submit(second.update_deployment, "d1", reason="moved")
            wait_for_a_lock_wait(postgresql_url)
            assert not waiting.done()
        # The second read the row after the first committed: both changes stand.
        assert waiting.result(timeout=30) == second.get_deployment("d1")
        stored = first.get_deployment("d1")
    assert stored is not None
    assert (stored.epoch, stored.reason) == (1, "moved")


def wait_for_a_lock_wait(url: str, deadline_s: float = 30.0) -> None:
    """Return once some connection to the database waits for a lock another holds."""
    deadline = time.monotonic() + deadline_s
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            waiting = conn.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock'"
            ).fetchone()
            if waiting is not None and waiting[0] > 0:
                return
            time.sleep(0.01)
    raise AssertionError(f"no connection waited for a lock within {deadline_s} s")


def test_postgresql_a_dropped_connection_fails_one_call_then_is_replaced(
    pg: Database, caplog: pytest.LogCaptureFixture
) -> None:
    with pg.open() as store:
        store.upsert_node(node("n1"))
        pg.query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        with pytest.raises(StorageError, match="on database postgresql://"):
            store.list_nodes()
        assert store.list_nodes() == [node("n1")]
    assert "the connection to database postgresql://" in caplog.text


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://broker:{secret}@127.0.0.1:1/offload", "cannot connect to the state"),
        ("postgres://broker:{secret}@[::1/offload", "not a valid PostgreSQL URL"),
        ("postgresql://broker@127.0.0.1:1/offload?password={secret}&sslmode=bogus",
         "cannot connect to the state"),
        ("mysql://broker:{secret}@db/offload", "neither a folder nor a PostgreSQL URL"),
    ],
    ids=["unreachable", "malformed", "bad-option", "other-scheme"],
)  # fmt: skip
def test_postgresql_a_bad_url_is_a_storage_error_without_its_password(
    url: str, message: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "hunter2-not-for-logs"
    with pytest.raises(StorageError, match=message) as refused:
        open_store(url.format(secret=secret), tmp_path)
    assert "***" in str(refused.value)
    assert secret not in str(refused.value)
    assert refused.value.__cause__ is None or secret not in str(refused.value.__cause__)
    assert secret not in caplog.text
    assert not list(tmp_path.iterdir())  # no SQLite file made for a URL


def test_postgresql_an_unknown_database_is_named_without_the_password(
    postgresql_server: PostgresServer, tmp_path: Path
) -> None:
    url = postgresql_server.url("nowhere").replace("postgres@", "postgres:hunter2-secret@")
    with pytest.raises(StorageError, match='database "nowhere" does not exist') as refused:
        open_store(url, tmp_path)
    assert "postgresql://postgres:***@/nowhere" in str(refused.value)
    assert "hunter2" not in str(refused.value)


def test_postgresql_the_store_shows_its_url_without_the_password(pg: Database) -> None:
    url = pg.location.replace("postgres@", "postgres:hunter2-secret@")
    with open_store(url, pg.state_dir) as store:
        assert store.path is None
        for shown in (store.location, repr(store), repr(store._backend)):
            assert "postgres:***@" in shown
            assert "hunter2" not in shown


# -- leader leases ------------------------------------------------------------------------


def test_a_lease_has_one_holder_and_each_new_holder_a_higher_term(database: Database) -> None:
    with database.open() as first, database.open() as second:
        lease = first.acquire_lease("leader", "broker-a", ttl_s=60)
        assert lease is not None
        assert (lease.holder, lease.term) == ("broker-a", 1)
        assert second.acquire_lease("leader", "broker-b", ttl_s=60) is None
        # Its holder taking it again extends it in the same term.
        again = first.acquire_lease("leader", "broker-a", ttl_s=120)
        assert again is not None
        assert again.term == 1 and again.expires_at > lease.expires_at
        renewed = first.renew_lease(again, ttl_s=60)
        assert renewed is not None and renewed.term == 1

        assert first.release_lease(renewed)
        assert not first.release_lease(renewed)
        taken = second.acquire_lease("leader", "broker-b", ttl_s=60)
        assert taken is not None
        assert (taken.holder, taken.term) == ("broker-b", 2)
        assert first.renew_lease(renewed, ttl_s=60) is None
        # Leases of other names are their own.
        other = first.acquire_lease("rebalancer", "broker-a", ttl_s=60)
        assert other is not None and other.term == 1


def test_a_write_fenced_by_a_lost_lease_is_refused_whole(populated: StateStore) -> None:
    store = populated
    old = store.acquire_lease("leader", "broker-a", ttl_s=60)
    assert old is not None
    with store.transaction():
        store.create_deployment(deployment("d1"))
        store.check_lease("leader", old.term)
    assert store.release_lease(old)
    new = store.acquire_lease("leader", "broker-b", ttl_s=60)
    assert new is not None
    with (
        pytest.raises(LeaseLost, match="no longer held at term 1 \\(now: term 2 of 'broker-b'\\)"),
        store.transaction(),
    ):
        store.create_deployment(deployment("d2"))
        store.check_lease("leader", old.term)
    assert [d.deployment_id for d in store.list_deployments()] == ["d1"]
    with pytest.raises(LeaseLost, match="now: none"), store.transaction():
        store.check_lease("nobody-holds-this", 1)
    with pytest.raises(RuntimeError, match="inside transaction"):
        store.check_lease("leader", new.term)


def test_a_fenced_store_commits_nothing_once_its_lease_is_taken(
    database: Database, clock: Clock
) -> None:
    with database.open(clock) as leader, database.open(clock) as other:
        lease = leader.acquire_lease("broker", "broker-a", ttl_s=60)
        assert lease is not None
        lost: list[LeaseLost] = []
        leader.fence("broker", lease.term, lost.append)
        leader.put_model(model())  # held: writes commit
        assert leader.renew_lease(lease, ttl_s=60) is not None  # lease calls are not fenced
        assert leader.get_lease("broker") is not None
        assert leader.release_lease(lease)
        assert leader.get_lease("broker") is None
        taken = other.acquire_lease("broker", "broker-b", ttl_s=60)
        assert taken is not None and leader.get_lease("broker") == taken
        with pytest.raises(LeaseLost, match="no longer held at term 1"):
            leader.upsert_node(node("n1"))
        assert len(lost) == 1 and "term 2 of 'broker-b'" in str(lost[0])
        assert other.list_nodes() == [] and len(other.list_models()) == 1


def test_an_expired_lease_goes_to_the_next_taker(database: Database) -> None:
    with database.open() as first, database.open() as second:
        lease = first.acquire_lease("leader", "broker-a", ttl_s=0.05)
        assert lease is not None
        deadline = time.monotonic() + 30
        taken = None
        while taken is None and time.monotonic() < deadline:
            time.sleep(0.01)
            taken = second.acquire_lease("leader", "broker-b", ttl_s=60)
        assert taken is not None and taken.term == lease.term + 1
        assert first.renew_lease(lease, ttl_s=60) is None
        with pytest.raises(LeaseLost), first.transaction():
            first.check_lease("leader", lease.term)


@pytest.mark.parametrize("ttl_s", [0.0, -1.0, float("nan"), float("inf"), 86400.5])
def test_a_lease_needs_a_finite_positive_ttl(store: StateStore, ttl_s: float) -> None:
    with pytest.raises(ValueError, match="ttl must be over 0"):
        store.acquire_lease("leader", "broker-a", ttl_s=ttl_s)
    assert store.acquire_lease("leader", "broker-a", ttl_s=1) is not None
