//! The embedded backend: durable key state in a redb database, a file in the
//! node's data directory (or memory, for a library node without one). One
//! file is one namespace: every node that shares it (an in-process test
//! cluster sharing one [`EmbeddedBackend`]) shares its fence tokens.
//!
//! It owns the file's tables and their transactions: a round is one redb
//! write transaction committed with [`Durability::Immediate`], so one fsync
//! per round whatever its number of commits (the group commit). A key's
//! alarms are rows of their own table keyed by (partition, module, key,
//! name), so a partition's alarms are one range and a key's are a range
//! inside it. redb is
//! synchronous, so every transaction runs on tokio's blocking pool. It must
//! not decide anything but what `super::plan` decides.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use redb::backends::InMemoryBackend;
use redb::{Database, DatabaseError, Durability, ReadableDatabase, ReadableTable, TableDefinition};

use super::landed::Landed;
use super::plan;
use super::{
    AlarmId, Backend, BackendError, BoxFuture, KeyScope, Load, Loaded, Outcome, Round, RoundResult,
    StoredAlarm, Write,
};
use fief_core::storage_fence;

/// The fence token of each partition.
const FENCES: TableDefinition<u32, u64> = TableDefinition::new("fief_storage_fences");
/// The entries, keyed by (module, key, name): redb compares `&str` (and
/// tuples of them, element by element) in byte order, so a key's names are
/// contiguous and sorted.
const ENTRIES: TableDefinition<(&str, &str, &str), &[u8]> =
    TableDefinition::new("fief_storage_entries");
/// The alarms, keyed by (partition, module, key, name), valued by their time
/// (milliseconds since the Unix epoch).
const ALARMS: TableDefinition<(u32, &str, &str, &str), u64> =
    TableDefinition::new("fief_storage_alarms");
/// The bytes stored per tenant.
const USAGE: TableDefinition<&str, u64> = TableDefinition::new("fief_storage_usage");

/// One entry: name and value.
type Entry = (String, Vec<u8>);

/// The entries table, as a write transaction opens it.
type Entries<'t> = redb::Table<'t, (&'static str, &'static str, &'static str), &'static [u8]>;

/// The key of an alarm row: (partition, module, key, name).
type AlarmKey = (u32, &'static str, &'static str, &'static str);

/// The alarms table, as a write transaction opens it.
type Alarms<'t> = redb::Table<'t, AlarmKey, u64>;

/// Durable key state in a redb database (see the module docs).
pub struct EmbeddedBackend {
    store: Arc<Store>,
    /// The file, or `None` in memory.
    path: Option<PathBuf>,
}

/// The database and what it has landed, shared by the blocking pool's
/// transactions.
struct Store {
    db: Database,
    /// Its fence tokens and tenants' bytes in memory (`landed.rs`).
    landed: Landed,
    /// Write transactions begun: the next one's sequence number.
    rounds: AtomicU64,
}

fn unavailable(e: impl std::fmt::Display) -> BackendError {
    BackendError::Unavailable(format!("embedded store: {e}"))
}

impl EmbeddedBackend {
    /// Open the database at `path`, creating it (and its parent directory)
    /// if it does not exist.
    ///
    /// # Errors
    ///
    /// [`BackendError::Unavailable`] when the directory cannot be created,
    /// the file is locked by another process (another node on the same
    /// data directory), or it is not a redb database.
    pub fn open(path: &Path) -> Result<Self, BackendError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                unavailable(format!("creating the directory {}: {e}", dir.display()))
            })?;
        }
        let db = Database::create(path).map_err(|e| match e {
            DatabaseError::DatabaseAlreadyOpen => unavailable(format!(
                "{} is locked: another process (another node on the same data directory?) has it open",
                path.display()
            )),
            e => unavailable(format!(
                "{} cannot be opened as a redb database: {e}",
                path.display()
            )),
        })?;
        Self::ready(db, Some(path.to_owned()))
    }

    /// A database in memory: what a library node with no data directory
    /// uses. Not durable: its state is gone with the node.
    ///
    /// # Errors
    ///
    /// [`BackendError::Unavailable`] if redb cannot set it up (it only
    /// allocates).
    pub fn in_memory() -> Result<Self, BackendError> {
        let db = Database::builder()
            .create_with_backend(InMemoryBackend::new())
            .map_err(unavailable)?;
        Self::ready(db, None)
    }

    /// Create the tables, so that a read of a new database finds them, and
    /// learn its fence tokens and tenants' bytes.
    fn ready(db: Database, path: Option<PathBuf>) -> Result<Self, BackendError> {
        let landed = (|| -> Result<Landed, redb::Error> {
            let txn = db.begin_write()?;
            let landed = {
                let fences = txn.open_table(FENCES)?;
                txn.open_table(ENTRIES)?;
                txn.open_table(ALARMS)?;
                let usage = txn.open_table(USAGE)?;
                let tokens = fences
                    .iter()?
                    .map(|row| row.map(|(p, t)| (p.value(), t.value())))
                    .collect::<Result<Vec<_>, _>>()?;
                let bytes = usage
                    .iter()?
                    .map(|row| row.map(|(t, b)| (t.value().to_owned(), b.value())))
                    .collect::<Result<Vec<_>, _>>()?;
                Landed::new(tokens, bytes)
            };
            txn.commit()?;
            Ok(landed)
        })()
        .map_err(unavailable)?;
        Ok(EmbeddedBackend {
            store: Arc::new(Store {
                db,
                landed,
                rounds: AtomicU64::new(0),
            }),
            path,
        })
    }

    /// Run `f` on the store on tokio's blocking pool.
    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Store) -> Result<T, redb::Error> + Send + 'static,
    ) -> BoxFuture<'_, Result<T, BackendError>> {
        let store = Arc::clone(&self.store);
        Box::pin(async move {
            tokio::task::spawn_blocking(move || f(&store))
                .await
                .map_err(|e| unavailable(format!("the storage thread failed: {e}")))?
                .map_err(unavailable)
        })
    }
}

