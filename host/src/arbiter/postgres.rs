//! The PostgreSQL arbiter: the production adapter.
//!
//! Leases, leadership and the partition table live in three tables created
//! by an idempotent migration the node runs at start (serialized by an
//! advisory lock, so nodes starting together do not race). Several
//! namespaces share one database: every row is keyed by namespace.
//!
//! Time is the database's: a lease expires at `clock_timestamp() + ttl` as
//! computed by the server when it commits the renewal, and every liveness
//! judgment compares against the server's `clock_timestamp()`, never a
//! node's clock (contract §2). A renewal statement runs after the node sent
//! it, so the server's measure point is never earlier than the node's.
//!
//! Every write that depends on a read (campaign, table change) runs in one
//! transaction holding the namespace row's lock (`SELECT … FOR UPDATE`), so
//! two would-be leaders or two table writers are serialized by PostgreSQL.
//!
//! The arbiter's I/O runs on a thread of its own (a [`DedicatedRuntime`]):
//! every call, the connections it (re)opens — a socket is driven by the
//! runtime it was created on — and their connection tasks, and the
//! connection locks held across a statement. Callers, on whatever runtime,
//! only wait for the answer. So a renewal never waits for the node's
//! runtime, busy with guest code, to notice a readable socket, and the
//! coordination loop never waits for a connection held by a task that
//! runtime is slow to resume. A caller that gives up on a call (drops it,
//! say at its deadline) cancels it as it would in place: a transaction in
//! progress is dropped, and so rolled back.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use fief_core::{Assignment, NodeId, OwnershipTable, OwnershipToken, PartitionCount, PartitionId};
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls};

use super::{
    Arbiter, ArbiterError, ArbiterFuture, LeaseId, Member, ModuleVersionRecord, NewModuleVersion,
    StoredModule, Term,
};
use crate::config::ModuleOptions;
use crate::dedicated::DedicatedRuntime;

/// The migration: idempotent, run by every node at start.
const MIGRATION: &str = r#"
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
-- Added after 0.1.0's first schema; harmless when already there.
ALTER TABLE fief_leases ADD COLUMN IF NOT EXISTS leaving boolean NOT NULL DEFAULT false;
-- A graceful handoff records the token the previous owner held the partition
-- under, so the new owner accepts only the states that transfer sent.
ALTER TABLE fief_partitions ADD COLUMN IF NOT EXISTS handed_from bigint;
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

/// Key of the advisory lock that serializes migrations.
const MIGRATION_LOCK: i64 = 0x66_69_65_66; // "fief"

/// How long connecting to the database may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);

/// How long the server lets one of the arbiter's sessions sit idle inside a
/// transaction before it ends the session (`idle_in_transaction_session_timeout`).
/// The arbiter's transactions lock the namespace row (`SELECT … FOR UPDATE`);
/// a node cut off from the database between two statements would otherwise
/// hold that lock until the dead TCP connection is noticed (minutes), and no
/// other node could campaign or change the table: no takeover. Its
/// transactions are a few statements sent back to back, so a second of
/// silence inside one means the node is gone or far too slow; the
/// transaction is rolled back and the node reconnects.
const IDLE_IN_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(1);

/// The PostgreSQL arbiter. Its connections and statements run on a thread
/// of its own (see the module's header); the thread ends when the arbiter is
/// dropped.
pub struct PostgresArbiter {
    db: Arc<Db>,
    io: DedicatedRuntime,
}

impl PostgresArbiter {
    /// Connect to `url` (`postgres://user@host:port/db`), run the migration,
    /// and make sure the namespace exists with `partitions` partitions.
    ///
    /// # Errors
    ///
    /// [`ArbiterError::Unreachable`] when the database cannot be reached,
    /// [`ArbiterError::Refused`] when the namespace already exists with
    /// another partition count.
    pub async fn connect(
        url: &str,
        namespace: &str,
        partitions: PartitionCount,
    ) -> Result<Self, ArbiterError> {
        let io = DedicatedRuntime::start("fief-arbiter-io", std::future::pending)
            .map_err(|e| unreachable(format!("cannot start the arbiter's I/O thread: {e}")))?;
        let (url, namespace) = (url.to_owned(), namespace.to_owned());
        let db = io
            .handle()
            .spawn(async move { Db::connect(&url, &namespace, partitions).await })
            .await
            .map_err(|e| unreachable(format!("the arbiter's I/O thread failed: {e}")))??;
        Ok(PostgresArbiter {
            db: Arc::new(db),
            io,
        })
    }

