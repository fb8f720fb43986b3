//! Group commit: the node's one pipeline to its storage backend.
//!
//! Key processes hand their loads and commits to the [`StorageWriter`],
//! which gathers whatever is waiting into one [`Round`] (one transaction,
//! one fsync) and runs rounds one after another. One round at a time keeps
//! the order a single node needs: a commit handed over before a load of the
//! same key is in that load's round or an earlier one, and a round applies
//! its commits before it reads its loads — so a key's next process on this
//! node always loads what its previous process committed, even though the
//! ownership token did not change between them.
//!
//! A load that changes nothing (its partition's fence token already is the
//! load's) of a key with nothing in flight is read at once beside the rounds
//! when the backend can ([`Backend::read_load`], `unsettled.rs`): the same
//! answer, without two thread hops and a write transaction.
//!
//! It also keeps the node's view of each tenant's stored bytes (what the
//! store answered last), which writes are checked against, and the storage
//! metrics; and it tells the node's alarm schedule ([`AlarmSink`]) of every
//! landed commit's alarm changes and every partition's alarm load, in the
//! order the store applied them. It must not decide whether a process may write (the output gate
//! and the backend's fence check do) and holds no key state.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio::sync::{mpsc, oneshot};

use super::unsettled::{InFlight, Unsettled};
use super::{Backend, BackendError, Commit, Fence, KeyScope, Load, Loaded, Outcome, Round, Write};
use fief_core::alarm::{AlarmChange, StoredAlarm};

/// Where the writer reports what the alarm schedule must hear, in the
/// order the store applied it (`docs/alarms.md`, "Firing"): called on the
/// writer's task between rounds' answers, so it must not block.
pub(crate) trait AlarmSink: Send + Sync {
    /// A commit of `scope` landed under `fence` with these alarm changes.
    fn committed(&self, fence: Fence, scope: &KeyScope, changes: &[AlarmChange]);
    /// A partition's alarm load under `fence` answered.
    fn loaded(&self, fence: Fence, outcome: Result<Outcome<Vec<StoredAlarm>>, BackendError>);
}

/// The alarm changes of `writes`, in order.
fn alarm_changes(writes: &[Write]) -> Vec<AlarmChange> {
    writes
        .iter()
        .filter_map(|w| match w {
            Write::SetAlarm { name, at_ms } => Some(AlarmChange::Set {
                name: name.clone(),
                at_ms: *at_ms,
            }),
            Write::CancelAlarm { name } => Some(AlarmChange::Cancel { name: name.clone() }),
            _ => None,
        })
        .collect()
}

/// What the writer and its task share: what each tenant stores (as the
/// store last answered), the metrics, and what is in flight.
struct Books {
    usage: Mutex<Usage>,
    metrics: StorageMetrics,
    unsettled: Unsettled,
}

/// Each tenant's stored bytes as the store last answered, and how many
/// rounds have answered, so that a read beside the rounds, whose snapshot
/// may be older than a round answered meanwhile, does not overwrite it.
#[derive(Default)]
struct Usage {
    bytes: HashMap<String, u64>,
    rounds: u64,
}

impl Books {
    fn usage(&self) -> std::sync::MutexGuard<'_, Usage> {
        self.usage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Rounds answered so far: taken before a read beside the rounds.
    fn rounds(&self) -> u64 {
        self.usage().rounds
    }

    /// A round landed: its answers come next.
    fn round_answered(&self) {
        self.usage().rounds += 1;
    }

    /// The store answered that `tenant` stores `bytes`: in a round
    /// (`read_after: None`), or in a read begun when
    /// [`rounds`](Self::rounds) was `read_after`, which is dropped if a
    /// round answered since (its figure may be newer).
    fn learnt(&self, tenant: &str, bytes: u64, read_after: Option<u64>) {
        let mut usage = self.usage();
        if read_after.is_some_and(|seen| seen != usage.rounds) {
            return;
        }
        self.metrics
            .tenant_bytes
            .get_or_create(&[("tenant", tenant.to_owned())])
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        usage.bytes.insert(tenant.to_owned(), bytes);
    }