/// The first (module, key, name) after every entry of `scope`: the key's
/// successor in byte order is `key` followed by a NUL.
fn after_scope(scope: &KeyScope) -> String {
    format!("{}\0", scope.key)
}

/// Up to `limit` entries of `scope` from name `start` on whose names start
/// with `prefix`, sorted.
fn scan(
    table: &impl ReadableTable<(&'static str, &'static str, &'static str), &'static [u8]>,
    scope: &KeyScope,
    start: &str,
    prefix: &str,
    limit: usize,
) -> Result<Vec<Entry>, redb::Error> {
    let (module, key) = (scope.module.as_str(), scope.key.as_str());
    let end = after_scope(scope);
    let mut out = Vec::new();
    for item in table.range((module, key, start)..(module, end.as_str(), ""))? {
        if out.len() >= limit {
            break;
        }
        let (name, value) = item?;
        let (_, _, name) = name.value();
        if !name.starts_with(prefix) {
            break;
        }
        out.push((name.to_owned(), value.value().to_vec()));
    }
    Ok(out)
}

/// The alarms of `scope` (on `partition`), sorted by name.
fn key_alarms(
    alarms: &impl ReadableTable<AlarmKey, u64>,
    partition: u32,
    scope: &KeyScope,
) -> Result<Vec<(String, u64)>, redb::Error> {
    let (module, key) = (scope.module.as_str(), scope.key.as_str());
    let end = after_scope(scope);
    let mut out = Vec::new();
    for item in alarms.range((partition, module, key, "")..(partition, module, end.as_str(), ""))? {
        let (row, at) = item?;
        out.push((row.value().3.to_owned(), at.value()));
    }
    Ok(out)
}

/// Every alarm of `partition`, sorted by (module, key, name).
fn partition_alarms(
    alarms: &impl ReadableTable<AlarmKey, u64>,
    partition: u32,
) -> Result<Vec<StoredAlarm>, redb::Error> {
    let mut out = Vec::new();
    for item in alarms.range((partition, "", "", "")..)? {
        let (row, at) = item?;
        let (p, module, key, name) = row.value();
        if p != partition {
            break;
        }
        let id = AlarmId {
            partition,
            module: module.to_owned(),
            key: key.to_owned(),
            name: name.to_owned(),
        };
        out.push(StoredAlarm {
            id,
            at_ms: at.value(),
        });
    }
    Ok(out)
}

/// Apply one landed commit's writes, in order.
fn apply(
    entries: &mut Entries<'_>,
    alarms: &mut Alarms<'_>,
    commit: &super::Commit,
) -> Result<(), redb::Error> {
    let (scope, partition, writes) = (&commit.scope, commit.fence.partition, &commit.writes);
    let (module, key) = (scope.module.as_str(), scope.key.as_str());
    let end_of_scope = after_scope(scope);
    for write in writes {
        match write {
            Write::Put { name, value } => {
                entries.insert((module, key, name.as_str()), value.as_slice())?;
            }
            Write::Delete { name } => {
                entries.remove((module, key, name.as_str()))?;
            }
            Write::DeleteRange { start, end } => {
                let end = match end {
                    Some(end) if end <= start => continue,
                    Some(end) => (module, key, end.as_str()),
                    None => (module, end_of_scope.as_str(), ""),
                };
                entries.retain_in((module, key, start.as_str())..end, |_, _| false)?;
            }
            Write::SetAlarm { name, at_ms } => {
                alarms.insert((partition, module, key, name.as_str()), at_ms)?;
            }
            Write::CancelAlarm { name } => {
                alarms.remove((partition, module, key, name.as_str()))?;
            }
        }
    }
    Ok(())
}

/// A round's marks on the partitions it raises (`landed.rs`): recorded when
/// the round is over, with its tokens and tenants' bytes if it committed.
/// A round whose commit failed (it may have reached the file) or that
/// panicked leaves its marks, so loads on those partitions read their
/// tokens from their snapshots from then on.
struct Raising<'s> {
    landed: &'s Landed,
    seq: u64,
    raised: BTreeMap<u32, u64>,
    usage: BTreeMap<String, u64>,
    /// The commit was tried.
    committing: bool,
    /// The commit returned `Ok`.
    committed: bool,
}

