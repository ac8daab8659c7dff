"""The store's services (schema versions 9 and 10): services, their replicas, their
attached clients and their scale decisions, in a real SQLite file and a real PostgreSQL
database (the `database` fixture of `test_state`'s kind, once per backend)."""

from __future__ import annotations

import dataclasses
import hashlib
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from broker.state import (
    ConstraintError,
    ScaleAction,
    ServiceClientRecord,
    ServiceEventRecord,
    ServiceRecord,
    ServiceReplicaRecord,
    StateError,
    StateStore,
)
from broker.state.schema import MIGRATIONS
from runtime.batching import PriorityClass
from tests.unit.test_state import (
    CHECK_FAILED,
    KEY,
    LATEST,
    SHA,
    Clock,
    Database,
    deployment,
    model,
    node,
)

TOKEN = hashlib.sha256(b"token").hexdigest()
OTHER_TOKEN = hashlib.sha256(b"other token").hexdigest()
SERVICE_TABLES = {"services", "service_replicas", "service_clients", "service_events"}


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    if request.param == "sqlite":
        return Database("sqlite", "", tmp_path)
    return Database("postgresql", request.getfixturevalue("postgresql_url"), tmp_path)


@pytest.fixture
def store(database: Database) -> Iterator[StateStore]:
    with database.open(Clock()) as opened:
        opened.put_model(model())
        yield opened


def service(name: str = "detector", **changes: Any) -> ServiceRecord:
    record = ServiceRecord(
        name=name,
        owner="alice",
        model_sha256=SHA,
        spec_json='{"gpus": 1, "any_client": false, "clients": ["bob"]}',
        created_at=50.0,
    )
    return dataclasses.replace(record, **changes)


def replica(deployment_id: str = "d1", **changes: Any) -> ServiceReplicaRecord:
    record = ServiceReplicaRecord(
        deployment_id=deployment_id, service="detector", site="site-a", created_at=60.0
    )
    return dataclasses.replace(record, **changes)


def client(client_id: str = "bob", **changes: Any) -> ServiceClientRecord:
    record = ServiceClientRecord(
        service="detector",
        client_id=client_id,
        token_sha256=TOKEN,
        priority_class=PriorityClass.STANDARD,
        deployment_id="d1",
        site="site-a",
        attached_at=70.0,
    )
    return dataclasses.replace(record, **changes)


def event(at: float, **changes: Any) -> ServiceEventRecord:
    record = ServiceEventRecord(
        service="detector",
        at=at,
        action=ScaleAction.START,
        deployment_id="d1",
        site="site-a",
        reason="a client attached at site-a: none runs yet",
    )
    return dataclasses.replace(record, **changes)


def counts(database: Database) -> dict[str, int]:
    """Rows in each service table, read from outside the store."""
    found = {}
    for table in sorted(SERVICE_TABLES):
        ((rows,),) = database.query(f"SELECT count(*) FROM {table}")
        assert isinstance(rows, int)
        found[table] = rows
    return found


# -- the schema ---------------------------------------------------------------------------


def test_a_new_state_has_the_service_tables(store: StateStore, database: Database) -> None:
    assert database.schema_version() == LATEST
    assert database.tables() >= SERVICE_TABLES


def test_postgresql_service_keys_sort_bytewise(postgresql_url: str, tmp_path: Path) -> None:
    pg = Database("postgresql", postgresql_url, tmp_path)
    pg.open().close()
    collations = pg.query(
        "SELECT table_name, column_name, collation_name FROM information_schema.columns "
        "WHERE table_schema = current_schema() AND table_name LIKE 'service%' "
        "AND column_name IN ('name', 'service', 'client_id', 'deployment_id') ORDER BY 1, 2"
    )
    assert collations == [
        ("service_clients", "client_id", "C"),
        ("service_clients", "deployment_id", "C"),
        ("service_clients", "service", "C"),
        ("service_events", "deployment_id", "C"),
        ("service_events", "service", "C"),
        ("service_replicas", "deployment_id", "C"),
        ("service_replicas", "service", "C"),
        ("services", "name", "C"),
    ]