    /// Count a load's answer (and learn its tenant's bytes; `read_after`
    /// as for [`learnt`](Self::learnt)).
    fn load_answered(
        &self,
        tenant: &str,
        answer: &Result<Outcome<Loaded>, BackendError>,
        read_after: Option<u64>,
    ) {
        let label = match answer {
            Ok(Outcome::Done(loaded)) => {
                self.learnt(tenant, loaded.tenant_bytes, read_after);
                "ok"
            }
            Ok(Outcome::Stale { .. }) => "stale",
            Err(_) => "failed",
        };
        self.metrics
            .loads
            .get_or_create(&[("outcome", label)])
            .inc();
    }
}

/// The node's alarm sink, once the node has set it.
type SinkCell = Arc<OnceLock<Arc<dyn AlarmSink>>>;

/// Most commits and loads in one round.
const MAX_ROUND_REQUESTS: usize = 1024;

/// Most bytes of written values in one round; a commit past it waits for
/// the next round (a single larger commit gets a round of its own).
const MAX_ROUND_BYTES: usize = 16 * 1024 * 1024;

/// Longest a round may take before its waiters are told the store is
/// unavailable. The round may still land later: a commit's caller then
/// learns "unknown", never a false "not written" (see `Error::StorageUnavailable`).
pub(crate) const ROUND_TIMEOUT: Duration = Duration::from_secs(10);

