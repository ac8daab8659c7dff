"""The broker's durable state: one SQLite file in WAL mode, schema versioned.

    from broker.state import StateStore, DeploymentRecord, DeploymentState
    store = StateStore(state_dir)          # blocking: call it through asyncio.to_thread
    with store.transaction():              # several changes, all or none
        store.create_deployment(record)
        store.append_event("deployment.created", record.deployment_id, "{}")

`store` has the adapter (the only `sqlite3` user), `records` the values it keeps, `schema`
the migration scripts, `api_keys` the key format and its hashing, `errors` the exceptions.
"""

from broker.state.api_keys import new_api_key, parse_api_key, parse_api_keys_file
from broker.state.errors import ConstraintError, SchemaError, StateError, StorageError
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
from broker.state.store import DB_FILENAME, StateStore

__all__ = [
    "DB_FILENAME",
    "ClientRecord",
    "ConstraintError",
    "DeploymentRecord",
    "DeploymentState",
    "EventRecord",
    "KeyChanges",
    "MigrationRecord",
    "MigrationState",
    "MigrationStrategy",
    "MigrationTrigger",
    "ModelRecord",
    "NodeRecord",
    "NodeState",
    "OffloadCount",
    "OffloadReportRecord",
    "OffloadSummary",
    "ResizeRecord",
    "SchemaError",
    "StandbyRecord",
    "StateError",
    "StateStore",
    "StorageError",
    "new_api_key",
    "parse_api_key",
    "parse_api_keys_file",
]