impl Drop for Raising<'_> {
    fn drop(&mut self) {
        let unknown = self.committing && !self.committed;
        if !unknown && !std::thread::panicking() {
            self.landed
                .record(self.seq, &self.raised, &self.usage, self.committed);
        }
    }
}

/// One round in one write transaction (see the module header of
/// `crate::storage`).
fn run_round(store: &Store, round: &Round) -> Result<RoundResult, redb::Error> {
    let mut txn = store.db.begin_write()?;
    // Write transactions are one at a time: this is the file's order.
    let seq = store.rounds.fetch_add(1, Ordering::Relaxed);
    txn.set_durability(Durability::Immediate)?;
    let mut raising = None;
    let result = {
        let mut fences = txn.open_table(FENCES)?;
        let mut entries = txn.open_table(ENTRIES)?;
        let mut alarms = txn.open_table(ALARMS)?;
        let mut usage_table = txn.open_table(USAGE)?;

        let mut tokens = BTreeMap::new();
        for p in plan::partitions(round) {
            if let Some(token) = fences.get(p)? {
                tokens.insert(p, token.value());
            }
        }
        let decisions = plan::decide(round, &tokens);
        store.landed.raising(&decisions.raised);
        let raising = raising.insert(Raising {
            landed: &store.landed,
            seq,
            raised: decisions.raised.clone(),
            usage: BTreeMap::new(),
            committing: false,
            committed: false,
        });
        for (p, token) in &decisions.raised {
            fences.insert(p, token)?;
        }

        let mut usage = BTreeMap::new();
        for tenant in plan::landed_tenants(round, &decisions) {
            let bytes = usage_table.get(tenant.as_str())?.map_or(0, |b| b.value());
            usage.insert(tenant, bytes);
        }
        let after = plan::usage_after(round, &decisions, &mut usage);
        for commit in decisions.landed(round) {
            apply(&mut entries, &mut alarms, commit)?;
        }
        for (tenant, bytes) in &usage {
            usage_table.insert(tenant.as_str(), bytes)?;
        }

        let mut loaded = Vec::new();
        for (load, stale) in round.loads.iter().zip(&decisions.loads) {
            if stale.is_some() {
                continue;
            }
            let tenant = load.scope.tenant();
            let tenant_bytes = match usage.get(tenant) {
                Some(bytes) => *bytes,
                None => usage_table.get(tenant)?.map_or(0, |b| b.value()),
            };
            loaded.push(Loaded {
                entries: scan(&entries, &load.scope, "", "", usize::MAX)?,
                alarms: key_alarms(&alarms, load.fence.partition, &load.scope)?,
                tenant_bytes,
            });
        }
        let mut by_partition = Vec::new();
        for partition in decisions.alarm_partitions(round) {
            by_partition.push(partition_alarms(&alarms, partition)?);
        }
        let changed = !decisions.raised.is_empty() || !round.commits.is_empty();
        raising.usage = usage;
        (
            plan::result(&decisions, after, loaded, by_partition),
            changed,
        )
    };
    let (result, changed) = result;
    if changed {
        if let Some(raising) = &mut raising {
            raising.committing = true;
        }
        txn.commit()?;
        if let Some(raising) = &mut raising {
            raising.committed = true;
        }
    } else {
        // Loads under tokens the store already holds change nothing: no
        // commit, so no fsync (a key's reactivation on a partition this
        // node already serves is a read). Measured: an evicted key's
        // reactivation 380 → 240 µs p50 (docs/benchmarks.md, "Issue 20").
        txn.abort()?;
    }
    Ok(result)
}

