"""The state's schema, as an ordered list of migration scripts for each database.

`MIGRATIONS[dialect][i]` takes a database from schema version `i` to `i + 1`; the version is
SQLite's `PRAGMA user_version`, PostgreSQL's table `schema_version` (0 for a new database).
`StateStore` applies the missing scripts at open, each in its own transaction together with
the new version number, so a crash mid-migration leaves the database at the previous version.
Both lists have the same versions: version `n` has the same tables, columns and rules in both,
spelled in each database's dialect. Rules for adding one:

- append to both lists, never edit a released script (databases in the field have run it);
- a new enum member of a column with a CHECK on its values needs a script that rebuilds the
  table (SQLite cannot alter a CHECK); the migrations table has no such CHECKs on purpose, as
  its enums are young;
- scripts hold no BEGIN/COMMIT: the store wraps them.

SQLite: tables are STRICT (column types enforced, SQLite >= 3.37) and JSON columns are checked
with `json_valid` (SQLite >= 3.38); the store refuses an older SQLite with a clear error.
PostgreSQL: REAL is DOUBLE PRECISION, INTEGER is BIGINT (0/1 flags stay INTEGER), JSON stays
text (kept as given) checked by a cast to `json`, and text keys sort in the "C" collation:
byte order, as SQLite's BINARY does, whatever the database's locale.
"""

from __future__ import annotations

_SQLITE_V1 = """
CREATE TABLE clients (
    client_id  TEXT PRIMARY KEY CHECK (client_id <> ''),
    key_hash   TEXT NOT NULL,
    created_at REAL NOT NULL
) STRICT;

CREATE TABLE client_sites (
    client_id  TEXT PRIMARY KEY REFERENCES clients (client_id),
    site       TEXT NOT NULL CHECK (site <> ''),
    updated_at REAL NOT NULL
) STRICT;

CREATE TABLE nodes (
    node_id           TEXT PRIMARY KEY CHECK (node_id <> ''),
    address           TEXT NOT NULL,
    site              TEXT NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('ready', 'lost', 'draining')),
    inventory_json    TEXT NOT NULL CHECK (json_valid(inventory_json)),
    runtimes_json     TEXT NOT NULL
                      CHECK (json_valid(runtimes_json) AND json_type(runtimes_json) = 'array'),
    registered_at     REAL NOT NULL,
    last_heartbeat_at REAL NOT NULL,
    usage_json        TEXT NOT NULL CHECK (json_valid(usage_json))
) STRICT;

CREATE TABLE models (
    sha256     TEXT PRIMARY KEY
               CHECK (length(sha256) = 64 AND NOT sha256 GLOB '*[^0-9a-f]*'),
    name       TEXT NOT NULL,
    size_bytes INTEGER NOT NULL CHECK (size_bytes > 0),
    created_at REAL NOT NULL
) STRICT;

CREATE TABLE deployments (
    deployment_id    TEXT PRIMARY KEY CHECK (deployment_id <> ''),
    client_id        TEXT NOT NULL REFERENCES clients (client_id),
    model_sha256     TEXT NOT NULL REFERENCES models (sha256),
    model_name       TEXT NOT NULL,
    request_json     TEXT NOT NULL CHECK (json_valid(request_json)),
    priority         INTEGER NOT NULL,
    site             TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (
                         state IN ('pending', 'starting', 'running', 'failed', 'deleting',
                                   'deleted')
                     ),
    node_id          TEXT REFERENCES nodes (node_id),
    gpus_json        TEXT NOT NULL
                     CHECK (json_valid(gpus_json) AND json_type(gpus_json) = 'array'),
    gpu_uuids_json   TEXT NOT NULL
                     CHECK (json_valid(gpu_uuids_json) AND json_type(gpu_uuids_json) = 'array'),
    endpoint         TEXT NOT NULL,
    token            TEXT NOT NULL,
    epoch            INTEGER NOT NULL CHECK (epoch >= 0),
    explanation_json TEXT NOT NULL CHECK (json_valid(explanation_json)),
    reason           TEXT NOT NULL,
    created_at       REAL NOT NULL,
    updated_at       REAL NOT NULL
) STRICT;
CREATE INDEX deployments_by_client ON deployments (client_id);
CREATE INDEX deployments_by_state ON deployments (state);
CREATE INDEX deployments_by_node ON deployments (node_id);

CREATE TABLE migrations (
    migration_id    TEXT PRIMARY KEY CHECK (migration_id <> ''),
    deployment_id   TEXT NOT NULL REFERENCES deployments (deployment_id),
    trigger         TEXT NOT NULL,
    source_node     TEXT NOT NULL REFERENCES nodes (node_id),
    target_node     TEXT NOT NULL REFERENCES nodes (node_id),
    strategy        TEXT NOT NULL,
    state           TEXT NOT NULL,
    timeline_json   TEXT NOT NULL CHECK (json_valid(timeline_json)),
    outcome         TEXT NOT NULL,
    reason          TEXT NOT NULL,
    downtime_ms     REAL CHECK (downtime_ms >= 0),
    failed_requests INTEGER CHECK (failed_requests >= 0),
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL
) STRICT;
CREATE INDEX migrations_by_deployment ON migrations (deployment_id);

CREATE TABLE events (
    seq         INTEGER PRIMARY KEY AUTOINCREMENT,
    at          REAL NOT NULL,
    kind        TEXT NOT NULL CHECK (kind <> ''),
    subject     TEXT NOT NULL,
    detail_json TEXT NOT NULL CHECK (json_valid(detail_json))
) STRICT;
"""

