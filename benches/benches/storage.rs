//! Benchmarks of durable key state (`fief:key/storage`, `docs/storage.md`),
//! each Fief figure beside its raw counterpart in the same run.
//!
//! Fief's side is a real node with `examples/stored-counter` deployed: every
//! `incr` reads the count (from memory), writes it, and answers only once the
//! write is committed — the node's group commit gathers whatever commits are
//! waiting into one transaction (`host/src/storage/writer.rs`).
//!
//! - `storage_commits_embedded`: durable commits per second at 1, 64 and
//!   1,024 concurrent keys (one task per key, each calling `incr` on its own
//!   key, one call at a time), on a node with embedded storage (redb,
//!   `state.redb` in a temporary data directory under the target
//!   directory, so on a real disk). Raw: redb on a file in the same
//!   directory, one write transaction with `Durability::Immediate` per
//!   write, from `min(keys, 32)` threads (redb has one writer at a time, so
//!   concurrency does not help it).
//! - `storage_commits_postgres`: the same on a node whose storage is
//!   PostgreSQL (127.0.0.1:5432, user `postgres`; a throwaway database made
//!   for the run and dropped after it). Raw: single-row upsert transactions
//!   (`BEGIN`; a prepared `INSERT … ON CONFLICT DO UPDATE`; `COMMIT`) with
//!   tokio-postgres over `min(keys, 32)` connections, one task each. Skipped
//!   with a printed note when PostgreSQL cannot be reached.
//! - `storage_read`: `get` on a live stored counter (the value is read from
//!   the key's loaded state, in memory) beside a warm `get` on a live
//!   `examples/counter` key (no storage at all), on the embedded node; and
//!   the same within one guest: the `vault` test guest's `get n` (one
//!   `storage::get`, which the SDK's read cache serves after the first) and
//!   `get-import n` (the `fief:key/storage` import itself, past the cache)
//!   beside its `token` (one trivial host call).
//! - `storage_read_interleaved` (printed as a table at the end): the same
//!   pairs, and `get absent` (no value to copy back), with batches of the
//!   read and of its baseline alternating, so the VM's drift between two
//!   criterion benches does not fall on one side only.
//! - `storage_commit_latency` (printed as a table at the end): p50 and p99 of
//!   one `incr` on one key, one at a time, interleaved sample by sample with
//!   one raw commit (the redb transaction, the PostgreSQL upsert
//!   transaction).
//!
//! Criterion reports durable commits (elements) per second. Run with
//! `cargo bench -p fief-benches --bench storage` (add `-- --quick` for the
//! smoke run); figures are in `docs/benchmarks.md`. `FIEF_BENCH_POSTGRES`
//! overrides the server (`postgres://postgres@127.0.0.1:5432`, no database).

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    COUNTER_WASM, Mode, Throwaway, drop_database, fmt_duration, guest, pg_connect, quantile,
    throwaway_database,
};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput};
use fief::{Instance, ModuleOptions, NodeConfig};
use tokio::runtime::Runtime;

/// The stored counter, built from source by `build.rs`.
const STORED_COUNTER_WASM: &str = env!("FIEF_GUEST_STORED_COUNTER");
/// The `vault` test guest, built by `build.rs`.
const VAULT_WASM: &str = env!("FIEF_GUEST_VAULT");
/// Module name of the stored counter.
const STORED: &str = "stored";
/// Module name of the in-memory counter (the warm call).
const COUNTER: &str = "counter";
/// Module name of the `vault` test guest (a second read pair).
const VAULT: &str = "vault";
/// The `storage_read` rows: name, module, message (all on the key
/// `reader`, live and loaded). Pairs: a stored counter's `get` beside the
/// in-memory counter's `get`; the vault's `get n` (one `storage::get`,
/// served by the SDK's read cache after the first) and `get-import n` (the
/// import itself, past the cache) beside its `token` (one trivial host
/// call, no storage).
const READS: [(&str, &str, &[u8]); 5] = [
    ("stored_counter_get", STORED, b"get"),
    ("counter_get", COUNTER, b"get"),
    ("vault_get", VAULT, b"get n"),
    ("vault_get_import", VAULT, b"get-import n"),
    ("vault_token", VAULT, b"token"),
];
/// Concurrent keys of the commit benches.
const SIZES: [usize; 3] = [1, 64, 1024];
/// Most raw PostgreSQL connections (and raw redb threads).
const RAW_CONNECTIONS: usize = 32;
/// The raw upsert, as prepared on every raw connection.
const RAW_UPSERT: &str = "INSERT INTO raw_counts (k, v) VALUES ($1, $2)
     ON CONFLICT (k) DO UPDATE SET v = excluded.v";
