//! The arbiters side by side (issue 23, item 4): the embedded
//! [`LocalArbiter`], [`PostgresArbiter`] and [`EtcdArbiter`], printed as a
//! table (not criterion: these are distributions and single events).
//!
//! - `renewal`: one lease renewed back to back, p50 / p99 / max, beside the
//!   renewal's own requests on a raw client (PostgreSQL: the arbiter's
//!   `UPDATE` on the same row; etcd: a keepalive and a put over one HTTP
//!   connection to the same member); then 8 leases renewed at once by 8
//!   tasks, each with an arbiter of its own (as 8 nodes would be).
//! - `failover`: two in-process nodes on the arbiter; the owner of a key
//!   dies (its process crashes: no renewal, no release) → the first call
//!   the survivor answers for that key. Once with the owner a follower,
//!   once with it the leader (the survivor campaigns first); whether the
//!   survivor fenced meanwhile, and why. Beside the lease TTL, which bounds
//!   it below by design. The crashes are spread over the renewal cycle.
//! - `outage`: one node renewing every 400 ms while its arbiter loses its
//!   server: etcd's raft leader killed (SIGKILL, then restarted), or the
//!   PostgreSQL server restarted (`pg_ctl stop -m fast`, `start`): the time
//!   until the arbiter answers the node's lease calls again, until its lease
//!   is current again, until the server is back (a new etcd leader; the
//!   PostgreSQL server accepting connections), and whether the node fenced
//!   (and why). The outages are spread over the renewal cycle. The local
//!   arbiter has no server to lose.
//!
//! Every node uses a TTL of 2 s (etcd's leases are whole seconds, at least
//! 2 s), renews every 400 ms and fences 500 ms before its lease's end; an
//! etcd arbiter bounds each request as a node does (a third of the renewal
//! interval).
//!
//! PostgreSQL is the server on 127.0.0.1:5432 (`FIEF_BENCH_POSTGRES`), in a
//! throwaway database dropped at the end; the restarts use a throwaway
//! server of the bench's own (`fief_tests::scratch_postgres`). etcd is a
//! 3-member cluster of real `etcd` processes on loopback started by the
//! bench (`fief_tests::etcd`). A row whose server is missing says so.
//!
//! Run with `cargo bench -p fief-benches --bench arbiters` (`-- --quick`
//! for the smoke run, `-- renewal` for one section). `docs/benchmarks.md`
//! says what limits each figure.

mod common;
#[path = "arbiters/outage.rs"]
mod outage;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{COUNTER_WASM, Mode, fmt_duration, guest, keys_owned_by, quantile, share};
use fief::arbiter::{Arbiter, EtcdArbiter, EtcdOptions, LeaseId, LocalArbiter, PostgresArbiter};
use fief::core::{NodeId, PartitionCount};
use fief::event_log::{NodeEvent, NodeEventKind, NodeEventObserver};
use fief::{Instance, ModuleOptions, NodeConfig, TokioClock};
use fief_tests::etcd::EtcdCluster;
use tokio::net::TcpListener;

/// The lease timing of every node and lease here.
const TTL: Duration = Duration::from_secs(2);
const RENEW_INTERVAL: Duration = Duration::from_millis(400);
const FENCE_MARGIN: Duration = Duration::from_millis(500);
const PARTITIONS: u32 = 64;
/// Nodes renewing at once in the concurrent renewal row.
const CONCURRENT: usize = 8;
/// How long a failover or an outage may take before the bench gives up.
const GIVE_UP: Duration = Duration::from_secs(30);

/// The bound on one etcd request a node sets for itself (a third of its
/// renewal interval: `etcd_request_timeout` in `host/src/node/start.rs`), so
/// a renewal tries the next member before the node gives up on it.
fn etcd_request_timeout() -> Duration {
    (RENEW_INTERVAL / 3).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

fn partitions() -> PartitionCount {
    PartitionCount::new(PARTITIONS).expect("a partition count")
}

// ---------------------------------------------------------------------------
// The arbiters under test
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Local,
    Postgres,
    Etcd,
}

const KINDS: [Kind; 3] = [Kind::Local, Kind::Postgres, Kind::Etcd];