/// What the fence check answers a load when the partition's token is
/// `stored`: `None` to read the key's state, `Some(None)` when the load
/// would raise the token (a round must), `Some(Some(stale))` when it is
/// refused.
fn fence_check(stored: u64, load: &Load) -> Option<Option<Outcome<Loaded>>> {
    match storage_fence::load(stored, load.fence.token) {
        Ok(None) => None,
        Ok(Some(_raised)) => Some(None),
        Err(stale) => Some(Some(Outcome::Stale {
            current: stale.current,
        })),
    }
}

/// `load` read in a read transaction, when it changes nothing (see
/// [`Backend::read_load`]): `None` when it would raise the token.
fn read_load(store: &Store, load: &Load) -> Result<Option<Outcome<Loaded>>, redb::Error> {
    read_load_between(store, load, || {})
}

/// [`read_load`], running `between` after the first read of the landed
/// token and before the snapshot is taken (a test's raise lands there).
fn read_load_between(
    store: &Store,
    load: &Load,
    between: impl FnOnce(),
) -> Result<Option<Outcome<Loaded>>, redb::Error> {
    let partition = load.fence.partition;
    // The token as landed, read before the snapshot and again after it
    // (`landed.rs` says why both): a token already past the load's, or
    // below it, answers without a snapshot.
    let landed = store.landed.settled_token(partition);
    if let Some(answer) = landed.and_then(|stored| fence_check(stored, load)) {
        return Ok(answer);
    }
    between();
    let txn = store.db.begin_read()?;
    if landed.is_none() || store.landed.settled_token(partition) != landed {
        let fences = txn.open_table(FENCES)?;
        let stored = fences.get(partition)?.map_or(0, |t| t.value());
        if let Some(answer) = fence_check(stored, load) {
            return Ok(answer);
        }
    }
    let entries = txn.open_table(ENTRIES)?;
    let alarms = txn.open_table(ALARMS)?;
    Ok(Some(Outcome::Done(Loaded {
        entries: scan(&entries, &load.scope, "", "", usize::MAX)?,
        alarms: key_alarms(&alarms, partition, &load.scope)?,
        tenant_bytes: store.landed.tenant_bytes(load.scope.tenant()),
    })))
}

impl Backend for EmbeddedBackend {
    fn describe(&self) -> String {
        match &self.path {
            Some(path) => format!("embedded {}", path.display()),
            None => "embedded in memory (not durable)".to_owned(),
        }
    }