@pytest.mark.parametrize(
    ("token_sha256", "priority_class"),
    [(TOKEN, "urgent"), (TOKEN, "Standard"), (TOKEN.upper(), "standard"), ("ab", "standard")],
    ids=["unknown-class", "class-case", "upper-case-hash", "short-hash"],
)
def test_the_schema_itself_refuses_a_bad_class_or_token_hash(
    store: StateStore, database: Database, token_sha256: str, priority_class: str
) -> None:
    store.create_service(service())
    with pytest.raises((sqlite3.IntegrityError, psycopg.errors.CheckViolation)):
        database.query(
            "INSERT INTO service_clients (service, client_id, token_sha256, priority_class, "
            f"deployment_id, site, attached_at) VALUES ('detector', 'bob', '{token_sha256}', "
            f"'{priority_class}', 'd1', 'site-a', 70.0)"
        )
    assert store.list_service_clients() == []


# -- services -----------------------------------------------------------------------------


def test_services_round_trip_by_name(store: StateStore) -> None:
    store.create_service(service("zeta", created_at=51.0))
    store.create_service(service("alpha"))
    assert store.get_service("alpha") == service("alpha")
    assert store.get_service("zeta") == service("zeta", created_at=51.0)
    assert store.get_service("missing") is None
    assert [s.name for s in store.list_services()] == ["alpha", "zeta"]


def test_a_taken_name_is_refused_and_the_first_service_stays(
    store: StateStore, database: Database
) -> None:
    store.create_service(service())
    with pytest.raises(ConstraintError, match="service 'detector' exists already"):
        store.create_service(service(owner="carol", spec_json="{}"))
    assert store.list_services() == [service()]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"model_sha256": "0" * 64}, f"model '{'0' * 64}' is unknown"),
        ({"name": ""}, CHECK_FAILED),
        ({"owner": ""}, CHECK_FAILED),
        ({"spec_json": "[1]"}, CHECK_FAILED),
        ({"spec_json": "{not json"}, CHECK_FAILED),
    ],
    ids=["unknown-model", "empty-name", "empty-owner", "spec-not-an-object", "spec-not-json"],
)
def test_a_service_the_schema_refuses_writes_nothing(
    store: StateStore, database: Database, changes: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConstraintError, match=match):
        store.create_service(service(**changes))
    assert store.list_services() == []


def test_deleting_a_service_removes_its_replicas_and_clients_only(
    store: StateStore, database: Database
) -> None:
    store.create_service(service())
    store.create_service(service("other"))
    store.add_service_replica(replica("d1"))
    store.add_service_replica(replica("d2"))
    store.add_service_replica(replica("d3", service="other"))
    store.put_service_client(client("bob"))
    store.put_service_client(client("carol", deployment_id="d2"))
    store.put_service_client(client("bob", service="other", deployment_id="d3"))
    store.add_service_event(event(1.0))
    store.add_service_event(event(2.0, service="other", deployment_id="d3"))

    assert store.delete_service("detector") is True
    assert store.get_service("detector") is None
    assert store.list_service_replicas() == [replica("d3", service="other")]
    assert store.list_service_clients() == [client("bob", service="other", deployment_id="d3")]
    assert store.list_service_events("detector") == []
    assert store.list_service_events("other") == [event(2.0, service="other", deployment_id="d3")]
    assert store.delete_service("detector") is False
    assert counts(database) == {
        "service_clients": 1,
        "service_events": 1,
        "service_replicas": 1,
        "services": 1,
    }


def test_deleting_a_service_is_all_or_nothing(store: StateStore, database: Database) -> None:
    store.create_service(service())
    store.add_service_replica(replica())
    store.put_service_client(client())
    # The last of its deletes fails, in the database: the earlier ones are undone with it.
    if database.backend == "sqlite":
        database.query(
            "CREATE TRIGGER refuse BEFORE DELETE ON services "
            "BEGIN SELECT RAISE(ABORT, 'refused'); END"
        )
    else:
        database.query(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused'; END $$"
        )
        database.query(
            "CREATE TRIGGER refuse BEFORE DELETE ON services "
            "FOR EACH ROW EXECUTE FUNCTION refuse()"
        )
    with pytest.raises(StateError, match="refused"):
        store.delete_service("detector")
    assert counts(database) == {
        "service_clients": 1,
        "service_events": 0,
        "service_replicas": 1,
        "services": 1,
    }
    assert store.list_service_clients() == [client()]


# -- replicas -----------------------------------------------------------------------------


