//! The PostgreSQL arbiter: the production adapter.
//!
//! The parts: this file, [`PostgresArbiter`] and its I/O thread (every call
//! carried there); `schema.rs`, the tables and their migration; `db.rs`,
//! the connections and the reads shared by the statements; `statements.rs`,
//! the arbiter's statements, one method per call.
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

use fief_core::{NodeId, OwnershipTable, PartitionCount, PartitionId};

use super::{
    Arbiter, ArbiterError, ArbiterFuture, LeaseId, Member, ModuleVersionRecord, NewModuleVersion,
    StoredModule, Term,
};
use crate::dedicated::DedicatedRuntime;

mod db;
mod schema;
mod statements;

use db::{Db, unreachable};

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
    ) -> ArbiterFuture<'a, u64> {
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
