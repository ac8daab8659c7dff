"""`GroupCommitter`, the broker's state thread, on a real SQLite file and a real PostgreSQL
database: the calls queued together commit together, and what each caller sees is what it
would see alone (its own failure undoes only its own changes; a database failure reruns
every call alone)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from pathlib import Path

import pytest

from broker.state import (
    ConstraintError,
    GroupCommitter,
    StateStore,
    StorageError,
    new_api_key,
)
from broker.state.opener import open_store
from tests.unit.test_state import deployment, model, node

WAIT_S = 30.0


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    location = "" if request.param == "sqlite" else request.getfixturevalue("postgresql_url")
    with open_store(location, tmp_path) as opened:
        yield opened


class Committer:
    """A `GroupCommitter` whose commits are recorded, and a way to stop its thread."""

    def __init__(self, store: StateStore, max_batch: int = 64) -> None:
        self.commits: list[int] = []
        self.thread = GroupCommitter(store, self.commits.append, max_batch=max_batch)

    def hold(self) -> threading.Event:
        """Keep the state thread busy until the event is set: calls queue up meanwhile."""
        running, go = threading.Event(), threading.Event()

        def wait() -> None:
            running.set()
            go.wait(WAIT_S)

        self.thread.submit(wait)
        assert running.wait(WAIT_S)
        return go


def put(store: StateStore, client_id: str) -> Callable[[], None]:
    key = new_api_key(client_id)
    return lambda: store.put_client(client_id, key)


def clients(store: StateStore) -> set[str]:
    return {c.client_id for c in store.list_clients()}


def test_calls_queued_together_commit_once(store: StateStore) -> None:
    committer = Committer(store)
    go = committer.hold()
    futures = [committer.thread.submit(put(store, f"c{i}")) for i in range(5)]
    go.set()
    for future in futures:
        assert future.result(WAIT_S) is None
    committer.thread.shutdown()
    assert committer.commits == [1, 5]  # the holder alone, then the five in one commit
    assert clients(store) == {f"c{i}" for i in range(5)}


def test_a_batch_takes_at_most_max_batch_calls(store: StateStore) -> None:
    committer = Committer(store, max_batch=4)
    go = committer.hold()
    futures = [committer.thread.submit(put(store, f"c{i}")) for i in range(10)]
    go.set()
    for future in futures:
        future.result(WAIT_S)
    committer.thread.shutdown()
    assert committer.commits == [1, 4, 4, 2]


def test_a_call_that_raises_undoes_only_its_own_changes(store: StateStore) -> None:
    committer = Committer(store)
    go = committer.hold()
    write_first = put(store, "half")

    def half_done() -> None:
        write_first()
        raise ValueError("refused after writing")

    before = committer.thread.submit(put(store, "before"))
    failing = committer.thread.submit(half_done)
    after = committer.thread.submit(put(store, "after"))
    go.set()
    before.result(WAIT_S)
    after.result(WAIT_S)
    with pytest.raises(ValueError, match="refused after writing"):
        failing.result(WAIT_S)
    committer.thread.shutdown()
    assert committer.commits == [1, 3]
    assert clients(store) == {"before", "after"}


def test_a_database_failure_in_a_batch_runs_every_call_again_alone(store: StateStore) -> None:
    committer = Committer(store)
    go = committer.hold()
    tries = {"flaky": 0}
    write_flaky = put(store, "flaky")

    def flaky() -> None:
        tries["flaky"] += 1
        write_flaky()
        if tries["flaky"] == 1:
            raise StorageError("disk I/O error")

    futures = [
        committer.thread.submit(put(store, "one")),
        committer.thread.submit(flaky),
        committer.thread.submit(put(store, "two")),
    ]
    go.set()
    for future in futures:
        assert future.result(WAIT_S) is None
    committer.thread.shutdown()
    assert tries["flaky"] == 2
    assert committer.commits == [1, 1, 1, 1]  # the batch undone, each call then alone
    assert clients(store) == {"one", "flaky", "two"}


def test_a_call_cancelled_before_it_ran_is_skipped(store: StateStore) -> None:
    committer = Committer(store)
    go = committer.hold()
    kept = committer.thread.submit(put(store, "kept"))
    dropped: Future[None] = committer.thread.submit(put(store, "dropped"))
    assert dropped.cancel()
    go.set()
    kept.result(WAIT_S)
    committer.thread.shutdown()
    with pytest.raises(CancelledError):
        dropped.result(0)
    assert clients(store) == {"kept"}


def test_shutdown_runs_what_is_queued_and_then_refuses_calls(store: StateStore) -> None:
    committer = Committer(store)
    go = committer.hold()
    queued = committer.thread.submit(put(store, "queued"))
    stopping = threading.Thread(target=committer.thread.shutdown)
    stopping.start()
    go.set()
    stopping.join(WAIT_S)
    assert queued.result(0) is None
    assert clients(store) == {"queued"}
    with pytest.raises(RuntimeError, match="shut down"):
        committer.thread.submit(put(store, "late"))
    committer.thread.shutdown()  # again: nothing to do


def test_a_refused_deployment_write_in_a_batch_is_named_and_the_others_commit(
    store: StateStore,
) -> None:
    # The store leaves the checks to the schema's keys and names what was unknown only once
    # a write failed: inside a batch's savepoint too (on PostgreSQL the failed statement
    # aborts the savepoint, and the naming reads run after it is undone).
    store.put_client("alice", new_api_key("alice"))
    store.put_model(model())
    store.upsert_node(node("n1"))
    committer = Committer(store)
    go = committer.hold()
    writes = {
        "d1": deployment("d1", node_id="n1"),
        "ghost": deployment("d2", node_id="ghost"),
        "mallory": deployment("d3", client_id="mallory"),
        "again": deployment("d1"),
        "d4": deployment("d4"),
    }
    futures = {k: committer.thread.submit(store.create_deployment, r) for k, r in writes.items()}
    moved = committer.thread.submit(store.update_deployment, "d4", node_id="ghost")
    go.set()
    assert futures["d1"].result(WAIT_S) is None and futures["d4"].result(WAIT_S) is None
    for key, message in [
        ("ghost", "node 'ghost' is unknown"),
        ("mallory", "client 'mallory' is unknown"),
        ("again", "deployment 'd1' exists already"),
    ]:
        with pytest.raises(ConstraintError, match=message):
            futures[key].result(WAIT_S)
    with pytest.raises(ConstraintError, match="node 'ghost' is unknown"):
        moved.result(WAIT_S)
    committer.thread.shutdown()
    assert committer.commits == [1, 6]
    assert [d.deployment_id for d in store.list_deployments()] == ["d1", "d4"]
    assert store.get_deployment("d4") == deployment("d4")