def test_replicas_round_trip_oldest_first_and_by_service(store: StateStore) -> None:
    store.create_service(service())
    store.create_service(service("other"))
    store.add_service_replica(replica("d2", created_at=61.0))
    store.add_service_replica(replica("d1"))
    store.add_service_replica(replica("d3", service="other", site="site-b", created_at=59.0))
    assert store.list_service_replicas("detector") == [
        replica("d1"),
        replica("d2", created_at=61.0),
    ]
    assert [r.deployment_id for r in store.list_service_replicas()] == ["d3", "d1", "d2"]
    assert store.list_service_replicas("missing") == []

    assert store.remove_service_replica("d1") is True
    assert store.remove_service_replica("d1") is False
    assert [r.deployment_id for r in store.list_service_replicas()] == ["d3", "d2"]


def test_a_replica_needs_its_service_and_is_recorded_once(
    store: StateStore, database: Database
) -> None:
    with pytest.raises(ConstraintError, match="service 'detector' is unknown"):
        store.add_service_replica(replica())
    store.create_service(service())
    store.create_service(service("other"))
    store.add_service_replica(replica())
    with pytest.raises(ConstraintError, match="deployment 'd1' is a replica already"):
        store.add_service_replica(replica(service="other", created_at=99.0))
    assert store.list_service_replicas() == [replica()]


def test_a_replica_needs_no_deployment_row(store: StateStore, database: Database) -> None:
    # Recorded before the deployment is (or after it is gone): no foreign key to deployments.
    store.create_service(service())
    store.add_service_replica(replica("not-a-deployment-yet"))
    assert store.get_deployment("not-a-deployment-yet") is None
    assert [r.deployment_id for r in store.list_service_replicas()] == ["not-a-deployment-yet"]


def test_removing_a_replica_leaves_its_clients_to_be_moved(store: StateStore) -> None:
    store.create_service(service())
    store.add_service_replica(replica("d1"))
    store.put_service_client(client("bob"))
    assert store.remove_service_replica("d1") is True
    assert store.list_service_clients(deployment_id="d1") == [client("bob")]


# -- clients ------------------------------------------------------------------------------


def test_clients_round_trip_filtered_and_by_attach_time(store: StateStore) -> None:
    store.create_service(service())
    store.create_service(service("other"))
    bob = client("bob", attached_at=72.0)
    carol = client("carol", deployment_id="d2", priority_class=PriorityClass.CRITICAL)
    dave = client("dave", service="other", priority_class=PriorityClass.BEST_EFFORT,
                  attached_at=71.0)  # fmt: skip
    for record in (bob, carol, dave):
        store.put_service_client(record)

    assert store.list_service_clients() == [carol, dave, bob]
    assert store.list_service_clients("detector") == [carol, bob]
    assert store.list_service_clients(deployment_id="d1") == [dave, bob]
    assert store.list_service_clients("detector", deployment_id="d1") == [bob]
    assert store.list_service_clients("missing") == []
    (read,) = store.list_service_clients("other")
    assert read.priority_class is PriorityClass.BEST_EFFORT

    assert store.delete_service_client("detector", "bob") is True
    assert store.delete_service_client("detector", "bob") is False
    assert store.delete_service_client("detector", "dave") is False  # on "other" only
    assert store.list_service_clients() == [carol, dave]


def test_a_re_attach_replaces_token_replica_site_and_class(
    store: StateStore, database: Database
) -> None:
    store.create_service(service())
    store.put_service_client(client())
    moved = client(
        token_sha256=OTHER_TOKEN,
        priority_class=PriorityClass.CRITICAL,
        deployment_id="d2",
        site="site-b",
        attached_at=80.0,
    )
    store.put_service_client(moved)
    assert store.list_service_clients() == [moved]
    assert counts(database)["service_clients"] == 1


def test_a_class_given_as_its_value_is_read_back_as_the_class(store: StateStore) -> None:
    store.create_service(service())
    store.put_service_client(client(priority_class="best-effort"))
    (read,) = store.list_service_clients()
    assert read.priority_class is PriorityClass.BEST_EFFORT


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"service": "missing"}, "service 'missing' is unknown"),
        ({"token_sha256": "not a hash"}, CHECK_FAILED),
        ({"token_sha256": TOKEN.upper()}, CHECK_FAILED),
        ({"priority_class": "urgent"}, "priority class 'urgent' is not one of"),
        ({"client_id": ""}, CHECK_FAILED),
    ],
    ids=["unknown-service", "bad-hash", "upper-case-hash", "bad-class", "empty-client"],
)
def test_a_refused_attach_writes_nothing_and_keeps_the_record_it_would_replace(
    store: StateStore, changes: dict[str, Any], match: str
) -> None:
    store.create_service(service())
    store.put_service_client(client())
    store.put_service_client(client("carol"))
    with pytest.raises(ConstraintError, match=match):
        store.put_service_client(client(deployment_id="d9", site="site-z", **changes))
    assert store.list_service_clients() == [client(), client("carol")]