    /// Run `call` (given the connections) on the I/O thread; its answer. A
    /// caller that drops the answer's future cancels the call.
    fn run<T, F, C>(&self, call: C) -> ArbiterFuture<'static, T>
    where
        T: Send + 'static,
        F: Future<Output = Result<T, ArbiterError>> + Send + 'static,
        C: FnOnce(Arc<Db>) -> F,
    {
        /// Cancels the call if the caller gives up on it.
        struct Abort(tokio::task::AbortHandle);
        impl Drop for Abort {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let task = self.io.handle().spawn(call(self.db.clone()));
        Box::pin(async move {
            let _abort = Abort(task.abort_handle());
            task.await.unwrap_or_else(|e| {
                Err(unreachable(format!(
                    "the arbiter's I/O thread dropped the call: {e}"
                )))
            })
        })
    }
}

/// Every call, carried to the I/O thread with owned copies of its arguments.
impl Arbiter for PostgresArbiter {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        let (ns, node, peer_addr) = (
            namespace.to_owned(),
            node.clone(),
            peer_addr.map(str::to_owned),
        );
        self.run(|db| async move { db.register(&ns, &node, ttl, peer_addr.as_deref()).await })
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|db| async move { db.renew(&ns, &node, lease).await })
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|db| async move { db.release(&ns, &node, lease).await })
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|db| async move { db.set_leaving(&ns, &node, lease).await })
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        let ns = namespace.to_owned();
        self.run(|db| async move { db.live_nodes(&ns).await })
    }

    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>> {
        let (ns, node) = (namespace.to_owned(), node.clone());
        self.run(|db| async move { db.campaign(&ns, &node, lease).await })
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        let ns = namespace.to_owned();
        self.run(|db| async move { db.table(&ns).await })
    }

    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        let (ns, from) = (namespace.to_owned(), from.clone());
        self.run(|db| async move { db.transfer(&ns, &from, lease, moves).await })
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        let ns = namespace.to_owned();
        self.run(|db| async move { db.write_table(&ns, term, changes).await })
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: NewModuleVersion,
    ) -> ArbiterFuture<'a, ModuleVersionRecord> {
        let ns = namespace.to_owned();
        self.run(|db| async move { db.put_module(&ns, module).await })
    }

    fn modules<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<StoredModule>> {
        let ns = namespace.to_owned();
        self.run(|db| async move { db.modules(&ns).await })
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<bytes::Bytes>> {
        let (ns, name) = (namespace.to_owned(), name.to_owned());
        self.run(|db| async move { db.module_bytes(&ns, &name, version).await })
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, StoredModule> {
        let (ns, name) = (namespace.to_owned(), name.to_owned());
        self.run(|db| async move { db.set_current_module(&ns, &name, version).await })
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        let (ns, name) = (namespace.to_owned(), name.to_owned());
        self.run(|db| async move { db.remove_module(&ns, &name).await })
    }
}

/// The arbiter's connections and statements, run on its I/O thread.
struct Db {
    url: String,
    partitions: PartitionCount,
    /// For leases only, so a renewal never waits behind a table change.
    lease_client: Mutex<Option<Client>>,
    /// For everything else.
    client: Mutex<Option<Client>>,
}

/// Which of the arbiter's two connections a statement uses.
#[derive(Clone, Copy)]
enum Conn {
    Lease,
    Table,
}

fn unreachable(e: impl std::fmt::Display) -> ArbiterError {
    ArbiterError::Unreachable(format!("PostgreSQL: {e}"))
}

/// A database error with the server's own message, which tokio-postgres's
/// `Display` leaves out.
fn db_error(e: &tokio_postgres::Error) -> ArbiterError {
    match e.as_db_error() {
        Some(db) => ArbiterError::Refused(format!(
            "PostgreSQL: {}: {}",
            db.code().code(),
            db.message()
        )),
        None => unreachable(e),
    }
}

impl Db {
    /// Connect, run the migration, make sure the namespace exists (see
    /// [`PostgresArbiter::connect`]).
    async fn connect(
        url: &str,
        namespace: &str,
        partitions: PartitionCount,
    ) -> Result<Self, ArbiterError> {
        let arbiter = Db {
            url: url.to_owned(),
            partitions,
            lease_client: Mutex::new(None),
            client: Mutex::new(None),
        };
        let mut guard = arbiter.client(Conn::Table).await?;
        let client = guard.as_mut().expect("connected");
        let tx = client.transaction().await.map_err(unreachable)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
            .await
            .map_err(unreachable)?;
        tx.batch_execute("SET LOCAL client_min_messages = warning")
            .await
            .map_err(unreachable)?;
        tx.batch_execute(MIGRATION)
            .await
            .map_err(|e| db_error(&e))?;
        tx.execute(
            "INSERT INTO fief_namespaces (namespace, partitions) VALUES ($1, $2) ON CONFLICT DO NOTHING",
            &[&namespace, &(partitions.get() as i32)],
        )
        .await
        .map_err(unreachable)?;
        let stored: i32 = tx
            .query_one(
                "SELECT partitions FROM fief_namespaces WHERE namespace = $1",
                &[&namespace],
            )
            .await
            .map_err(unreachable)?
            .get(0);
        tx.commit().await.map_err(unreachable)?;
        if stored as u32 != partitions.get() {
            return Err(ArbiterError::Refused(format!(
                "namespace {namespace:?} has {stored} partitions in the database, but this node is configured with {}; partitions are fixed per namespace",
                partitions.get()
            )));
        }
        drop(guard);
        Ok(arbiter)
    }

    /// The connection, reconnecting if the last one broke.
    async fn client(
        &self,
        conn: Conn,
    ) -> Result<tokio::sync::MutexGuard<'_, Option<Client>>, ArbiterError> {
        let mut guard = match conn {
            Conn::Lease => self.lease_client.lock().await,
            Conn::Table => self.client.lock().await,
        };
        if guard.as_ref().is_none_or(Client::is_closed) {
            let mut config: tokio_postgres::Config = self.url.parse().map_err(|e| {
                ArbiterError::Refused(format!(
                    "the arbiter URL {:?} is not a PostgreSQL URL: {e}",
                    self.url
                ))
            })?;
            config.connect_timeout(CONNECT_TIMEOUT);
            let ours = format!(
                "-c idle_in_transaction_session_timeout={}",
                IDLE_IN_TRANSACTION_TIMEOUT.as_millis()
            );
            let options = match config.get_options() {
                Some(theirs) if !theirs.is_empty() => format!("{theirs} {ours}"),
                _ => ours,
            };
            config.options(options);
            let (client, connection) = tokio::time::timeout(CONNECT_TIMEOUT, config.connect(NoTls))
                .await
                .map_err(|_| unreachable("connecting timed out"))?
                .map_err(unreachable)?;
            // On the I/O thread's runtime, like every call of this arbiter.
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(error = %e, "the PostgreSQL connection closed");
                }
            });
            *guard = Some(client);
        }
        Ok(guard)
    }

    /// Run `f` with a connected client; a failure drops the connection so
    /// the next call reconnects.
    async fn with<T>(
        &self,
        conn: Conn,
        f: impl AsyncFnOnce(&mut Client) -> Result<T, tokio_postgres::Error>,
    ) -> Result<T, ArbiterError> {
        let mut guard = self.client(conn).await?;
        let client = guard.as_mut().expect("connected");
        match f(client).await {
            Ok(v) => Ok(v),
            Err(e) => {
                if client.is_closed() || e.as_db_error().is_none() {
                    *guard = None;
                }
                Err(db_error(&e))
            }
        }
    }

    async fn read_table(
        client: &mut Client,
        namespace: &str,
        partitions: PartitionCount,
    ) -> Result<Result<OwnershipTable, String>, tokio_postgres::Error> {
        let epoch: i64 = client
            .query_one(
                "SELECT epoch FROM fief_namespaces WHERE namespace = $1",
                &[&namespace],
            )
            .await?
            .get(0);
        let rows = client
            .query(
                "SELECT partition, node_id, token, handed_from FROM fief_partitions WHERE namespace = $1",
                &[&namespace],
            )
            .await?;
        let mut owners = vec![None; partitions.get() as usize];
        for row in rows {
            let partition: i32 = row.get(0);
            let node: Option<String> = row.get(1);
            let token: i64 = row.get(2);
            let handed_from: Option<i64> = row.get(3);
            if let (Some(slot), Some(node)) = (owners.get_mut(partition as usize), node) {
                *slot = Some(Assignment {
                    node: NodeId::new(node),
                    token: OwnershipToken(token as u64),
                    handed_from: handed_from.map(|t| OwnershipToken(t as u64)),
                });
            }
        }
        Ok(OwnershipTable::from_parts(partitions, epoch as u64, owners))
    }

    /// The stored modules of `namespace`, without bytes.
    async fn read_modules(
        client: &mut Client,
        namespace: &str,
    ) -> Result<Vec<StoredModule>, tokio_postgres::Error> {
        let rows = client
            .query(
                "SELECT m.name, m.current_version, v.version, v.content_hash, v.size_bytes,
                        v.options, v.deployed_by, v.deployed_at
                 FROM fief_modules m JOIN fief_module_versions v USING (namespace, name)
                 WHERE m.namespace = $1 AND m.current_version IS NOT NULL
                 ORDER BY m.name, v.version",
                &[&namespace],
            )
            .await?;
        let mut modules: Vec<StoredModule> = Vec::new();
        for row in rows {
            let name: String = row.get(0);
            let current: i64 = row.get(1);
            let record = version_record(&row, 2);
            match modules.last_mut() {
                Some(m) if m.name == name => m.versions.push(record),
                _ => modules.push(StoredModule {
                    name,
                    current: current as u64,
                    versions: vec![record],
                }),
            }
        }
        Ok(modules)
    }
}