    fn round(&self, round: Round) -> BoxFuture<'_, Result<RoundResult, BackendError>> {
        if round.is_empty() {
            return Box::pin(async { Ok(RoundResult::default()) });
        }
        self.blocking(move |store| run_round(store, &round))
    }

    /// A read transaction on the caller's thread: redb's reads of pages it
    /// or the OS caches take microseconds, less than the two thread hops of
    /// a round; a page read from disk holds the caller's thread for it.
    fn read_load(&self, load: &Load) -> Option<Result<Outcome<Loaded>, BackendError>> {
        read_load(&self.store, load)
            .map_err(unavailable)
            .transpose()
    }

    fn read(
        &self,
        scope: KeyScope,
        prefix: String,
        limit: u32,
    ) -> BoxFuture<'_, Result<Vec<Entry>, BackendError>> {
        self.blocking(move |store| {
            let txn = store.db.begin_read()?;
            let entries = txn.open_table(ENTRIES)?;
            scan(&entries, &scope, &prefix, &prefix, limit as usize)
        })
    }

    fn read_alarms(
        &self,
        scope: KeyScope,
        partition: u32,
    ) -> BoxFuture<'_, Result<Vec<(String, u64)>, BackendError>> {
        self.blocking(move |store| {
            let txn = store.db.begin_read()?;
            let alarms = txn.open_table(ALARMS)?;
            key_alarms(&alarms, partition, &scope)
        })
    }

    fn highest_fence_token(&self) -> BoxFuture<'_, Result<u64, BackendError>> {
        self.blocking(|store| {
            let txn = store.db.begin_read()?;
            let fences = txn.open_table(FENCES)?;
            let mut highest = 0;
            for row in fences.iter()? {
                highest = highest.max(row?.1.value());
            }
            Ok(highest)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(partition: u32, token: u64) -> Load {
        Load {
            scope: KeyScope {
                module: "acme/m".to_owned(),
                key: "k".to_owned(),
            },
            fence: super::super::Fence { partition, token },
        }
    }

    fn raise(store: &Store, partition: u32, token: u64) {
        let round = Round {
            loads: vec![load(partition, token)],
            ..Round::default()
        };
        let result = run_round(store, &round).expect("the round");
        assert!(matches!(result.loads[..], [Outcome::Done(_)]), "{result:?}");
    }

    /// The landed token is read before the snapshot; a raise that lands
    /// before the snapshot is taken must still refuse the load, as the
    /// snapshot's own token would.
    #[test]
    fn a_raise_landing_before_the_snapshot_refuses_the_load() {
        let backend = EmbeddedBackend::in_memory().expect("a store");
        let store = &*backend.store;
        raise(store, 1, 3);
        let answer = read_load_between(store, &load(1, 3), || raise(store, 1, 4));
        assert_eq!(answer.expect("a read"), Some(Outcome::Stale { current: 4 }));
        // A raise committed but not yet recorded (its round between its
        // commit and its record) refuses it too.
        let answer = read_load_between(store, &load(1, 4), || {
            let raised = BTreeMap::from([(1, 5)]);
            store.landed.raising(&raised);
            let txn = store.db.begin_write().expect("a write");
            txn.open_table(FENCES)
                .expect("the fences")
                .insert(1, 5)
                .expect("the raise");
            txn.commit().expect("the commit");
        });
        assert_eq!(answer.expect("a read"), Some(Outcome::Stale { current: 5 }));
        // Settled again, the landed token answers without the table.
        store
            .landed
            .record(99, &BTreeMap::from([(1, 5)]), &BTreeMap::new(), true);
        let answer = read_load_between(store, &load(1, 5), || {});
        assert!(matches!(answer, Ok(Some(Outcome::Done(_)))), "{answer:?}");
    }

    /// A round whose commit failed may still have reached the file: its
    /// partitions stay unsettled (their loads read the snapshot's token);
    /// a round that failed before its commit clears its marks.
    #[test]
    fn a_failed_commit_leaves_its_partitions_unsettled() {
        let landed = Landed::new([(1, 3), (2, 3)], []);
        for (partition, committing) in [(1, true), (2, false)] {
            let raised = BTreeMap::from([(partition, 4)]);
            landed.raising(&raised);
            drop(Raising {
                landed: &landed,
                seq: 0,
                raised,
                usage: BTreeMap::new(),
                committing,
                committed: false,
            });
        }
        assert_eq!(
            landed.settled_token(1),
            None,
            "the commit's outcome is unknown"
        );
        assert_eq!(landed.settled_token(2), Some(3), "nothing was committed");
    }

    /// A reopened file's tokens and tenants' bytes are learnt at open.
    #[test]
    fn a_reopened_file_knows_what_it_landed() {
        let dir = std::env::temp_dir().join(format!(
            "fief-embedded-landed-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        let path = dir.join("state.redb");
        {
            let backend = EmbeddedBackend::open(&path).expect("the store");
            raise(&backend.store, 2, 7);
            let commit = super::super::Commit {
                scope: load(2, 7).scope,
                fence: super::super::Fence {
                    partition: 2,
                    token: 7,
                },
                writes: vec![Write::Put {
                    name: "a".to_owned(),
                    value: b"123".to_vec(),
                }],
                bytes_delta: 4,
            };
            let round = Round {
                commits: vec![commit],
                ..Round::default()
            };
            run_round(&backend.store, &round).expect("the commit");
        }
        let backend = EmbeddedBackend::open(&path).expect("the store again");
        assert_eq!(backend.store.landed.settled_token(2), Some(7));
        assert_eq!(backend.store.landed.tenant_bytes("acme"), 4);
        let answer = read_load(&backend.store, &load(2, 6));
        assert_eq!(answer.expect("a read"), Some(Outcome::Stale { current: 7 }));
        drop(backend);
        let _ = std::fs::remove_dir_all(dir);
    }
}
