//! The arbiter's connections on its I/O thread: two clients (one for leases
//! only, so a renewal never waits behind a table change), reconnecting on
//! failure; the migration at connect; the reads several statements share
//! (the table, the module store); the mapping of database errors. It must
//! not decide anything about leases or the table (the statements do, in
//! SQL).

use std::time::Duration;

use fief_core::{Assignment, NodeId, OwnershipTable, OwnershipToken, PartitionCount};
use tokio::sync::Mutex;
use tokio_postgres::{Client, NoTls};

use super::schema::{ADDED_COLUMNS, COLUMN_EXISTS, MIGRATION, MIGRATION_LOCK};
use crate::arbiter::{ArbiterError, ModuleVersionRecord, StoredModule};
use crate::config::ModuleOptions;

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

/// The arbiter's connections and statements, run on its I/O thread.
pub(super) struct Db {
    url: String,
    pub(super) partitions: PartitionCount,
    /// For leases only, so a renewal never waits behind a table change.
    lease_client: Mutex<Option<Client>>,
    /// For everything else.
    client: Mutex<Option<Client>>,
}

/// Which of the arbiter's two connections a statement uses.
#[derive(Clone, Copy)]
pub(super) enum Conn {
    Lease,
    Table,
}

pub(super) fn unreachable(e: impl std::fmt::Display) -> ArbiterError {
    ArbiterError::Unreachable(format!("PostgreSQL: {e}"))
}

/// A database error with the server's own message, which tokio-postgres's
/// `Display` leaves out.
pub(super) fn db_error(e: &tokio_postgres::Error) -> ArbiterError {
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
    pub(super) async fn connect(
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
        for (table, column, add) in ADDED_COLUMNS {
            let there: bool = tx
                .query_one(COLUMN_EXISTS, &[&table, &column])
                .await
                .map_err(unreachable)?
                .get(0);
            if !there {
                tx.batch_execute(add).await.map_err(|e| db_error(&e))?;
            }
        }
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
    pub(super) async fn client(
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
    pub(super) async fn with<T>(
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

    pub(super) async fn read_table(
        client: &mut Client,
        namespace: &str,
        partitions: PartitionCount,
    ) -> Result<Result<OwnershipTable, String>, tokio_postgres::Error> {
        // One statement, so one snapshot: the epoch and the owners of the
        // same table, even outside a transaction while another node writes
        // it (read in two statements, a reader could get one epoch with the
        // next table's owners).
        let rows = client
            .query(
                "SELECT n.epoch, p.partition, p.node_id, p.token, p.handed_from
                 FROM fief_namespaces n LEFT JOIN fief_partitions p ON p.namespace = n.namespace
                 WHERE n.namespace = $1",
                &[&namespace],
            )
            .await?;
        let Some(epoch) = rows.first().map(|row| row.get::<_, i64>(0)) else {
            return Ok(Err(format!("namespace {namespace} does not exist")));
        };
        let mut owners = vec![None; partitions.get() as usize];
        for row in rows {
            let Some(partition) = row.get::<_, Option<i32>>(1) else {
                continue;
            };
            let node: Option<String> = row.get(2);
            let token: Option<i64> = row.get(3);
            let handed_from: Option<i64> = row.get(4);
            if let (Some(slot), Some(node), Some(token)) =
                (owners.get_mut(partition as usize), node, token)
            {
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
    pub(super) async fn read_modules(
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
pub(super) fn version_record(row: &tokio_postgres::Row, at: usize) -> ModuleVersionRecord {
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
