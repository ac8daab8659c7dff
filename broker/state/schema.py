"""The state file's schema, as an ordered list of migration scripts.

`MIGRATIONS[i]` takes a file from schema version `i` to `i + 1`; the version is SQLite's
`PRAGMA user_version` (0 for a new file). `StateStore` applies the missing scripts at open,
each in its own transaction together with the new version number, so a crash mid-migration
leaves the file at the previous version. Rules for adding one:

- append, never edit a released script (files in the field have run it already);
- a new enum member of a column with a CHECK on its values needs a script that rebuilds the
  table (SQLite cannot alter a CHECK); the migrations table has no such CHECKs on purpose, as
  its enums are young;
- scripts hold no BEGIN/COMMIT: the store wraps them.

Tables are STRICT (column types enforced, SQLite >= 3.37) and JSON columns are checked with
`json_valid` (SQLite >= 3.38); `StateStore` refuses an older SQLite with a clear error.
"""

from __future__ import annotations

_V1 = """
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

_V2 = """
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

_V3 = """
-- NULL: not measured (every migration recorded before this version, and reports from
-- clients that measure only the switch).
ALTER TABLE migrations ADD COLUMN span_gap_ms REAL CHECK (span_gap_ms >= 0);
"""
"""Version 3: the longest gap a client saw over the whole migration (the decision to the old
replica stopped), beside `downtime_ms` (across the switch only)."""

_V4 = """
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

_V5 = """
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

_V6 = """
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

MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3, _V4, _V5, _V6)
"""The scripts in order; `len(MIGRATIONS)` is the schema version this broker writes."""