/// The raw redb table.
const RAW_TABLE: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("raw");

/// The raw side of one backend.
enum RawStore {
    /// A redb database on a file.
    Redb(Arc<redb::Database>),
    /// Connections to the throwaway database, each with the upsert prepared.
    Postgres(Arc<Vec<RawPg>>),
}

/// One raw PostgreSQL connection.
struct RawPg {
    client: tokio_postgres::Client,
    upsert: tokio_postgres::Statement,
}

impl RawPg {
    /// One single-row upsert transaction.
    async fn commit(&self, key: &str, value: &[u8]) {
        self.client.batch_execute("BEGIN").await.expect("BEGIN");
        self.client
            .execute(&self.upsert, &[&key, &value])
            .await
            .expect("the upsert");
        self.client.batch_execute("COMMIT").await.expect("COMMIT");
    }
}

/// One durable write transaction in redb.
fn redb_commit(db: &redb::Database, key: &str, value: &[u8]) {
    let mut txn = db.begin_write().expect("a write transaction");
    txn.set_durability(redb::Durability::Immediate)
        .expect("durability");
    txn.open_table(RAW_TABLE)
        .expect("the table")
        .insert(key, value)
        .expect("insert");
    txn.commit().expect("commit");
}

/// A node with the stored counter (and the counter) deployed, its raw
/// counterpart, and the key names.
struct Side {
    /// `embedded` or `postgres`.
    name: &'static str,
    node: Arc<Instance>,
    raw: RawStore,
    keys: Arc<Vec<String>>,
}

fn node_config(storage: String, data_dir: Option<&Path>) -> NodeConfig {
    NodeConfig {
        namespace: "bench".to_owned(),
        storage: Some(storage),
        data_dir: data_dir.map(Path::to_owned),
        // The 1,024 keys and a few more; a small pool keeps the process
        // well under the default `vm.max_map_count`.
        max_live_keys: 1280,
        ..NodeConfig::default()
    }
}

async fn start_node(config: NodeConfig) -> Arc<Instance> {
    let node = common::embedded_node(
        config,
        &[
            (
                STORED,
                guest(STORED_COUNTER_WASM).as_slice(),
                ModuleOptions::default(),
            ),
            (
                COUNTER,
                guest(COUNTER_WASM).as_slice(),
                ModuleOptions::default(),
            ),
            (
                VAULT,
                guest(VAULT_WASM).as_slice(),
                ModuleOptions::default(),
            ),
        ],
    )
    .await;
    Arc::new(node)
}

