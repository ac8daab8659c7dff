"""The broker's durable state: an SQLite file in WAL mode or a PostgreSQL database, schema
versioned.

    from broker.state import DeploymentRecord, DeploymentState
    from broker.state.opener import open_store
    store = open_store(location, state_dir)  # "" or a URL; blocking: use asyncio.to_thread
    with store.transaction():                # several changes, all or none
        store.create_deployment(record)
        store.append_event("deployment.created", record.deployment_id, "{}")

`store` has the logic, `backend` the seam to a database, `sqlite_backend` and
`postgres_backend` the adapters (the only `sqlite3` and `psycopg` users), `opener` the one
module that chooses an adapter by the location and hands it to the store, `records` the values
it keeps, `schema` the migration scripts of both, `api_keys` the key format and its hashing,
`errors` the exceptions, `group_commit` the thread the broker runs its calls on (the calls
queued together commit together).
"""

from broker.state.api_keys import new_api_key, parse_api_key, parse_api_keys_file
from broker.state.errors import (
    ConstraintError,
    LeaseLost,
    SchemaError,
    StateError,
    StorageError,
)
from broker.state.group_commit import GroupCommitter
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
from broker.state.store import StateStore

__all__ = [
    "ClientRecord",
    "ConstraintError",
    "DeploymentRecord",
    "DeploymentState",
    "EventRecord",
    "GroupCommitter",
    "KeyChanges",
    "Lease",
    "LeaseLost",
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
    "ScaleAction",
    "SchemaError",
    "ServiceClientRecord",
    "ServiceEventRecord",
    "ServiceRecord",
    "ServiceReplicaRecord",
    "StandbyRecord",
    "StateError",
    "StateStore",
    "StorageError",
    "new_api_key",
    "parse_api_key",
    "parse_api_keys_file",
]