def test_the_service_writes_join_a_callers_transaction(
    store: StateStore, database: Database
) -> None:
    store.create_service(service())

    class Undo(Exception):
        pass

    with pytest.raises(Undo), store.transaction():
        store.add_service_replica(replica())
        store.put_service_client(client())
        store.create_service(service("other"))
        store.add_service_event(event(1.0))
        raise Undo
    assert counts(database) == {
        "service_clients": 0,
        "service_events": 0,
        "service_replicas": 0,
        "services": 1,
    }


# -- the migration ------------------------------------------------------------------------


def test_a_version_8_state_gains_the_service_tables_and_keeps_its_rows(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = MIGRATIONS[database.backend]
    database.use_migrations(monkeypatch, scripts[:8])
    with database.open() as old:
        old.put_client("alice", KEY)
        old.put_model(model())
        old.upsert_node(node("n1"))
        old.create_deployment(deployment())
        assert old.bind_node_secret("n1", None, TOKEN, 10.0)
    assert database.schema_version() == 8
    assert not SERVICE_TABLES & database.tables()

    database.use_migrations(monkeypatch, scripts)
    with database.open() as upgraded:
        assert [c.client_id for c in upgraded.list_clients()] == ["alice"]
        assert upgraded.list_models() == [model()]
        assert upgraded.get_node("n1") == node("n1")
        assert upgraded.get_deployment("d1") == deployment()
        assert upgraded.node_secrets() == {"n1": TOKEN}
        upgraded.create_service(service())
        upgraded.add_service_replica(replica())
        upgraded.put_service_client(client())
    assert database.schema_version() == LATEST
    with database.open() as reopened:
        assert reopened.list_services() == [service()]
        assert reopened.list_service_replicas() == [replica()]
        assert reopened.list_service_clients() == [client()]


# -- scale decisions ----------------------------------------------------------------------


def test_scale_decisions_round_trip_oldest_first_the_most_recent_kept(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("broker.state.store.SERVICE_EVENTS_KEPT", 3)
    store.create_service(service())
    store.create_service(service("other"))
    store.add_service_event(event(0.5, service="other"))
    stop = event(5.0, action=ScaleAction.STOP, reason="no client on it for 60 s")
    for record in (event(1.0), event(2.0), event(3.0), event(4.0), stop):
        store.add_service_event(record)
    assert store.list_service_events("detector") == [event(3.0), event(4.0), stop]
    assert store.list_service_events("detector", limit=1) == [stop]
    assert store.list_service_events("other") == [event(0.5, service="other")]
    assert store.list_service_events("nobody") == []


@pytest.mark.parametrize(
    ("changes", "refused"),
    [
        ({"service": "nobody"}, "service 'nobody'"),
        ({"action": "resize"}, "scale action 'resize' is not one of: start, stop"),
        ({"deployment_id": ""}, CHECK_FAILED),
        ({"reason": ""}, CHECK_FAILED),
    ],
)
def test_a_scale_decision_the_schema_refuses_writes_nothing(
    store: StateStore, database: Database, changes: dict[str, Any], refused: str
) -> None:
    store.create_service(service())
    with pytest.raises(ConstraintError, match=refused):
        store.add_service_event(event(1.0, **changes))
    assert counts(database)["service_events"] == 0


def test_a_version_9_state_gains_the_scale_decisions_and_keeps_its_services(
    database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    scripts = MIGRATIONS[database.backend]
    database.use_migrations(monkeypatch, scripts[:9])
    with database.open() as old:
        old.put_model(model())
        old.create_service(service())
        old.add_service_replica(replica())
        old.put_service_client(client())
    assert database.schema_version() == 9
    assert "service_events" not in database.tables()

    database.use_migrations(monkeypatch, scripts)
    with database.open() as upgraded:
        assert upgraded.list_services() == [service()]
        assert upgraded.list_service_replicas() == [replica()]
        assert upgraded.list_service_clients() == [client()]
        upgraded.add_service_event(event(1.0))
    assert database.schema_version() == LATEST
    with database.open() as reopened:
        assert reopened.list_service_events("detector") == [event(1.0)]
