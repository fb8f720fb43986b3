//! The arbiter's schema: three tables (leases, namespaces with their
//! leadership, the partition table) and the module store, created by an
//! idempotent migration every node runs at start, serialized by an advisory
//! lock. It must not hold statements (`statements.rs` does).
//!
//! A node's start must not stall the cluster's renewals: the migration is
//! `CREATE … IF NOT EXISTS` (no lock on a table that exists), and a column
//! added since the first schema is added only when the catalog says it is
//! missing ([`ADDED_COLUMNS`]). `ALTER TABLE … ADD COLUMN IF NOT EXISTS`
//! takes an `ACCESS EXCLUSIVE` lock on its table before it looks, even when
//! the column is there, and holds it to the end of the migration's
//! transaction: every node's renewal queued behind each node's start, and
//! behind any transaction the `ALTER` itself waited for.

/// The migration: idempotent, run by every node at start.
pub(super) const MIGRATION: &str = r#"
CREATE TABLE IF NOT EXISTS fief_namespaces (
    namespace    text PRIMARY KEY,
    partitions   integer NOT NULL CHECK (partitions > 0),
    epoch        bigint NOT NULL DEFAULT 0,
    term         bigint NOT NULL DEFAULT 0,
    leader_node  text,
    leader_lease bigint
);
CREATE TABLE IF NOT EXISTS fief_leases (
    namespace  text NOT NULL REFERENCES fief_namespaces (namespace),
    node_id    text NOT NULL,
    lease_id   bigint NOT NULL,
    ttl_ms     bigint NOT NULL,
    peer_addr  text,
    leaving    boolean NOT NULL DEFAULT false,
    confirmed  boolean NOT NULL DEFAULT true,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (namespace, node_id)
);
CREATE TABLE IF NOT EXISTS fief_partitions (
    namespace text NOT NULL REFERENCES fief_namespaces (namespace),
    partition integer NOT NULL,
    node_id   text,
    token     bigint NOT NULL,
    PRIMARY KEY (namespace, partition)
);
CREATE SEQUENCE IF NOT EXISTS fief_lease_ids;
-- The module store: one row per module name (kept after an undeploy, so
-- version numbers are never reused), one per stored version with its bytes.
CREATE TABLE IF NOT EXISTS fief_modules (
    namespace       text NOT NULL REFERENCES fief_namespaces (namespace),
    name            text NOT NULL,
    last_version    bigint NOT NULL,
    current_version bigint,
    PRIMARY KEY (namespace, name)
);
CREATE TABLE IF NOT EXISTS fief_module_versions (
    namespace    text NOT NULL,
    name         text NOT NULL,
    version      bigint NOT NULL,
    content_hash text NOT NULL,
    size_bytes   bigint NOT NULL,
    options      text NOT NULL,
    deployed_by  text NOT NULL,
    deployed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    bytes        bytea NOT NULL,
    PRIMARY KEY (namespace, name, version),
    FOREIGN KEY (namespace, name) REFERENCES fief_modules (namespace, name)
);
"#;

/// Columns added after 0.1.0's first schema, as `(table, column, the
/// statement that adds it)`: run by the migration only when the column is
/// missing (see the module header for why not unconditionally).
pub(super) const ADDED_COLUMNS: [(&str, &str, &str); 4] = [
    (
        "fief_leases",
        "leaving",
        "ALTER TABLE fief_leases ADD COLUMN IF NOT EXISTS leaving boolean NOT NULL DEFAULT false",
    ),
    // A graceful handoff records the token the previous owner held the
    // partition under, so the new owner accepts only the states that
    // transfer sent.
    (
        "fief_partitions",
        "handed_from",
        "ALTER TABLE fief_partitions ADD COLUMN IF NOT EXISTS handed_from bigint",
    ),
    // Whether the node has used its lease since the grant (renewed it or
    // campaigned with it): the leader gives partitions only to confirmed
    // leases. Rows of nodes that predate it count as confirmed.
    (
        "fief_leases",
        "confirmed",
        "ALTER TABLE fief_leases ADD COLUMN IF NOT EXISTS confirmed boolean NOT NULL DEFAULT true",
    ),
    // The renewal mark: one higher at every renewal, so a node sees an
    // arbiter that lost its renewals (a standby promoted after asynchronous
    // replication) instead of trusting it.
    (
        "fief_leases",
        "renewals",
        "ALTER TABLE fief_leases ADD COLUMN IF NOT EXISTS renewals bigint NOT NULL DEFAULT 0",
    ),
];

/// Whether a column exists, from the catalog (reads no user table, so it
/// takes no lock a renewal could wait for).
pub(super) const COLUMN_EXISTS: &str = "SELECT EXISTS (SELECT 1 FROM information_schema.columns \
     WHERE table_schema = current_schema() AND table_name = $1 AND column_name = $2)";

/// Key of the advisory lock that serializes migrations.
pub(super) const MIGRATION_LOCK: i64 = 0x66_69_65_66; // "fief"