_SQLITE_V2 = """
CREATE TABLE model_owners (
    sha256     TEXT NOT NULL REFERENCES models (sha256),
    client_id  TEXT NOT NULL REFERENCES clients (client_id),
    created_at REAL NOT NULL,
    PRIMARY KEY (sha256, client_id)
) STRICT;
CREATE INDEX model_owners_by_client ON model_owners (client_id);

-- Who uploaded a model was not recorded before: a client that deployed a model owns it.
INSERT INTO model_owners (sha256, client_id, created_at)
    SELECT model_sha256, client_id, MIN(created_at) FROM deployments
    GROUP BY model_sha256, client_id;
"""
"""Version 2: which clients uploaded each model (a client deploys only those)."""

_SQLITE_V3 = """
-- NULL: not measured (every migration recorded before this version, and reports from
-- clients that measure only the switch).
ALTER TABLE migrations ADD COLUMN span_gap_ms REAL CHECK (span_gap_ms >= 0);
"""
"""Version 3: the longest gap a client saw over the whole migration (the decision to the old
replica stopped), beside `downtime_ms` (across the switch only)."""

_SQLITE_V4 = """
-- The latest adaptive offload summary of each client session of a deployment (cumulative
-- counts since the client started; a newer report of the session replaces the row).
CREATE TABLE offload_reports (
    deployment_id      TEXT NOT NULL REFERENCES deployments (deployment_id),
    client_id          TEXT NOT NULL REFERENCES clients (client_id),
    session            TEXT NOT NULL CHECK (session <> ''),
    policy             TEXT NOT NULL,
    local_model        TEXT NOT NULL,
    decisions_json     TEXT NOT NULL
                       CHECK (json_valid(decisions_json) AND json_type(decisions_json) = 'array'),
    remote_requests    INTEGER NOT NULL CHECK (remote_requests >= 0),
    local_requests     INTEGER NOT NULL CHECK (local_requests >= 0),
    fallbacks          INTEGER NOT NULL CHECK (fallbacks >= 0),
    remote_estimate_ms REAL CHECK (remote_estimate_ms >= 0),
    local_estimate_ms  REAL CHECK (local_estimate_ms >= 0),
    remote_reachable   INTEGER NOT NULL CHECK (remote_reachable IN (0, 1)),
    reported_at        REAL NOT NULL,
    PRIMARY KEY (deployment_id, client_id, session)
) STRICT;
"""
"""Version 4: adaptive offload summaries, the latest per (deployment, client, session)."""

_SQLITE_V5 = """
-- 1: the target was a pre-warmed standby replica (no start).
ALTER TABLE migrations ADD COLUMN prewarmed INTEGER NOT NULL DEFAULT 0
    CHECK (prewarmed IN (0, 1));

-- Standby replicas the broker started (or is starting) at a client's predicted next site,
-- written before the node is asked to start one: a broker that restarts finds every replica
-- it may have left and stops it (its own, by this record).
CREATE TABLE standbys (
    deployment_id TEXT NOT NULL REFERENCES deployments (deployment_id),
    epoch         INTEGER NOT NULL CHECK (epoch >= 1),
    node_id       TEXT NOT NULL REFERENCES nodes (node_id),
    site          TEXT NOT NULL,
    gpus_json     TEXT NOT NULL
                  CHECK (json_valid(gpus_json) AND json_type(gpus_json) = 'array'),
    created_at    REAL NOT NULL,
    PRIMARY KEY (deployment_id, epoch)
) STRICT;
"""
"""Version 5: predictive pre-warm: standby replicas, and which migrations switched to one."""