/// The storage series of a node's metrics.
#[derive(Clone)]
pub(crate) struct StorageMetrics {
    commits: Family<[(&'static str, &'static str); 1], Counter>,
    loads: Family<[(&'static str, &'static str); 1], Counter>,
    commit_seconds: Histogram,
    round_size: Histogram,
    tenant_bytes: Family<[(&'static str, String); 1], Gauge>,
}

impl StorageMetrics {
    /// Fresh series, registered in `registry`.
    pub(crate) fn register(registry: &mut Registry) -> Self {
        let metrics = StorageMetrics {
            commits: Family::default(),
            loads: Family::default(),
            commit_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            round_size: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            tenant_bytes: Family::default(),
        };
        registry.register(
            "storage_commits",
            "Commits of key state by outcome: ok, stale (refused: the process's ownership ended, a newer owner loaded the key), failed (the store did not answer or failed)",
            metrics.commits.clone(),
        );
        registry.register(
            "storage_loads",
            "Loads of key state by outcome: ok, stale, failed",
            metrics.loads.clone(),
        );
        registry.register(
            "storage_commit_duration_seconds",
            "Time from a commit's hand-over to its answer (waiting for its round included)",
            metrics.commit_seconds.clone(),
        );
        registry.register(
            "storage_round_size",
            "Commits and loads in one storage round (one transaction)",
            metrics.round_size.clone(),
        );
        registry.register(
            "storage_tenant_bytes",
            "Bytes stored for a tenant (names plus values), as the store last answered this node, by tenant (\"\": modules of no tenant)",
            metrics.tenant_bytes.clone(),
        );
        metrics
    }
}

enum Request {
    Commit(
        Commit,
        (Instant, InFlight),
        oneshot::Sender<Result<Outcome<u64>, BackendError>>,
    ),
    Load(Load, oneshot::Sender<Result<Outcome<Loaded>, BackendError>>),
    /// A partition's alarms, for its new owner: answered to the sink.
    PartitionAlarms(Fence),
}

impl Request {
    fn bytes(&self) -> usize {
        match self {
            Request::Commit(commit, ..) => commit
                .writes
                .iter()
                .map(|w| match w {
                    super::Write::Put { name, value } => name.len() + value.len(),
                    super::Write::Delete { name } => name.len(),
                    super::Write::DeleteRange { start, end } => {
                        start.len() + end.as_ref().map_or(0, String::len)
                    }
                    super::Write::SetAlarm { name, .. } => name.len() + 8,
                    super::Write::CancelAlarm { name } => name.len(),
                })
                .sum(),
            Request::Load(..) | Request::PartitionAlarms(_) => 0,
        }
    }
}

/// The node's pipeline to its backend (see the module header).
pub(crate) struct StorageWriter {
    tx: mpsc::UnboundedSender<Request>,
    backend: Arc<dyn Backend>,
    books: Arc<Books>,
    sink: SinkCell,
}

impl StorageWriter {
    /// Start the pipeline on the current tokio runtime.
    pub(crate) fn start(backend: Arc<dyn Backend>, metrics: StorageMetrics) -> Arc<Self> {
        Self::start_with(backend, metrics, ROUND_TIMEOUT)
    }

    /// [`StorageWriter::start`] with rounds given up after `timeout`.
    fn start_with(
        backend: Arc<dyn Backend>,
        metrics: StorageMetrics,
        timeout: Duration,
    ) -> Arc<Self> {
        let (tx, rx) = mpsc::unbounded_channel();
        let books = Arc::new(Books {
            usage: Mutex::default(),
            metrics,
            unsettled: Unsettled::default(),
        });
        let sink = SinkCell::default();
        let shared = (books.clone(), sink.clone());
        tokio::spawn(run(backend.clone(), rx, shared, timeout));
        Arc::new(StorageWriter {
            tx,
            backend,
            books,
            sink,
        })
    }

    /// Report alarm changes and partition alarm loads to `sink` from now
    /// on (once; a second sink is ignored).
    pub(crate) fn set_alarm_sink(&self, sink: Arc<dyn AlarmSink>) {
        let _ = self.sink.set(sink);
    }

    /// Load a partition's alarms under `fence` (raising its fence token);
    /// the answer goes to the alarm sink.
    pub(crate) fn load_partition_alarms(&self, fence: Fence) -> Result<(), BackendError> {
        self.send(Request::PartitionAlarms(fence))
    }

    /// The backend, for `fief status` and operators' reads.
    pub(crate) fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// Bytes `tenant` stores, as the store last answered this node.
    pub(crate) fn tenant_bytes(&self, tenant: &str) -> u64 {
        self.books.usage().bytes.get(tenant).copied().unwrap_or(0)
    }

    /// Load a key's state (raising its partition's fence token): read at
    /// once when the key is settled and the load changes nothing, else in
    /// the next round (see the module header).
    pub(crate) async fn load(&self, load: Load) -> Result<Outcome<Loaded>, BackendError> {
        if self.books.unsettled.settled(&load.scope) {
            let read_after = self.books.rounds();
            if let Some(answer) = self.backend.read_load(&load) {
                self.books
                    .load_answered(load.scope.tenant(), &answer, Some(read_after));
                return answer;
            }
        }
        let (tx, rx) = oneshot::channel();
        self.send(Request::Load(load, tx))?;
        answer(rx).await
    }

    /// Commit a callback's writes; answers once its round has landed.
    pub(crate) async fn commit(&self, commit: Commit) -> Result<Outcome<u64>, BackendError> {
        let (tx, rx) = oneshot::channel();
        let in_flight = self.books.unsettled.handed(&commit.scope);
        if let Err(e) = self.send(Request::Commit(commit, (Instant::now(), in_flight), tx)) {
            self.books.unsettled.answered(in_flight);
            return Err(e);
        }
        answer(rx).await
    }

    fn send(&self, request: Request) -> Result<(), BackendError> {
        self.tx
            .send(request)
            .map_err(|_| BackendError::Unavailable("the node's storage writer has stopped".into()))
    }
}

async fn answer<T>(rx: oneshot::Receiver<Result<T, BackendError>>) -> Result<T, BackendError> {
    rx.await.unwrap_or_else(|_| {
        Err(BackendError::Unavailable(
            "the node's storage writer stopped before answering".into(),
        ))
    })
}

/// The writer's loop: one round at a time.
async fn run(
    backend: Arc<dyn Backend>,
    mut rx: mpsc::UnboundedReceiver<Request>,
    (books, sink): (Arc<Books>, SinkCell),
    timeout: Duration,
) {
    let mut carried: Option<Request> = None;
    loop {
        let first = match carried.take() {
            Some(request) => request,
            None => match rx.recv().await {
                Some(request) => request,
                None => return,
            },
        };
        let mut bytes = first.bytes();
        let mut requests = vec![first];
        while requests.len() < MAX_ROUND_REQUESTS {
            let Ok(next) = rx.try_recv() else { break };
            let size = next.bytes();
            if bytes + size > MAX_ROUND_BYTES {
                carried = Some(next);
                break;
            }
            bytes += size;
            requests.push(next);
        }
        run_round(&*backend, requests, (&books, sink.get()), timeout).await;
    }
}

/// Run one round and answer its waiters.
async fn run_round(
    backend: &dyn Backend,
    requests: Vec<Request>,
    (books, sink): (&Books, Option<&Arc<dyn AlarmSink>>),
    timeout: Duration,
) {
    let metrics = &books.metrics;
    metrics.round_size.observe(requests.len() as f64);
    let mut round = Round::default();
    let (mut commit_waiters, mut load_waiters) = (Vec::new(), Vec::new());
    // Each commit's alarm changes, to report once it landed.
    let mut alarm_commits = Vec::new();
    for request in requests {
        match request {
            Request::Commit(commit, sent, tx) => {
                commit_waiters.push((commit.scope.tenant().to_owned(), sent, tx));
                let changes = if sink.is_some() {
                    alarm_changes(&commit.writes)
                } else {
                    Vec::new()
                };
                alarm_commits.push((commit.fence, commit.scope.clone(), changes));
                round.commits.push(commit);
            }
            Request::PartitionAlarms(fence) => round.partition_alarms.push(fence),
            Request::Load(load, tx) => {
                load_waiters.push((load.scope.tenant().to_owned(), tx));
                round.loads.push(load);
            }
        }
    }
    let round_alarm_fences = round.partition_alarms.clone();
    let result = match tokio::time::timeout(timeout, backend.round(round)).await {
        Ok(result) => {
            books.unsettled.came_back();
            result
        }
        Err(_) => {
            // Before its commits are answered: it may still land.
            books.unsettled.abandoned();
            Err(BackendError::Unavailable(format!(
                "the store did not answer within {timeout:?}"
            )))
        }
    };
    let result = match result {
        Ok(result) => result,
        Err(error) => {
            for (_, (since, in_flight), tx) in commit_waiters {
                books.unsettled.answered(in_flight);
                metrics
                    .commits
                    .get_or_create(&[("outcome", "failed")])
                    .inc();
                metrics
                    .commit_seconds
                    .observe(since.elapsed().as_secs_f64());
                let _ = tx.send(Err(error.clone()));
            }
            for (tenant, tx) in load_waiters {
                let answer = Err(error.clone());
                books.load_answered(&tenant, &answer, None);
                let _ = tx.send(answer);
            }
            if let Some(sink) = sink {
                for fence in round_alarm_fences {
                    sink.loaded(fence, Err(error.clone()));
                }
            }
            return;
        }
    };
    books.round_answered();
    let mut alarm_commits = alarm_commits.into_iter();
    for ((tenant, (since, in_flight), tx), outcome) in
        commit_waiters.into_iter().zip(result.commits)
    {
        books.unsettled.answered(in_flight);
        let alarms = alarm_commits.next();
        let label = match &outcome {
            Outcome::Done(bytes) => {
                books.learnt(&tenant, *bytes, None);
                if let (Some(sink), Some((fence, scope, changes))) = (sink, &alarms)
                    && !changes.is_empty()
                {
                    sink.committed(*fence, scope, changes);
                }
                "ok"
            }
            Outcome::Stale { .. } => "stale",
        };
        metrics.commits.get_or_create(&[("outcome", label)]).inc();
        metrics
            .commit_seconds
            .observe(since.elapsed().as_secs_f64());
        let _ = tx.send(Ok(outcome));
    }
    for ((tenant, tx), outcome) in load_waiters.into_iter().zip(result.loads) {
        let answer = Ok(outcome);
        books.load_answered(&tenant, &answer, None);
        let _ = tx.send(answer);
    }
    if let Some(sink) = sink {
        for (fence, outcome) in round_alarm_fences.into_iter().zip(result.partition_alarms) {
            sink.loaded(fence, Ok(outcome));
        }
    }
}

#[cfg(test)]
#[path = "writer_tests.rs"]
mod tests;