impl Side {
    /// Activate every key (its first load is not timed).
    async fn activate(&self) {
        let tasks: Vec<_> = self
            .keys
            .iter()
            .cloned()
            .map(|key| {
                let node = self.node.clone();
                tokio::spawn(async move {
                    node.call(STORED, &key, b"get".to_vec())
                        .await
                        .unwrap_or_else(|e| panic!("activating {key}: {e}"));
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("an activation task");
        }
    }

    /// `n` tasks, each calling `incr` `iters` times on its own key.
    async fn fief_commits(&self, n: usize, iters: u64) -> Duration {
        let start = Instant::now();
        let tasks: Vec<_> = (0..n)
            .map(|i| {
                let (node, keys) = (self.node.clone(), self.keys.clone());
                tokio::spawn(async move {
                    for _ in 0..iters {
                        let reply = node.call(STORED, &keys[i], b"incr".to_vec()).await;
                        std::hint::black_box(reply.expect("incr"));
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("a caller task");
        }
        start.elapsed()
    }

    /// `iters` raw commits of each of `n` keys, from `min(n, 32)` tasks or
    /// threads, each owning every 32nd key.
    async fn raw_commits(&self, n: usize, iters: u64) -> Duration {
        let lanes = n.min(RAW_CONNECTIONS);
        let start = Instant::now();
        match &self.raw {
            RawStore::Redb(db) => {
                let (db, keys) = (db.clone(), self.keys.clone());
                tokio::task::spawn_blocking(move || {
                    std::thread::scope(|s| {
                        for lane in 0..lanes {
                            let (db, keys) = (&db, &keys);
                            s.spawn(move || {
                                for round in 0..iters {
                                    let value = round.to_string();
                                    for i in (lane..n).step_by(lanes) {
                                        redb_commit(db, &keys[i], value.as_bytes());
                                    }
                                }
                            });
                        }
                    });
                })
                .await
                .expect("the raw redb writers");
            }
            RawStore::Postgres(conns) => {
                let tasks: Vec<_> = (0..lanes)
                    .map(|lane| {
                        let (conns, keys) = (conns.clone(), self.keys.clone());
                        tokio::spawn(async move {
                            for round in 0..iters {
                                let value = round.to_string();
                                for i in (lane..n).step_by(lanes) {
                                    conns[lane].commit(&keys[i], value.as_bytes()).await;
                                }
                            }
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.expect("a raw PostgreSQL task");
                }
            }
        }
        start.elapsed()
    }

    /// One raw commit of `key`.
    async fn raw_commit(&self, key: &str, value: &[u8]) {
        match &self.raw {
            RawStore::Redb(db) => redb_commit(db, key, value),
            RawStore::Postgres(conns) => conns[0].commit(key, value).await,
        }
    }
}

/// Run `future` as a task on the runtime (as callers in a tokio program do)
/// and wait for it.
fn run<T: Send + 'static>(rt: &Runtime, future: impl Future<Output = T> + Send + 'static) -> T {
    rt.block_on(rt.spawn(future))
        .expect("benchmark task panicked")
}

fn configure(g: &mut BenchmarkGroup<'_, WallTime>, mode: Mode) {
    g.sample_size(10);
    g.sampling_mode(SamplingMode::Flat);
    g.warm_up_time(Duration::from_millis(mode.pick(1000, 300, 100)));
    // In `--quick` mode criterion doubles the iterations until the estimate
    // settles or this much time has gone.
    g.measurement_time(Duration::from_millis(mode.pick(4000, 1500, 1000)));
}

/// Commits per second, Fief beside raw, at every size.
fn bench_commits(c: &mut Criterion, rt: &Runtime, side: &Arc<Side>, mode: Mode) {
    let mut g = c.benchmark_group(format!("storage_commits_{}", side.name));
    configure(&mut g, mode);
    for n in SIZES {
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(format!("fief/{n}"), |b| {
            b.iter_custom(|iters| {
                let side = side.clone();
                run(rt, async move { side.fief_commits(n, iters).await })
            })
        });
        g.bench_function(format!("raw/{n}"), |b| {
            b.iter_custom(|iters| {
                let side = side.clone();
                run(rt, async move { side.raw_commits(n, iters).await })
            })
        });
    }
    g.finish();
}

/// A stored read beside a warm call that touches no storage.
fn bench_read(c: &mut Criterion, rt: &Runtime, side: &Arc<Side>, mode: Mode) {
    let mut g = c.benchmark_group("storage_read");
    g.warm_up_time(Duration::from_millis(mode.pick(1000, 300, 100)));
    g.measurement_time(Duration::from_millis(mode.pick(3000, 1000, 1000)));
    g.throughput(Throughput::Elements(1));
    let node = side.node.clone();
    run(rt, async move {
        for (module, message) in [(STORED, "incr"), (COUNTER, "incr"), (VAULT, "put n 12345")] {
            node.call(module, "reader", message.as_bytes().to_vec())
                .await
                .unwrap_or_else(|e| panic!("{module} {message}: {e}"));
        }
    });
    for (name, module, message) in READS {
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let node = side.node.clone();
                run(rt, async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let reply = node.call(module, "reader", message.to_vec()).await;
                        std::hint::black_box(reply.expect("a read"));
                    }
                    start.elapsed()
                })
            })
        });
    }
    g.finish();
}

/// Calls per batch of the interleaved read pairs.
const READ_BATCH: u32 = 200;

/// The read pairs measured interleaved: batches of the read and of its
/// baseline alternate on the same live key, so the machine's drift between
/// two criterion groups (on this VM, up to 30 %) falls on both alike. The
/// ratio is the median of the per-round ratios; the times are medians per
/// call.
fn read_ratios(
    rt: &Runtime,
    side: &Arc<Side>,
    rounds: usize,
) -> Vec<(String, Duration, Duration, f64)> {
    let pairs = [
        (
            "stored_counter_get / counter_get",
            (STORED, &b"get"[..]),
            (COUNTER, &b"get"[..]),
        ),
        (
            "vault_get / vault_token",
            (VAULT, &b"get n"[..]),
            (VAULT, &b"token"[..]),
        ),
        // A name that is not there: the same import, but no value to copy
        // into the guest (no call of its allocator).
        (
            "vault_get_absent / vault_token",
            (VAULT, &b"get absent"[..]),
            (VAULT, &b"token"[..]),
        ),
        // The `fief:key/storage` import itself, past the SDK's read cache:
        // what every first read of a name costs.
        (
            "vault_get_import / vault_token",
            (VAULT, &b"get-import n"[..]),
            (VAULT, &b"token"[..]),
        ),
    ];
    let node = side.node.clone();
    run(rt, async move {
        let batch = |module: &'static str, message: &'static [u8]| {
            let node = node.clone();
            async move {
                let start = Instant::now();
                for _ in 0..READ_BATCH {
                    let reply = node.call(module, "reader", message.to_vec()).await;
                    std::hint::black_box(reply.expect("a read"));
                }
                start.elapsed() / READ_BATCH
            }
        };
        let mut rows = Vec::new();
        for (name, (read_module, read), (base_module, base)) in pairs {
            let (mut reads, mut bases, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..rounds {
                let r = batch(read_module, read).await;
                let b = batch(base_module, base).await;
                ratios.push(r.as_secs_f64() / b.as_secs_f64());
                reads.push(r);
                bases.push(b);
            }
            ratios.sort_by(f64::total_cmp);
            rows.push((
                name.to_owned(),
                quantile(&mut reads, 0.5),
                quantile(&mut bases, 0.5),
                ratios[ratios.len() / 2],
            ));
        }
        rows
    })
}

fn print_read_ratios(rows: &[(String, Duration, Duration, f64)]) {
    if rows.is_empty() {
        return;
    }
    println!("\nstorage_read_interleaved: a stored read beside its baseline, batches alternating");
    println!("| pair | read | baseline | ratio (median of rounds) |");
    println!("|---|---|---|---|");
    for (name, read, base, ratio) in rows {
        println!(
            "| {name} | {} | {} | {ratio:.2}× |",
            fmt_duration(*read),
            fmt_duration(*base)
        );
    }
}

/// p50 and p99 of one commit at one key, Fief and raw.
struct Latency {
    backend: &'static str,
    samples: usize,
    fief: (Duration, Duration),
    raw: (Duration, Duration),
}

/// `samples` `incr` calls on one key, each followed by one raw commit.
fn commit_latency(rt: &Runtime, side: &Arc<Side>, samples: usize) -> Latency {
    let measured = side.clone();
    let (mut fief, mut raw) = run(rt, async move {
        let side = measured;
        let mut fief = Vec::with_capacity(samples);
        let mut raw = Vec::with_capacity(samples);
        side.node
            .call(STORED, "latency", b"incr".to_vec())
            .await
            .expect("activating the latency key");
        side.raw_commit("latency", b"0").await;
        for i in 0..samples {
            let start = Instant::now();
            side.node
                .call(STORED, "latency", b"incr".to_vec())
                .await
                .expect("incr");
            fief.push(start.elapsed());
            let value = i.to_string();
            let start = Instant::now();
            side.raw_commit("latency", value.as_bytes()).await;
            raw.push(start.elapsed());
        }
        (fief, raw)
    });
    Latency {
        backend: side.name,
        samples,
        fief: (quantile(&mut fief, 0.5), quantile(&mut fief, 0.99)),
        raw: (quantile(&mut raw, 0.5), quantile(&mut raw, 0.99)),
    }
}

fn print_latencies(rows: &[Latency]) {
    if rows.is_empty() {
        return;
    }
    println!("\nstorage_commit_latency: one `incr` at 1 key beside one raw commit");
    println!("| backend | samples | Fief p50 / p99 | raw p50 / p99 | ratio (p50) |");
    println!("|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} / {} | {} / {} | {:.2}× |",
            r.backend,
            r.samples,
            fmt_duration(r.fief.0),
            fmt_duration(r.fief.1),
            fmt_duration(r.raw.0),
            fmt_duration(r.raw.1),
            r.fief.0.as_secs_f64() / r.raw.0.as_secs_f64().max(1e-9),
        );
    }
}

/// The embedded side: a node on a fresh data directory and a raw redb file
/// beside it.
fn embedded_side(rt: &Runtime, dir: &Path) -> Arc<Side> {
    let raw = redb::Database::create(dir.join("raw.redb")).expect("opening the raw redb file");
    let config = node_config("embedded".to_owned(), Some(&dir.join("node")));
    let node = rt.block_on(start_node(config));
    Arc::new(Side {
        name: "embedded",
        node,
        raw: RawStore::Redb(Arc::new(raw)),
        keys: Arc::new(key_names()),
    })
}

fn key_names() -> Vec<String> {
    (0..SIZES[SIZES.len() - 1])
        .map(|i| format!("k{i}"))
        .collect()
}

async fn postgres_side(db: &Throwaway) -> Arc<Side> {
    let url = format!("{}/{}", db.server, db.database);
    let mut conns = Vec::new();
    for _ in 0..RAW_CONNECTIONS {
        let client = pg_connect(&url).await.expect("a raw connection");
        if conns.is_empty() {
            client
                .batch_execute("CREATE TABLE raw_counts (k text PRIMARY KEY, v bytea NOT NULL)")
                .await
                .expect("creating the raw table");
        }
        let upsert = client.prepare(RAW_UPSERT).await.expect("preparing");
        conns.push(RawPg { client, upsert });
    }
    let node = start_node(node_config(url, None)).await;
    Arc::new(Side {
        name: "postgres",
        node,
        raw: RawStore::Postgres(Arc::new(conns)),
        keys: Arc::new(key_names()),
    })
}

/// Shut `side`'s node down (its keys stop; the store closes with it).
async fn finish(side: Arc<Side>) {
    if let Some(node) = Arc::into_inner(side).and_then(|side| Arc::into_inner(side.node)) {
        node.shutdown().await;
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = Mode::from_args(&args);
    let wanted = common::sections(&args);
    let latency_wanted = wanted("storage_commit_latency");
    let samples = mode.pick(2000, 300, 5);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut criterion = Criterion::default().configure_from_args();
    let mut latencies = Vec::new();
    println!(
        "storage benches ({mode:?} mode; load average {})",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );

    // On the target directory's disk, not a tmpfs /tmp: fsync must be real.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("a temporary directory");
    let embedded = embedded_side(&rt, dir.path());
    run(&rt, {
        let side = embedded.clone();
        async move { side.activate().await }
    });
    bench_commits(&mut criterion, &rt, &embedded, mode);
    bench_read(&mut criterion, &rt, &embedded, mode);
    let read_rows = if wanted("storage_read_interleaved") {
        read_ratios(&rt, &embedded, mode.pick(200, 50, 5))
    } else {
        Vec::new()
    };
    if latency_wanted {
        latencies.push(commit_latency(&rt, &embedded, samples));
    }
    rt.block_on(finish(embedded));

    match rt.block_on(throwaway_database("storage")) {
        Err(why) => {
            println!("PostgreSQL: {why}; skipping storage_commits_postgres and its latency row")
        }
        Ok(db) => {
            let pg = rt.block_on(postgres_side(&db));
            run(&rt, {
                let side = pg.clone();
                async move { side.activate().await }
            });
            bench_commits(&mut criterion, &rt, &pg, mode);
            if latency_wanted {
                latencies.push(commit_latency(&rt, &pg, samples));
            }
            rt.block_on(async {
                finish(pg).await;
                drop_database(db).await;
            });
        }
    }

    print_latencies(&latencies);
    print_read_ratios(&read_rows);
    criterion.final_summary();
}