_SQLITE_V6 = """
-- CPU changes a node's resource manager made to a deployment's replica, with its reason
-- (reported in heartbeats; a node repeats its recent ones, so the key makes each one count
-- once). The broker keeps the most recent ones of each deployment.
CREATE TABLE resizes (
    node_id       TEXT NOT NULL REFERENCES nodes (node_id),
    event_id      TEXT NOT NULL CHECK (event_id <> ''),
    deployment_id TEXT NOT NULL REFERENCES deployments (deployment_id),
    replica_id    TEXT NOT NULL,
    cpus_before   REAL NOT NULL CHECK (cpus_before >= 0),
    cpus_after    REAL NOT NULL CHECK (cpus_after >= 0),
    policy        TEXT NOT NULL,
    reason        TEXT NOT NULL,
    at            REAL NOT NULL,
    PRIMARY KEY (node_id, event_id)
) STRICT;

CREATE INDEX resizes_by_deployment ON resizes (deployment_id, at);
"""
"""Version 6: the node resource managers' CPU resizes, with their reasons."""

_SQLITE_V7 = """
-- Leader leases: who holds each, under which term, until when (by the database's clock).
-- A row stays after its lease ends, so a term is never reused.
CREATE TABLE leases (
    name       TEXT PRIMARY KEY CHECK (name <> ''),
    holder     TEXT NOT NULL,
    term       INTEGER NOT NULL CHECK (term >= 0),
    expires_at REAL NOT NULL
) STRICT;
"""
"""Version 7: leader leases (`StateStore.acquire_lease`), for brokers sharing a database."""

_SQLITE_V8 = """
-- What a node id is bound to: the sha256 of the secret its first registration showed (the
-- node keeps the secret, 0600, in its state dir). Not a foreign key of nodes: a retired id
-- loses its row here and keeps its node row (history), and a binding may come first.
CREATE TABLE node_secrets (
    node_id       TEXT PRIMARY KEY CHECK (node_id <> ''),
    secret_sha256 TEXT NOT NULL
                  CHECK (length(secret_sha256) = 64 AND NOT secret_sha256 GLOB '*[^0-9a-f]*'),
    bound_at      REAL NOT NULL
) STRICT;
"""
"""Version 8: node identity (`StateStore.bind_node_secret`)."""

_SQLITE_V9 = """
-- Services: a model published once for many clients, owned by the client that created it.
-- spec_json is the service's spec (resources, allow-list, replicas, SLO) as the broker wrote it.
CREATE TABLE services (
    name         TEXT PRIMARY KEY CHECK (name <> ''),
    owner        TEXT NOT NULL CHECK (owner <> ''),
    model_sha256 TEXT NOT NULL REFERENCES models (sha256),
    spec_json    TEXT NOT NULL
                 CHECK (json_valid(spec_json) AND json_type(spec_json) = 'object'),
    created_at   REAL NOT NULL
) STRICT;

-- The deployments that are a service's replicas, recorded before each is started. Not a
-- foreign key of deployments: a deployment's own delete path may go first.
CREATE TABLE service_replicas (
    deployment_id TEXT PRIMARY KEY CHECK (deployment_id <> ''),
    service       TEXT NOT NULL REFERENCES services (name),
    site          TEXT NOT NULL,
    created_at    REAL NOT NULL
) STRICT;
CREATE INDEX service_replicas_by_service ON service_replicas (service);

-- Which replica each attached client of a service is on, with the sha256 of its own token
-- (the replica checks it) and its priority class there. A re-attach replaces the row.
CREATE TABLE service_clients (
    service        TEXT NOT NULL REFERENCES services (name),
    client_id      TEXT NOT NULL CHECK (client_id <> ''),
    token_sha256   TEXT NOT NULL
                   CHECK (length(token_sha256) = 64 AND NOT token_sha256 GLOB '*[^0-9a-f]*'),
    priority_class TEXT NOT NULL CHECK (priority_class IN ('critical', 'standard', 'best-effort')),
    deployment_id  TEXT NOT NULL,
    site           TEXT NOT NULL,
    attached_at    REAL NOT NULL,
    PRIMARY KEY (service, client_id)
) STRICT;
CREATE INDEX service_clients_by_deployment ON service_clients (deployment_id);
"""
"""Version 9: shared model services, their replicas and their attached clients."""