/// A [`ModuleVersionRecord`] from the columns (version, content_hash,
/// size_bytes, options, deployed_by, deployed_at) starting at `at`. Options
/// that no longer parse (written by another release) read as the defaults,
/// with a warning.
fn version_record(row: &tokio_postgres::Row, at: usize) -> ModuleVersionRecord {
    let options: String = row.get(at + 3);
    let options = serde_json::from_str::<ModuleOptions>(&options).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "stored module options do not parse; using the defaults");
        ModuleOptions::default()
    });
    ModuleVersionRecord {
        version: row.get::<_, i64>(at) as u64,
        content_hash: row.get(at + 1),
        size_bytes: row.get::<_, i64>(at + 2) as u64,
        options,
        deployed_by: row.get(at + 4),
        deployed_at: row.get(at + 5),
    }
}

impl Arbiter for Db {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        Box::pin(async move {
            let ttl_ms = ttl.as_millis() as i64;
            let row = self
                .with(Conn::Lease, async |c| {
                    let tx = c.transaction().await?;
                    let row = tx.query_opt(
                        "INSERT INTO fief_leases (namespace, node_id, lease_id, ttl_ms, peer_addr, expires_at)
                         VALUES ($1, $2, nextval('fief_lease_ids'), $3::bigint, $4, clock_timestamp() + $3::bigint * interval '1 millisecond')
                         ON CONFLICT (namespace, node_id) DO UPDATE
                            SET lease_id = EXCLUDED.lease_id, ttl_ms = EXCLUDED.ttl_ms,
                                peer_addr = EXCLUDED.peer_addr, expires_at = EXCLUDED.expires_at,
                                leaving = false
                            WHERE fief_leases.expires_at <= clock_timestamp()
                         RETURNING lease_id",
                        &[&namespace, &node.as_str(), &ttl_ms, &peer_addr],
                    )
                    .await?;
                    if row.is_some() {
                        // A new lease owns nothing yet: partitions still
                        // listed under this node's previous (dead) lease go
                        // back to the leader, who gives them out anew.
                        tx.execute(
                            "WITH bumped AS (
                                 UPDATE fief_namespaces SET epoch = epoch + 1 WHERE namespace = $1
                                 AND EXISTS (SELECT 1 FROM fief_partitions WHERE namespace = $1 AND node_id = $2)
                                 RETURNING epoch)
                             UPDATE fief_partitions SET node_id = NULL, token = (SELECT epoch FROM bumped), handed_from = NULL
                             WHERE namespace = $1 AND node_id = $2",
                            &[&namespace, &node.as_str()],
                        )
                        .await?;
                    }
                    tx.commit().await?;
                    Ok(row)
                })
                .await?;
            match row {
                Some(row) => Ok(LeaseId(row.get::<_, i64>(0) as u64)),
                None => Err(ArbiterError::Refused(format!(
                    "node {node} already holds a current lease; a node id must be unique in its namespace"
                ))),
            }
        })
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        Box::pin(async move {
            let updated = self
                .with(Conn::Lease, async |c| {
                    c.execute(
                        "UPDATE fief_leases SET expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond'
                         WHERE namespace = $1 AND node_id = $2 AND lease_id = $3 AND expires_at > clock_timestamp()",
                        &[&namespace, &node.as_str(), &(lease.0 as i64)],
                    )
                    .await
                })
                .await?;
            if updated == 1 {
                Ok(())
            } else {
                Err(ArbiterError::LeaseExpired(lease))
            }
        })
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        Box::pin(async move {
            self.with(Conn::Lease, async |c| {
                c.execute(
                    "UPDATE fief_leases SET expires_at = clock_timestamp()
                     WHERE namespace = $1 AND node_id = $2 AND lease_id = $3",
                    &[&namespace, &node.as_str(), &(lease.0 as i64)],
                )
                .await
            })
            .await
            .map(|_| ())
        })
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        Box::pin(async move {
            let updated = self
                .with(Conn::Lease, async |c| {
                    c.execute(
                        "UPDATE fief_leases SET leaving = true
                         WHERE namespace = $1 AND node_id = $2 AND lease_id = $3 AND expires_at > clock_timestamp()",
                        &[&namespace, &node.as_str(), &(lease.0 as i64)],
                    )
                    .await
                })
                .await?;
            if updated == 1 {
                Ok(())
            } else {
                Err(ArbiterError::LeaseExpired(lease))
            }
        })
    }

    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        Box::pin(async move {
            let partitions = self.partitions;
            let outcome = self
                .with(Conn::Table, async |c| {
                    let tx = c.transaction().await?;
                    let epoch: i64 = tx
                        .query_one("SELECT epoch FROM fief_namespaces WHERE namespace = $1 FOR UPDATE", &[&namespace])
                        .await?
                        .get(0);
                    let me_alive = tx
                        .query_opt(
                            "SELECT 1 FROM fief_leases WHERE namespace = $1 AND node_id = $2 AND lease_id = $3
                             AND expires_at > clock_timestamp()",
                            &[&namespace, &from.as_str(), &(lease.0 as i64)],
                        )
                        .await?
                        .is_some();
                    if !me_alive {
                        return Ok(Err(ArbiterError::LeaseExpired(lease)));
                    }
                    let next = epoch + 1;
                    let wanted: Vec<i32> = moves.iter().map(|(p, _)| p.0 as i32).collect();
                    let targets: Vec<&str> = moves.iter().map(|(_, to)| to.as_str()).collect();
                    // One statement for the whole batch: a move applies only
                    // if `from` owns the partition and the target is live.
                    let moved = tx
                        .execute(
                            "UPDATE fief_partitions p SET node_id = m.target, token = $5, handed_from = p.token
                             FROM unnest($2::int[], $3::text[]) AS m(partition, target)
                             WHERE p.namespace = $1 AND p.partition = m.partition AND p.node_id = $4
                             AND EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = $1
                                         AND l.node_id = m.target AND l.expires_at > clock_timestamp())",
                            &[&namespace, &wanted, &targets, &from.as_str(), &next],
                        )
                        .await?;
                    if moved as usize != moves.len() {
                        return Ok(Err(ArbiterError::Refused(format!(
                            "{from} cannot hand off these partitions: it does not own all of them, or a target has no current lease"
                        ))));
                    }
                    tx.execute("UPDATE fief_namespaces SET epoch = $2 WHERE namespace = $1", &[&namespace, &next])
                        .await?;
                    tx.commit().await?;
                    Ok(Ok(()))
                })
                .await?;
            outcome?;
            self.with(Conn::Table, async |c| {
                Self::read_table(c, namespace, partitions).await
            })
            .await?
            .map_err(ArbiterError::Refused)
        })
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        Box::pin(async move {
            let rows = self
                .with(Conn::Table, async |c| {
                    c.query(
                        "SELECT l.node_id, l.peer_addr, l.leaving,
                                COALESCE(n.leader_node = l.node_id AND n.leader_lease = l.lease_id, false),
                                (EXTRACT(EPOCH FROM (l.expires_at - clock_timestamp())) * 1000)::bigint
                         FROM fief_leases l JOIN fief_namespaces n USING (namespace)
                         WHERE l.namespace = $1 AND l.expires_at > clock_timestamp() ORDER BY l.node_id",
                        &[&namespace],
                    )
                    .await
                })
                .await?;
            Ok(rows
                .iter()
                .map(|r| Member {
                    node: NodeId::new(r.get::<_, String>(0)),
                    peer_addr: r.get(1),
                    leaving: r.get(2),
                    leader: r.get(3),
                    lease_remaining: Duration::from_millis(r.get::<_, i64>(4).max(0) as u64),
                })
                .collect())
        })
    }

    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>> {
        Box::pin(async move {
            self
                .with(Conn::Table, async |c| {
                    let tx = c.transaction().await?;
                    let row = tx
                        .query_one(
                            "SELECT n.term, n.leader_node, n.leader_lease,
                                    EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = n.namespace
                                            AND l.node_id = n.leader_node AND l.lease_id = n.leader_lease
                                            AND l.expires_at > clock_timestamp()) AS leader_alive,
                                    EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = n.namespace
                                            AND l.node_id = $2 AND l.lease_id = $3
                                            AND l.expires_at > clock_timestamp()) AS me_alive
                             FROM fief_namespaces n WHERE n.namespace = $1 FOR UPDATE",
                            &[&namespace, &node.as_str(), &(lease.0 as i64)],
                        )
                        .await?;
                    let term: i64 = row.get(0);
                    let leader: Option<String> = row.get(1);
                    let leader_lease: Option<i64> = row.get(2);
                    let leader_alive: bool = row.get(3);
                    let me_alive: bool = row.get(4);
                    let outcome = if !me_alive {
                        Err(ArbiterError::LeaseExpired(lease))
                    } else if leader_alive {
                        let me = leader.as_deref() == Some(node.as_str()) && leader_lease == Some(lease.0 as i64);
                        Ok(me.then_some(Term(term as u64)))
                    } else {
                        tx.execute(
                            "UPDATE fief_namespaces SET term = term + 1, leader_node = $2, leader_lease = $3 WHERE namespace = $1",
                            &[&namespace, &node.as_str(), &(lease.0 as i64)],
                        )
                        .await?;
                        Ok(Some(Term(term as u64 + 1)))
                    };
                    tx.commit().await?;
                    Ok(outcome)
                })
                .await?
        })
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        Box::pin(async move {
            let partitions = self.partitions;
            self.with(Conn::Table, async |c| {
                Self::read_table(c, namespace, partitions).await
            })
            .await?
            .map_err(ArbiterError::Refused)
        })
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        Box::pin(async move {
            let partitions = self.partitions;
            let outcome = self
                .with(Conn::Table, async |c| {
                    let tx = c.transaction().await?;
                    let row = tx
                        .query_one(
                            "SELECT n.term, n.epoch,
                                    EXISTS (SELECT 1 FROM fief_leases l WHERE l.namespace = n.namespace
                                            AND l.node_id = n.leader_node AND l.lease_id = n.leader_lease
                                            AND l.expires_at > clock_timestamp())
                             FROM fief_namespaces n WHERE n.namespace = $1 FOR UPDATE",
                            &[&namespace],
                        )
                        .await?;
                    let (current_term, epoch, leader_alive): (i64, i64, bool) = (row.get(0), row.get(1), row.get(2));
                    if current_term as u64 != term.0 || !leader_alive {
                        return Ok(Err(ArbiterError::NotLeader(Some(Term(current_term as u64)))));
                    }
                    // A partition moves only once its owner's lease has expired.
                    let wanted: Vec<i32> = changes.iter().map(|(p, _)| p.0 as i32).collect();
                    let held = tx
                        .query(
                            "SELECT p.partition, p.node_id FROM fief_partitions p
                             JOIN fief_leases l ON l.namespace = p.namespace AND l.node_id = p.node_id
                             WHERE p.namespace = $1 AND p.partition = ANY($2) AND l.expires_at > clock_timestamp()",
                            &[&namespace, &wanted],
                        )
                        .await?;
                    let mut held_by = std::collections::HashMap::new();
                    for r in &held {
                        held_by.insert(r.get::<_, i32>(0), r.get::<_, String>(1));
                    }
                    let next = epoch + 1;
                    for (partition, node) in &changes {
                        let owner = held_by.get(&(partition.0 as i32));
                        if owner.is_some_and(|o| Some(o.as_str()) != node.as_ref().map(NodeId::as_str)) {
                            return Ok(Err(ArbiterError::Refused(format!(
                                "partition {partition} is owned by {} whose lease is still current",
                                owner.map(String::as_str).unwrap_or("?")
                            ))));
                        }
                    }
                    let (parts, nodes): (Vec<i32>, Vec<Option<&str>>) = changes
                        .iter()
                        .filter(|(p, _)| !held_by.contains_key(&(p.0 as i32)))
                        .map(|(p, n)| (p.0 as i32, n.as_ref().map(NodeId::as_str)))
                        .unzip();
                    // One statement for the whole change, however many partitions.
                    let n = tx
                        .execute(
                            "INSERT INTO fief_partitions (namespace, partition, node_id, token)
                             SELECT $1, c.partition, c.node_id, $4 FROM unnest($2::int[], $3::text[]) AS c(partition, node_id)
                             ON CONFLICT (namespace, partition) DO UPDATE SET node_id = EXCLUDED.node_id, token = EXCLUDED.token, handed_from = NULL
                             WHERE fief_partitions.node_id IS DISTINCT FROM EXCLUDED.node_id",
                            &[&namespace, &parts, &nodes, &next],
                        )
                        .await?;
                    let changed = n > 0;
                    if changed {
                        tx.execute("UPDATE fief_namespaces SET epoch = $2 WHERE namespace = $1", &[&namespace, &next])
                            .await?;
                    }
                    tx.commit().await?;
                    Ok(Ok(()))
                })
                .await?;
            outcome?;
            self.with(Conn::Table, async |c| {
                Self::read_table(c, namespace, partitions).await
            })
            .await?
            .map_err(ArbiterError::Refused)
        })
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: NewModuleVersion,
    ) -> ArbiterFuture<'a, ModuleVersionRecord> {
        Box::pin(async move {
            let options = serde_json::to_string(&module.options)
                .map_err(|e| ArbiterError::Refused(format!("module options: {e}")))?;
            self.with(Conn::Table, async |c| {
                let tx = c.transaction().await?;
                // Lock the name's row (creating it), so two deploys of one
                // name are numbered one after the other.
                tx.execute(
                    "INSERT INTO fief_modules (namespace, name, last_version) VALUES ($1, $2, 0)
                     ON CONFLICT DO NOTHING",
                    &[&namespace, &module.name],
                )
                .await?;
                let current = tx
                    .query_opt(
                        "SELECT v.version, v.content_hash, v.size_bytes, v.options, v.deployed_by, v.deployed_at
                         FROM fief_modules m JOIN fief_module_versions v
                           ON v.namespace = m.namespace AND v.name = m.name AND v.version = m.current_version
                         WHERE m.namespace = $1 AND m.name = $2 FOR UPDATE OF m",
                        &[&namespace, &module.name],
                    )
                    .await?
                    .map(|row| version_record(&row, 0));
                if let Some(record) = current
                    && record.content_hash == module.content_hash
                    && record.options == module.options
                {
                    tx.commit().await?;
                    return Ok(record);
                }
                let version: i64 = tx
                    .query_one(
                        "UPDATE fief_modules SET last_version = last_version + 1
                         WHERE namespace = $1 AND name = $2 RETURNING last_version",
                        &[&namespace, &module.name],
                    )
                    .await?
                    .get(0);
                let row = tx
                    .query_one(
                        "INSERT INTO fief_module_versions
                            (namespace, name, version, content_hash, size_bytes, options, deployed_by, bytes)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                         RETURNING version, content_hash, size_bytes, options, deployed_by, deployed_at",
                        &[
                            &namespace,
                            &module.name,
                            &version,
                            &module.content_hash,
                            &(module.bytes.len() as i64),
                            &options,
                            &module.deployed_by,
                            &&module.bytes[..],
                        ],
                    )
                    .await?;
                tx.execute(
                    "UPDATE fief_modules SET current_version = $3 WHERE namespace = $1 AND name = $2",
                    &[&namespace, &module.name, &version],
                )
                .await?;
                tx.commit().await?;
                Ok(version_record(&row, 0))
            })
            .await
        })
    }

    fn modules<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<StoredModule>> {
        Box::pin(async move {
            self.with(Conn::Table, async |c| {
                Self::read_modules(c, namespace).await
            })
            .await
        })
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<bytes::Bytes>> {
        Box::pin(async move {
            let row = self
                .with(Conn::Table, async |c| {
                    c.query_opt(
                        "SELECT v.bytes FROM fief_module_versions v JOIN fief_modules m USING (namespace, name)
                         WHERE v.namespace = $1 AND v.name = $2 AND v.version = $3
                         AND m.current_version IS NOT NULL",
                        &[&namespace, &name, &(version as i64)],
                    )
                    .await
                })
                .await?;
            Ok(row.map(|row| bytes::Bytes::from(row.get::<_, Vec<u8>>(0))))
        })
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, StoredModule> {
        Box::pin(async move {
            let updated = self
                .with(Conn::Table, async |c| {
                    c.execute(
                        "UPDATE fief_modules m SET current_version = $3
                         WHERE m.namespace = $1 AND m.name = $2 AND m.current_version IS NOT NULL
                         AND EXISTS (SELECT 1 FROM fief_module_versions v WHERE v.namespace = $1
                                     AND v.name = $2 AND v.version = $3)",
                        &[&namespace, &name, &(version as i64)],
                    )
                    .await
                })
                .await?;
            let modules = self
                .with(Conn::Table, async |c| {
                    Self::read_modules(c, namespace).await
                })
                .await?;
            let module = modules.into_iter().find(|m| m.name == name);
            match (updated, module) {
                (1, Some(module)) => Ok(module),
                (_, None) => Err(ArbiterError::Refused(format!(
                    "no module named {name:?} is deployed"
                ))),
                (_, Some(module)) => {
                    let known: Vec<String> = module
                        .versions
                        .iter()
                        .map(|v| v.version.to_string())
                        .collect();
                    Err(ArbiterError::Refused(format!(
                        "module {name:?} has no version {version} (stored versions: {})",
                        known.join(", ")
                    )))
                }
            }
        })
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        Box::pin(async move {
            self.with(Conn::Table, async |c| {
                let tx = c.transaction().await?;
                let removed = tx
                    .execute(
                        "UPDATE fief_modules SET current_version = NULL
                         WHERE namespace = $1 AND name = $2 AND current_version IS NOT NULL",
                        &[&namespace, &name],
                    )
                    .await?;
                tx.execute(
                    "DELETE FROM fief_module_versions WHERE namespace = $1 AND name = $2",
                    &[&namespace, &name],
                )
                .await?;
                tx.commit().await?;
                Ok(removed == 1)
            })
            .await
        })
    }
}