/// The servers the arbiters talk to, or why one is missing.
struct Servers {
    clock: Arc<TokioClock>,
    /// A PostgreSQL URL with the throwaway database.
    postgres: Result<String, String>,
    etcd: Result<EtcdCluster, String>,
    /// The etcd arbiter's module store (a node keeps it in PostgreSQL; no
    /// figure here touches it after the nodes start).
    etcd_modules: LocalArbiter,
    /// Names namespaces, so every lease and node here is fresh.
    next: std::sync::atomic::AtomicU64,
}

impl Servers {
    /// Why `kind` cannot be measured, if it cannot.
    fn missing(&self, kind: Kind) -> Option<String> {
        match kind {
            Kind::Local => None,
            Kind::Postgres => self.postgres.as_ref().err().cloned(),
            Kind::Etcd => self.etcd.as_ref().err().cloned(),
        }
    }

    fn namespace(&self, what: &str) -> String {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        format!("bench-{what}-{n}")
    }

    /// A fresh arbiter of `kind` for `namespace` (its own connection, as a
    /// node's is; the local one is `shared`, as in-process nodes share it).
    async fn connect(
        &self,
        kind: Kind,
        namespace: &str,
        shared: &LocalArbiter,
    ) -> Arc<dyn Arbiter> {
        match kind {
            Kind::Local => Arc::new(shared.clone()),
            Kind::Postgres => {
                let url = self.postgres.as_ref().expect("PostgreSQL is there");
                Arc::new(
                    PostgresArbiter::connect(url, namespace, partitions())
                        .await
                        .expect("connecting the PostgreSQL arbiter"),
                )
            }
            Kind::Etcd => {
                let cluster = self.etcd.as_ref().expect("etcd is there");
                Arc::new(
                    EtcdArbiter::connect(
                        &cluster.url("fief-bench"),
                        namespace,
                        partitions(),
                        EtcdOptions {
                            request_timeout: etcd_request_timeout(),
                            ..EtcdOptions::default()
                        },
                        Arc::new(self.etcd_modules.clone()),
                    )
                    .await
                    .expect("connecting the etcd arbiter"),
                )
            }
        }
    }

    fn local(&self) -> LocalArbiter {
        LocalArbiter::new(self.clock.clone(), partitions())
    }
}

// ---------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------

/// One row: a figure, its cell for each arbiter, and its baseline or bound.
struct Row {
    figure: String,
    cells: [String; 3],
    bound: String,
}

fn print_table(rows: &[Row]) {
    println!();
    println!("| figure | local | PostgreSQL | etcd (3 members) | baseline / bound |");
    println!("|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {} |",
            r.figure, r.cells[0], r.cells[1], r.cells[2], r.bound
        );
    }
}

/// p50 / p99 / max of `samples`.
fn spread(samples: &mut [Duration]) -> String {
    let max = samples.iter().max().copied().unwrap_or_default();
    format!(
        "{} / {} / {}",
        fmt_duration(quantile(samples, 0.5)),
        fmt_duration(quantile(samples, 0.99)),
        fmt_duration(max)
    )
}