_SQLITE_V10 = """
-- Each scale decision of a service, as the broker explains it: a replica started (where,
-- why) or stopped; the most recent SERVICE_EVENTS_KEPT per service are kept.
CREATE TABLE service_events (
    service       TEXT NOT NULL REFERENCES services (name),
    at            REAL NOT NULL,
    action        TEXT NOT NULL CHECK (action IN ('start', 'stop')),
    deployment_id TEXT NOT NULL CHECK (deployment_id <> ''),
    site          TEXT NOT NULL,
    reason        TEXT NOT NULL CHECK (reason <> ''),
    seq           INTEGER PRIMARY KEY AUTOINCREMENT
) STRICT;
CREATE INDEX service_events_by_service ON service_events (service, seq);
"""
"""Version 10: services' scale decisions (`StateStore.add_service_event`)."""

# -- PostgreSQL: the same versions, in its dialect --------------------------------------------

_POSTGRES_V1 = """
CREATE TABLE schema_version (
    version INTEGER NOT NULL CHECK (version >= 0)
);
INSERT INTO schema_version (version) VALUES (0);

CREATE TABLE clients (
    client_id  TEXT COLLATE "C" PRIMARY KEY CHECK (client_id <> ''),
    key_hash   TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE client_sites (
    client_id  TEXT COLLATE "C" PRIMARY KEY REFERENCES clients (client_id),
    site       TEXT NOT NULL CHECK (site <> ''),
    updated_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE nodes (
    node_id           TEXT COLLATE "C" PRIMARY KEY CHECK (node_id <> ''),
    address           TEXT NOT NULL,
    site              TEXT NOT NULL,
    state             TEXT NOT NULL CHECK (state IN ('ready', 'lost', 'draining')),
    inventory_json    TEXT NOT NULL CHECK (inventory_json::json IS NOT NULL),
    runtimes_json     TEXT NOT NULL CHECK (json_typeof(runtimes_json::json) = 'array'),
    registered_at     DOUBLE PRECISION NOT NULL,
    last_heartbeat_at DOUBLE PRECISION NOT NULL,
    usage_json        TEXT NOT NULL CHECK (usage_json::json IS NOT NULL)
);

CREATE TABLE models (
    sha256     TEXT COLLATE "C" PRIMARY KEY CHECK (sha256 ~ '^[0-9a-f]{64}$'),
    name       TEXT NOT NULL,
    size_bytes BIGINT NOT NULL CHECK (size_bytes > 0),
    created_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE deployments (
    deployment_id    TEXT COLLATE "C" PRIMARY KEY CHECK (deployment_id <> ''),
    client_id        TEXT COLLATE "C" NOT NULL REFERENCES clients (client_id),
    model_sha256     TEXT COLLATE "C" NOT NULL REFERENCES models (sha256),
    model_name       TEXT NOT NULL,
    request_json     TEXT NOT NULL CHECK (request_json::json IS NOT NULL),
    priority         BIGINT NOT NULL,
    site             TEXT NOT NULL,
    state            TEXT NOT NULL CHECK (
                         state IN ('pending', 'starting', 'running', 'failed', 'deleting',
                                   'deleted')
                     ),
    node_id          TEXT COLLATE "C" REFERENCES nodes (node_id),
    gpus_json        TEXT NOT NULL CHECK (json_typeof(gpus_json::json) = 'array'),
    gpu_uuids_json   TEXT NOT NULL CHECK (json_typeof(gpu_uuids_json::json) = 'array'),
    endpoint         TEXT NOT NULL,
    token            TEXT NOT NULL,
    epoch            BIGINT NOT NULL CHECK (epoch >= 0),
    explanation_json TEXT NOT NULL CHECK (explanation_json::json IS NOT NULL),
    reason           TEXT NOT NULL,
    created_at       DOUBLE PRECISION NOT NULL,
    updated_at       DOUBLE PRECISION NOT NULL
);
CREATE INDEX deployments_by_client ON deployments (client_id);
CREATE INDEX deployments_by_state ON deployments (state);
CREATE INDEX deployments_by_node ON deployments (node_id);

CREATE TABLE migrations (
    migration_id    TEXT COLLATE "C" PRIMARY KEY CHECK (migration_id <> ''),
    deployment_id   TEXT COLLATE "C" NOT NULL REFERENCES deployments (deployment_id),
    trigger         TEXT NOT NULL,
    source_node     TEXT COLLATE "C" NOT NULL REFERENCES nodes (node_id),
    target_node     TEXT COLLATE "C" NOT NULL REFERENCES nodes (node_id),
    strategy        TEXT NOT NULL,
    state           TEXT NOT NULL,
    timeline_json   TEXT NOT NULL CHECK (timeline_json::json IS NOT NULL),
    outcome         TEXT NOT NULL,
    reason          TEXT NOT NULL,
    downtime_ms     DOUBLE PRECISION CHECK (downtime_ms >= 0),
    failed_requests BIGINT CHECK (failed_requests >= 0),
    created_at      DOUBLE PRECISION NOT NULL,
    updated_at      DOUBLE PRECISION NOT NULL
);
CREATE INDEX migrations_by_deployment ON migrations (deployment_id);

CREATE TABLE events (
    seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at          DOUBLE PRECISION NOT NULL,
    kind        TEXT NOT NULL CHECK (kind <> ''),
    subject     TEXT NOT NULL,
    detail_json TEXT NOT NULL CHECK (detail_json::json IS NOT NULL)
);
"""

_POSTGRES_V2 = """
CREATE TABLE model_owners (
    sha256     TEXT COLLATE "C" NOT NULL REFERENCES models (sha256),
    client_id  TEXT COLLATE "C" NOT NULL REFERENCES clients (client_id),
    created_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (sha256, client_id)
);
CREATE INDEX model_owners_by_client ON model_owners (client_id);

INSERT INTO model_owners (sha256, client_id, created_at)
    SELECT model_sha256, client_id, MIN(created_at) FROM deployments
    GROUP BY model_sha256, client_id;
"""

_POSTGRES_V3 = """
ALTER TABLE migrations ADD COLUMN span_gap_ms DOUBLE PRECISION CHECK (span_gap_ms >= 0);
"""

_POSTGRES_V4 = """
CREATE TABLE offload_reports (
    deployment_id      TEXT COLLATE "C" NOT NULL REFERENCES deployments (deployment_id),
    client_id          TEXT COLLATE "C" NOT NULL REFERENCES clients (client_id),
    session            TEXT COLLATE "C" NOT NULL CHECK (session <> ''),
    policy             TEXT NOT NULL,
    local_model        TEXT NOT NULL,
    decisions_json     TEXT NOT NULL CHECK (json_typeof(decisions_json::json) = 'array'),
    remote_requests    BIGINT NOT NULL CHECK (remote_requests >= 0),
    local_requests     BIGINT NOT NULL CHECK (local_requests >= 0),
    fallbacks          BIGINT NOT NULL CHECK (fallbacks >= 0),
    remote_estimate_ms DOUBLE PRECISION CHECK (remote_estimate_ms >= 0),
    local_estimate_ms  DOUBLE PRECISION CHECK (local_estimate_ms >= 0),
    remote_reachable   INTEGER NOT NULL CHECK (remote_reachable IN (0, 1)),
    reported_at        DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (deployment_id, client_id, session)
);
"""

_POSTGRES_V5 = """
ALTER TABLE migrations ADD COLUMN prewarmed INTEGER NOT NULL DEFAULT 0
    CHECK (prewarmed IN (0, 1));

CREATE TABLE standbys (
    deployment_id TEXT COLLATE "C" NOT NULL REFERENCES deployments (deployment_id),
    epoch         BIGINT NOT NULL CHECK (epoch >= 1),
    node_id       TEXT COLLATE "C" NOT NULL REFERENCES nodes (node_id),
    site          TEXT NOT NULL,
    gpus_json     TEXT NOT NULL CHECK (json_typeof(gpus_json::json) = 'array'),
    created_at    DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (deployment_id, epoch)
);
"""