/// min / median / max of `samples`.
fn range(samples: &mut [Duration]) -> String {
    samples.sort_unstable();
    match (samples.first().copied(), samples.last().copied()) {
        (Some(min), Some(max)) => format!(
            "{} / {} / {}",
            fmt_duration(min),
            fmt_duration(quantile(samples, 0.5)),
            fmt_duration(max)
        ),
        _ => "—".to_owned(),
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------
// Renewal latency
// ---------------------------------------------------------------------------

/// The PostgreSQL arbiter's renewal (`host/src/arbiter/postgres/statements.rs`).
const RENEWAL_SQL: &str =
    "UPDATE fief_leases SET expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond',
        confirmed = true, renewals = renewals + 1
    WHERE namespace = $1 AND node_id = $2 AND lease_id = $3 AND expires_at > clock_timestamp()
    RETURNING renewals";

/// The renewal's own requests on a raw client, one sample at a time.
enum Raw {
    /// The arbiter's renewal statement on the arbiter's own lease row:
    /// prepared once (one round trip a renewal), or sent as text as the
    /// arbiter sends it (tokio-postgres then prepares it every time: two).
    Postgres {
        client: tokio_postgres::Client,
        prepared: Option<tokio_postgres::Statement>,
        namespace: String,
        node: String,
        lease: i64,
    },
    /// A keepalive of a lease of its own, then a put, on one keep-alive
    /// HTTP/1.1 connection to the member the arbiter asks first.
    Etcd {
        conn: common::HttpConn,
        keepalive: &'static [u8],
    },
}

impl Raw {
    /// The baselines of `kind` for `node`'s `lease`.
    async fn new(
        kind: Kind,
        servers: &Servers,
        namespace: &str,
        node: &NodeId,
        lease: LeaseId,
    ) -> Vec<Raw> {
        match kind {
            Kind::Local => Vec::new(),
            Kind::Postgres => {
                let url = servers.postgres.as_ref().expect("PostgreSQL is there");
                let mut raws = Vec::new();
                for prepare in [true, false] {
                    let client = common::pg_connect(url).await.expect("a raw connection");
                    let prepared = if prepare {
                        Some(
                            client
                                .prepare(RENEWAL_SQL)
                                .await
                                .expect("preparing the renewal"),
                        )
                    } else {
                        None
                    };
                    raws.push(Raw::Postgres {
                        client,
                        prepared,
                        namespace: namespace.to_owned(),
                        node: node.as_str().to_owned(),
                        lease: lease.0 as i64,
                    });
                }
                raws
            }
            Kind::Etcd => {
                let cluster = servers.etcd.as_ref().expect("etcd is there");
                let addr = cluster.endpoint(0).parse().expect("an address");
                let mut conn = common::HttpConn::open(addr).await;
                let grant = conn.post("/v3/lease/grant", br#"{"TTL":"600"}"#).await;
                let grant = String::from_utf8_lossy(&grant);
                let id = grant
                    .split("\"ID\":\"")
                    .nth(1)
                    .and_then(|rest| rest.split('"').next())
                    .expect("a lease id")
                    .to_owned();
                let keepalive = format!(r#"{{"ID":"{id}"}}"#).into_bytes().leak();
                vec![Raw::Etcd { conn, keepalive }]
            }
        }
    }

    async fn once(&mut self) {
        match self {
            Raw::Postgres {
                client,
                prepared,
                namespace,
                node,
                lease,
            } => {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
                    [&*namespace, &*node, &*lease];
                let row = match prepared {
                    Some(statement) => client.query_opt(&*statement, &params).await,
                    None => client.query_opt(RENEWAL_SQL, &params).await,
                };
                assert!(
                    row.expect("the raw renewal").is_some(),
                    "the raw renewal found the lease"
                );
            }
            Raw::Etcd { conn, keepalive } => {
                conn.post("/v3/lease/keepalive", keepalive).await;
                // key "fief-bench-raw", value "renewed" (base64).
                conn.post(
                    "/v3/kv/put",
                    br#"{"key":"ZmllZi1iZW5jaC1yYXc=","value":"cmVuZXdlZA=="}"#,
                )
                .await;
            }
        }
    }
}

/// `spread` of `base`, and how many times slower `fief` is at p50.
fn beside(fief: &mut [Duration], base: &mut [Duration]) -> String {
    let ratio = quantile(fief, 0.5).as_secs_f64() / quantile(base, 0.5).as_secs_f64();
    format!("{} (arbiter {ratio:.2}× at p50)", spread(base))
}

async fn renewal(mode: Mode, servers: &Servers, rows: &mut Vec<Row>) {
    let samples = mode.pick(2_000usize, 300, 20);
    let mut one = [const { String::new() }; 3];
    let mut raw = [const { String::new() }; 3];
    let mut raw2 = [const { String::new() }; 3];
    let mut many = [const { String::new() }; 3];
    for (k, kind) in KINDS.into_iter().enumerate() {
        if let Some(why) = servers.missing(kind) {
            for cell in [&mut one[k], &mut raw[k], &mut raw2[k], &mut many[k]] {
                *cell = format!("skipped: {why}");
            }
            continue;
        }
        // One lease, renewed back to back, alternately with the baselines.
        let local = servers.local();
        let ns = servers.namespace("renew");
        let arbiter = servers.connect(kind, &ns, &local).await;
        let node = NodeId::new("r0");
        let lease = arbiter
            .register(&ns, &node, TTL, None)
            .await
            .expect("a lease");
        let mut baselines = Raw::new(kind, servers, &ns, &node, lease).await;
        for _ in 0..samples / 20 {
            arbiter.renew(&ns, &node, lease).await.expect("a renewal");
            for b in &mut baselines {
                b.once().await;
            }
        }
        let mut fief = Vec::new();
        let mut base = vec![Vec::new(); baselines.len()];
        for _ in 0..samples {
            let started = Instant::now();
            arbiter.renew(&ns, &node, lease).await.expect("a renewal");
            fief.push(started.elapsed());
            for (b, times) in baselines.iter_mut().zip(&mut base) {
                let started = Instant::now();
                b.once().await;
                times.push(started.elapsed());
            }
        }
        one[k] = spread(&mut fief);
        raw[k] = match base.first_mut() {
            Some(times) => beside(&mut fief, times),
            None => "— (in-process)".to_owned(),
        };
        raw2[k] = match base.get_mut(1) {
            Some(times) => beside(&mut fief, times),
            None => "—".to_owned(),
        };
        arbiter.release(&ns, &node, lease).await.expect("a release");
        drop((arbiter, baselines));
        println!(
            "  renewal, {kind:?}, one lease: {} · raw {} · raw 2 {}",
            one[k], raw[k], raw2[k]
        );

        // CONCURRENT leases, each renewed back to back by a task with an
        // arbiter of its own.
        let ns = servers.namespace("renew8");
        let mut renewers = Vec::new();
        for i in 0..CONCURRENT {
            let arbiter = servers.connect(kind, &ns, &local).await;
            let node = NodeId::new(format!("c{i}"));
            let lease = arbiter
                .register(&ns, &node, TTL, None)
                .await
                .expect("a lease");
            renewers.push((arbiter, node, lease));
        }
        let started = Instant::now();
        let tasks: Vec<_> = renewers
            .into_iter()
            .enumerate()
            .map(|(i, (arbiter, node, lease))| {
                let ns = ns.clone();
                let n = share(samples as u64, CONCURRENT, i);
                tokio::spawn(async move {
                    let mut latencies = Vec::new();
                    for _ in 0..n {
                        let t = Instant::now();
                        arbiter.renew(&ns, &node, lease).await.expect("a renewal");
                        latencies.push(t.elapsed());
                    }
                    arbiter.release(&ns, &node, lease).await.expect("a release");
                    latencies
                })
            })
            .collect();
        let mut latencies = Vec::new();
        for task in tasks {
            latencies.extend(task.await.expect("a renewer"));
        }
        let rate = latencies.len() as f64 / started.elapsed().as_secs_f64();
        many[k] = format!("{} ({rate:.0} renewals/s)", spread(&mut latencies));
        println!(
            "  renewal, {kind:?}, {CONCURRENT} leases at once: {}",
            many[k]
        );
    }
    rows.push(Row {
        figure: format!("renewal latency p50 / p99 / max, one lease back to back ({samples})"),
        cells: one,
        bound: "the two rows below".to_owned(),
    });
    rows.push(Row {
        figure: "baseline: the renewal's own requests on a raw client, interleaved with it".to_owned(),
        cells: raw,
        bound: "PostgreSQL: the same `UPDATE`, prepared once (tokio-postgres); etcd: a keepalive and a put (HTTP/1.1, the same member)".to_owned(),
    });
    rows.push(Row {
        figure: "baseline: the same `UPDATE` sent as text, as the arbiter sends it".to_owned(),
        cells: raw2,
        bound: "tokio-postgres prepares a text statement at every call: two round trips".to_owned(),
    });
    rows.push(Row {
        figure: format!(
            "renewal latency p50 / p99 / max, {CONCURRENT} leases renewed at once ({samples} in all)"
        ),
        cells: many,
        bound: "—".to_owned(),
    });
}

// ---------------------------------------------------------------------------
// Failover
// ---------------------------------------------------------------------------

/// The fences of in-process nodes: (node index, cause), in order.
type Fences = Arc<Mutex<Vec<(usize, String)>>>;

/// An event observer that logs node `i`'s fences in `fences`.
fn log_fences(fences: &Fences, i: usize) -> NodeEventObserver {
    let fences = fences.clone();
    Arc::new(move |event: NodeEvent| {
        if let NodeEventKind::Fenced { cause, .. } = event.kind {
            fences.lock().unwrap().push((i, cause));
        }
    })
}

/// "k of n (cause; cause)" for the fences of `fences`.
fn fenced_of(fences: &[String], n: usize) -> String {
    let mut causes = fences.to_vec();
    causes.sort();
    causes.dedup();
    if causes.is_empty() {
        format!("0 of {n}")
    } else {
        format!("{} of {n} ({})", fences.len(), causes.join("; "))
    }
}

fn node_config(namespace: &str, i: usize) -> NodeConfig {
    NodeConfig {
        namespace: namespace.to_owned(),
        node_id: format!("n{i}"),
        partitions: PARTITIONS,
        max_live_keys: 1024,
        lease_ttl: TTL,
        renew_interval: RENEW_INTERVAL,
        fence_margin: FENCE_MARGIN,
        call_timeout: Duration::from_secs(2),
        ..NodeConfig::default()
    }
}

/// Two nodes on a fresh arbiter of `kind` (each its own connection), `n0`
/// started first (it leads), their fences logged in `fences`; returns once
/// each owns half the partitions.
async fn pair(servers: &Servers, kind: Kind, fences: &Fences) -> Vec<Option<Instance>> {
    let ns = servers.namespace("failover");
    let local = servers.local();
    let mut nodes = Vec::new();
    for i in 0..2 {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
        let node = Instance::builder(node_config(&ns, i))
            .arbiter(servers.connect(kind, &ns, &local).await)
            .clock(servers.clock.clone())
            .peer_listener(listener)
            .events(log_fences(fences, i))
            .module("counter", guest(COUNTER_WASM), ModuleOptions::default())
            .start()
            .await
            .expect("starting a node");
        nodes.push(Some(node));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let owned: Vec<usize> = nodes
            .iter()
            .flatten()
            .map(|n| n.status().partitions_owned)
            .collect();
        if owned.iter().sum::<usize>() == PARTITIONS as usize
            && owned.iter().all(|o| *o + 1 >= PARTITIONS as usize / 2)
        {
            return nodes;
        }
        assert!(
            Instant::now() < deadline,
            "the pair never balanced: {owned:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one failover gave: the time until the survivor answered (`None`
/// if it did not within [`GIVE_UP`]) and why the survivor fenced, if it did.
struct Failover {
    took: Option<Duration>,
    survivor_fenced: Option<String>,
}

/// One failover: `dead` (0, the leader, or 1) owns a key and crashes, `phase`
/// after the pair is ready (so the crashes fall at different points of the
/// renewal cycle); the time until the other node answers a call to it.
async fn failover_once(servers: &Servers, kind: Kind, dead: usize, phase: Duration) -> Failover {
    let fences = Fences::default();
    let mut nodes = pair(servers, kind, &fences).await;
    let survivor = 1 - dead;
    let via = nodes[survivor].as_ref().expect("running");
    let owner = nodes[dead].as_ref().expect("running");
    let key = keys_owned_by(via, owner, "counter", "f", 1).await.remove(0);
    let dying = nodes[dead].take().expect("running");
    let via = nodes[survivor].as_ref().expect("running");
    tokio::time::sleep(phase).await;
    let before = fences.lock().unwrap().len();
    let t0 = Instant::now();
    // A crashed process takes its sockets with it: cut the survivor's link
    // to it as the dead process would (as `scale.rs` does).
    assert!(via.set_peer_link(&format!("n{dead}"), false).await);
    dying.crash().await;
    let took = loop {
        if via.call("counter", &key, b"get".to_vec()).await.is_ok() {
            break Some(t0.elapsed());
        }
        if t0.elapsed() > GIVE_UP {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    // What the arbiter seemed to lose, if the survivor fenced for that (its
    // first sentence: what went back).
    let regression = via
        .status()
        .arbiter_regression
        .map(|r| r.split(". ").next().unwrap_or_default().to_owned());
    for node in nodes.into_iter().flatten() {
        node.shutdown().await;
    }
    let survivor_fenced = fences.lock().unwrap()[before..]
        .iter()
        .find(|(i, _)| *i == survivor)
        .map(|(_, cause)| regression.unwrap_or_else(|| cause.clone()));
    Failover {
        took,
        survivor_fenced,
    }
}

async fn failover(mode: Mode, servers: &Servers, rows: &mut Vec<Row>) {
    let samples = mode.pick(3, 1, 1);
    for (dead, who) in [(1, "a follower"), (0, "the leader")] {
        let mut cells = [const { String::new() }; 3];
        for (k, kind) in KINDS.into_iter().enumerate() {
            if let Some(why) = servers.missing(kind) {
                cells[k] = format!("skipped: {why}");
                continue;
            }
            let mut took = Vec::new();
            let mut lost = 0;
            let mut fenced = Vec::new();
            for sample in 0..samples {
                let phase = RENEW_INTERVAL * sample / samples;
                let failover = failover_once(servers, kind, dead, phase).await;
                match failover.took {
                    Some(t) => took.push(t),
                    None => lost += 1,
                }
                fenced.extend(failover.survivor_fenced);
            }
            took.sort_unstable();
            cells[k] = match (took.first(), took.last()) {
                (Some(min), Some(max)) if samples > 1 => {
                    format!("{} – {}", fmt_duration(*min), fmt_duration(*max))
                }
                (Some(t), _) => fmt_duration(*t),
                _ => String::new(),
            };
            if lost > 0 {
                cells[k] += &format!(" (**{lost} never answered within {GIVE_UP:?}**)");
            }
            if !fenced.is_empty() {
                cells[k] += &format!(
                    "; the survivor fenced in {}",
                    fenced_of(&fenced, samples as usize)
                );
            }
            println!("  failover, {kind:?}, {who} dies: {}", cells[k]);
        }
        rows.push(Row {
            figure: format!(
                "failover: {who} owning the key crashes → first call answered by the survivor (best – worst of {samples})"
            ),
            cells,
            bound: format!(
                "TTL {} s, renewed every {} ms: a lease ends TTL after its last renewal, so ≥ TTL − {} ms",
                TTL.as_secs(),
                RENEW_INTERVAL.as_millis(),
                RENEW_INTERVAL.as_millis()
            ),
        });
    }
}

// ---------------------------------------------------------------------------

async fn servers() -> (Servers, Option<common::Throwaway>) {
    let (postgres, db) = match common::throwaway_database("arbiters").await {
        Ok(db) => (Ok(format!("{}/{}", db.server, db.database)), Some(db)),
        Err(why) => (Err(why), None),
    };
    let etcd = if std::path::Path::new(fief_tests::etcd::ETCD_BIN).exists() {
        Ok(EtcdCluster::start(3).await)
    } else {
        Err(format!("no {}", fief_tests::etcd::ETCD_BIN))
    };
    let clock = Arc::new(TokioClock::new());
    let servers = Servers {
        etcd_modules: LocalArbiter::new(clock.clone(), partitions()),
        clock,
        postgres,
        etcd,
        next: std::sync::atomic::AtomicU64::new(0),
    };
    (servers, db)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = Mode::from_args(&args);
    let wanted = common::sections(&args[1..]);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    println!("arbiters ({mode:?} mode; load average {})", load());
    let started = Instant::now();
    let mut rows = Vec::new();
    runtime.block_on(async {
        let (mut servers, db) = servers().await;
        if let Ok(cluster) = &servers.etcd {
            let leader = cluster.leader().await;
            let leader = leader.map_or("none".to_owned(), |l| format!("m{l}"));
            println!("etcd: 3 members on loopback, the raft leader {leader}");
        }
        if wanted("renewal") {
            renewal(mode, &servers, &mut rows).await;
        }
        if wanted("failover") {
            failover(mode, &servers, &mut rows).await;
        }
        if wanted("outage") {
            outage::outage(mode, &mut servers, &mut rows).await;
        }
        drop(servers);
        if let Some(db) = db {
            common::drop_database(db).await;
        }
    });
    print_table(&rows);
    println!(
        "\n(measured in {:.1} s; load average at the end {})",
        started.elapsed().as_secs_f64(),
        load()
    );
}