_POSTGRES_V6 = """
CREATE TABLE resizes (
    node_id       TEXT COLLATE "C" NOT NULL REFERENCES nodes (node_id),
    event_id      TEXT COLLATE "C" NOT NULL CHECK (event_id <> ''),
    deployment_id TEXT COLLATE "C" NOT NULL REFERENCES deployments (deployment_id),
    replica_id    TEXT NOT NULL,
    cpus_before   DOUBLE PRECISION NOT NULL CHECK (cpus_before >= 0),
    cpus_after    DOUBLE PRECISION NOT NULL CHECK (cpus_after >= 0),
    policy        TEXT NOT NULL,
    reason        TEXT NOT NULL,
    at            DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (node_id, event_id)
);

CREATE INDEX resizes_by_deployment ON resizes (deployment_id, at);
"""

_POSTGRES_V7 = """
CREATE TABLE leases (
    name       TEXT COLLATE "C" PRIMARY KEY CHECK (name <> ''),
    holder     TEXT NOT NULL,
    term       BIGINT NOT NULL CHECK (term >= 0),
    expires_at DOUBLE PRECISION NOT NULL
);
"""

_POSTGRES_V8 = """
CREATE TABLE node_secrets (
    node_id       TEXT COLLATE "C" PRIMARY KEY CHECK (node_id <> ''),
    secret_sha256 TEXT NOT NULL CHECK (secret_sha256 ~ '^[0-9a-f]{64}$'),
    bound_at      DOUBLE PRECISION NOT NULL
);
"""

_POSTGRES_V9 = """
CREATE TABLE services (
    name         TEXT COLLATE "C" PRIMARY KEY CHECK (name <> ''),
    owner        TEXT COLLATE "C" NOT NULL CHECK (owner <> ''),
    model_sha256 TEXT COLLATE "C" NOT NULL REFERENCES models (sha256),
    spec_json    TEXT NOT NULL CHECK (json_typeof(spec_json::json) = 'object'),
    created_at   DOUBLE PRECISION NOT NULL
);

CREATE TABLE service_replicas (
    deployment_id TEXT COLLATE "C" PRIMARY KEY CHECK (deployment_id <> ''),
    service       TEXT COLLATE "C" NOT NULL REFERENCES services (name),
    site          TEXT NOT NULL,
    created_at    DOUBLE PRECISION NOT NULL
);
CREATE INDEX service_replicas_by_service ON service_replicas (service);

CREATE TABLE service_clients (
    service        TEXT COLLATE "C" NOT NULL REFERENCES services (name),
    client_id      TEXT COLLATE "C" NOT NULL CHECK (client_id <> ''),
    token_sha256   TEXT NOT NULL CHECK (token_sha256 ~ '^[0-9a-f]{64}$'),
    priority_class TEXT NOT NULL CHECK (priority_class IN ('critical', 'standard', 'best-effort')),
    deployment_id  TEXT COLLATE "C" NOT NULL,
    site           TEXT NOT NULL,
    attached_at    DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (service, client_id)
);
CREATE INDEX service_clients_by_deployment ON service_clients (deployment_id);
"""

_POSTGRES_V10 = """
CREATE TABLE service_events (
    service       TEXT COLLATE "C" NOT NULL REFERENCES services (name),
    at            DOUBLE PRECISION NOT NULL,
    action        TEXT NOT NULL CHECK (action IN ('start', 'stop')),
    deployment_id TEXT COLLATE "C" NOT NULL CHECK (deployment_id <> ''),
    site          TEXT NOT NULL,
    reason        TEXT NOT NULL CHECK (reason <> ''),
    seq           BIGSERIAL PRIMARY KEY
);
CREATE INDEX service_events_by_service ON service_events (service, seq);
"""

MIGRATIONS: dict[str, tuple[str, ...]] = {
    "sqlite": (
        _SQLITE_V1, _SQLITE_V2, _SQLITE_V3, _SQLITE_V4, _SQLITE_V5, _SQLITE_V6, _SQLITE_V7,
        _SQLITE_V8, _SQLITE_V9, _SQLITE_V10,
    ),
    "postgresql": (
        _POSTGRES_V1, _POSTGRES_V2, _POSTGRES_V3, _POSTGRES_V4, _POSTGRES_V5, _POSTGRES_V6,
        _POSTGRES_V7, _POSTGRES_V8, _POSTGRES_V9, _POSTGRES_V10,
    ),
}  # fmt: skip
"""The scripts of each backend's dialect (`Backend.dialect`), in order; the length of either
is the schema version this broker writes."""
