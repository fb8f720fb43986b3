//! The one-shot and large-scale figures of Fief, each beside its raw wasmtime
//! baseline where one exists, printed as a table (not criterion: these are
//! distributions and single events, not steady-state loops).
//!
//! - `kill`: kill → the spinning guest's store is dropped (p50/p99/max).
//! - `cross_node`: a call from node `n0` to a key `n1` owns, through the TCP
//!   transport: latency alone and under load (p50/p99, calls/s).
//! - `fence`: for 1k, 10k and 100k live keys (and one guest spinning), the
//!   time from the fence until no guest code can run, until every store is
//!   dropped, and until the memory is back with the OS.
//! - `memory`: RSS and memory mappings per idle live key.
//! - `max_keys`: the most live keys one node holds, and what stops it.
//! - `failover`: owner crash → first successful call on the survivor;
//!   `leave` → handoff complete.
//!
//! Measurements that need a clean process (memory, fence, max keys) run in
//! a child process of this binary. Run with
//! `cargo bench -p fief-benches --bench scale` (`-- --quick` for the smoke
//! run, `-- fence` for one section): fence and memory at 1k and 10k keys.
//! `FIEF_BENCH_FULL=1` adds 100k keys and the max-keys search, which need a
//! raised `vm.max_map_count`; `FIEF_SCALE_GUEST_THREADS=N` runs the nodes of
//! the memory, fence and max-keys children with N guest threads (default:
//! one per core). `FIEF_SCALE_LOG=FILE` makes those children log as `fief node`
//! does by default (`info`, text), into FILE. `docs/benchmarks.md` says how
//! each figure is measured.

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use fief::config::ByteSize;
use fief::{Instance, KeyLife, KeyLifeEvent, ModuleOptions, NodeConfig};

/// How much to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `cargo bench`: the full figures.
    Full,
    /// `cargo bench -- --quick`: the CI smoke run, small sizes.
    Quick,
    /// `cargo test --benches`: every routine once, tiny sizes.
    Test,
}

impl Mode {
    fn pick<T>(self, full: T, quick: T, test: T) -> T {
        match self {
            Mode::Full => full,
            Mode::Quick => quick,
            Mode::Test => test,
        }
    }
}

/// One row of the printed table.
struct Row {
    figure: String,
    fief: String,
    raw: String,
    ratio: String,
    target: String,
    met: String,
}

impl Row {
    fn new(figure: impl Into<String>, fief: impl Into<String>) -> Row {
        Row {
            figure: figure.into(),
            fief: fief.into(),
            raw: "—".into(),
            ratio: "—".into(),
            target: "—".into(),
            met: "—".into(),
        }
    }

    fn raw(mut self, raw: impl Into<String>, ratio: f64) -> Row {
        self.raw = raw.into();
        self.ratio = format!("{ratio:.2}×");
        self
    }

    fn target(mut self, target: impl Into<String>, met: bool) -> Row {
        self.target = target.into();
        self.met = if met { "yes".into() } else { "**no**".into() };
        self
    }

    /// The row as one line a parent process can parse.
    fn encode(&self) -> String {
        format!(
            "ROW\t{}\t{}\t{}\t{}\t{}\t{}",
            self.figure, self.fief, self.raw, self.ratio, self.target, self.met
        )
    }

    fn decode(line: &str) -> Option<Row> {
        let mut f = line.strip_prefix("ROW\t")?.split('\t').map(str::to_owned);
        Some(Row {
            figure: f.next()?,
            fief: f.next()?,
            raw: f.next()?,
            ratio: f.next()?,
            target: f.next()?,
            met: f.next()?,
        })
    }
}

/// Rows gathered so far; printed at the end.
#[derive(Default)]
struct Report {
    rows: Vec<Row>,
    /// A child process failed: the run exits with an error after the
    /// table, so the CI smoke run catches a broken figure.
    failed: bool,
}

impl Report {
    fn add(&mut self, row: Row) {
        println!(
            "  {} — Fief {} · raw {} · {} · target {} · met {}",
            row.figure, row.fief, row.raw, row.ratio, row.target, row.met
        );
        self.rows.push(row);
    }

    fn print(&self) {
        println!();
        println!("| figure | Fief | raw wasmtime | ratio | target | met? |");
        println!("|---|---|---|---|---|---|");
        for r in &self.rows {
            println!(
                "| {} | {} | {} | {} | {} | {} |",
                r.figure, r.fief, r.raw, r.ratio, r.target, r.met
            );
        }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

// ---------------------------------------------------------------------------
// Kill latency
// ---------------------------------------------------------------------------

/// Records when key processes end, from a node's life observer.
#[derive(Default)]
struct Ends {
    count: AtomicUsize,
    last: Mutex<Option<Instant>>,
    watched: Mutex<HashMap<String, Instant>>,
    /// Wakes `wait_for` (which must not spin: a spinning waiter takes a CPU
    /// from the very key process being measured).
    ended: tokio::sync::Notify,
}

impl Ends {
    fn observer(self: &Arc<Self>, watch_prefix: &'static str) -> fief::KeyLifeObserver {
        let ends = self.clone();
        Arc::new(move |life: KeyLife| {
            if life.event != KeyLifeEvent::Ended {
                return;
            }
            ends.count.fetch_add(1, Ordering::SeqCst);
            let mut last = ends.last.lock().unwrap();
            if last.is_none_or(|l| l < life.at) {
                *last = Some(life.at);
            }
            drop(last);
            if life.key.starts_with(watch_prefix) {
                ends.watched.lock().unwrap().insert(life.key, life.at);
                ends.ended.notify_waiters();
            }
        })
    }

    async fn wait_for(&self, key: &str, limit: Duration) -> Instant {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if let Some(at) = self.watched.lock().unwrap().get(key) {
                return *at;
            }
            tokio::time::timeout_at(deadline, ended)
                .await
                .unwrap_or_else(|_| panic!("{key} did not end within {limit:?}"));
        }
    }
}

/// Options for the spin guest: a CPU limit far beyond any measurement, so
/// only the kill stops it.
fn spin_options() -> ModuleOptions {
    ModuleOptions {
        cpu_limit: Duration::from_secs(600),
        ..ModuleOptions::default()
    }
}

/// Start `spin` on `key` through `node` and give it time to be spinning.
/// The returned task ends when the spinning call returns (with the kill),
/// with the time it did.
async fn start_spinning(node: &Arc<Instance>, key: &str) -> tokio::task::JoinHandle<Instant> {
    let (node, key) = (node.clone(), key.to_owned());
    let call = tokio::spawn(async move {
        let reply = node.call("spin", &key, b"spin".to_vec()).await;
        assert!(reply.is_err(), "a spinning call returned");
        Instant::now()
    });
    // Activation takes tens of µs; 3 ms is several epoch ticks of spinning.
    tokio::time::sleep(Duration::from_millis(3)).await;
    call
}

fn kill(report: &mut Report, mode: Mode) {
    let samples = mode.pick(1000, 200, 5);
    let rt = runtime();
    let ends = Arc::new(Ends::default());
    let mut config = NodeConfig {
        max_live_keys: 256,
        // The spinning keys' CPU limit (spin_options) is over the default
        // ceiling on purpose: only the kill stops them.
        module_ceilings: fief::ModuleCeilings {
            cpu_limit: Duration::from_secs(600),
            ..fief::ModuleCeilings::default()
        },
        ..NodeConfig::default()
    };
    if let Some(ms) = std::env::var("FIEF_SCALE_EPOCH_TICK_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        config.epoch_tick = Duration::from_millis(ms);
        config.kill_bound = config.epoch_tick * 2;
    }
    let spin = guest(SPIN_WASM);
    let node = Arc::new(rt.block_on(async {
        let node = Instance::builder(config.clone())
            .observer(ends.observer("k"))
            .module("spin", spin.clone(), spin_options())
            .start()
            .await
            .expect("starting the node");
        node.call("spin", "warm-up", b"ping".to_vec())
            .await
            .expect("the node serves");
        node
    }));
    // Raw: the same guest spinning in a task; the killer sets the store's
    // kill flag and bumps the epoch; until the call returned and the store
    // is dropped. Sample i of Fief and of raw run back to back, so a burst
    // of load on the machine lands on both sides alike.
    let raw = Arc::new(Raw::new(&config, &spin));
    // Diagnostic: give the baseline Fief's 1 ms epoch ticker too.
    let ticking = Arc::new(AtomicBool::new(
        std::env::var_os("FIEF_SCALE_RAW_TICKER").is_some(),
    ));
    let ticker = {
        let (engine, ticking) = (raw.engine().clone(), ticking.clone());
        std::thread::spawn(move || {
            while ticking.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(1));
                engine.increment_epoch();
            }
        })
    };
    let mut fief = Vec::new();
    let mut fief_answered = Vec::new();
    let mut raw_samples = Vec::new();
    for i in 0..samples {
        let key = format!("k{i}");
        let latency = rt.block_on(rt.spawn({
            let (node, ends) = (node.clone(), ends.clone());
            async move {
                let call = start_spinning(&node, &key).await;
                let t0 = Instant::now();
                assert!(node.kill_key("spin", &key), "{key} was not live");
                let ended = ends.wait_for(&key, Duration::from_secs(10)).await;
                let answered = call.await.expect("the spinning call");
                (
                    ended.saturating_duration_since(t0),
                    answered.saturating_duration_since(t0),
                )
            }
        }));
        let (ended, answered) = latency.expect("kill sample");
        fief.push(ended);
        fief_answered.push(answered);
        let latency = rt.block_on(rt.spawn({
            let raw = raw.clone();
            async move {
                let flag = Arc::new(AtomicBool::new(false));
                let mut key = raw.start_killable("k", Some(flag.clone())).await;
                let (tx, rx) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let result = key.try_call(b"spin").await;
                    assert!(result.is_err(), "a spinning call returned");
                    drop(key);
                    let _ = tx.send(Instant::now());
                });
                tokio::time::sleep(Duration::from_millis(3)).await;
                let t0 = Instant::now();
                flag.store(true, Ordering::SeqCst);
                raw.engine().increment_epoch();
                rx.await
                    .expect("the spinning task")
                    .saturating_duration_since(t0)
            }
        }));
        raw_samples.push(latency.expect("raw kill sample"));
    }
    ticking.store(false, Ordering::Relaxed);
    let _ = ticker.join();
    let (f50, f99, fmax) = (
        quantile(&mut fief, 0.5),
        quantile(&mut fief, 0.99),
        quantile(&mut fief, 1.0),
    );
    let (r50, r99, rmax) = (
        quantile(&mut raw_samples, 0.5),
        quantile(&mut raw_samples, 0.99),
        quantile(&mut raw_samples, 1.0),
    );
    report.add(
        Row::new(
            format!("kill → spinning guest's store dropped, p50 ({samples} kills)"),
            fmt_duration(f50),
        )
        .raw(fmt_duration(r50), us(f50) / us(r50)),
    );
    report.add(
        Row::new("kill → store dropped, p99", fmt_duration(f99))
            .raw(fmt_duration(r99), us(f99) / us(r99))
            .target("p99 ≤ 100 µs", f99 <= Duration::from_micros(100)),
    );
    report.add(
        Row::new("kill → store dropped, max", fmt_duration(fmax))
            .raw(fmt_duration(rmax), us(fmax) / us(rmax)),
    );
    report.add(Row::new(
        "kill → the spinning call's caller gets its error, p50 / p99",
        format!(
            "{} / {}",
            fmt_duration(quantile(&mut fief_answered, 0.5)),
            fmt_duration(quantile(&mut fief_answered, 0.99))
        ),
    ));
    let Ok(node) = Arc::try_unwrap(node) else {
        return;
    };
    rt.block_on(node.shutdown());
}

// ---------------------------------------------------------------------------
// Cross-node calls
// ---------------------------------------------------------------------------

/// Node `n<i>` of a two-node bench cluster.
fn cluster_config(i: usize) -> NodeConfig {
    NodeConfig {
        node_id: format!("n{i}"),
        partitions: 64,
        max_live_keys: 1024,
        ..NodeConfig::default()
    }
}

/// Concurrent callers in the loaded cross-node figure.
const CROSS_CALLERS: usize = 32;

fn cross_node(report: &mut Report, mode: Mode) {
    let calls = mode.pick(20_000u64, 4_000, 200);
    let loaded_calls = mode.pick(200_000u64, 40_000, 500);
    let rt = runtime();
    let counter = guest(COUNTER_WASM);
    let modules = [("counter", counter.as_slice(), ModuleOptions::default())];
    let cluster = Arc::new(rt.block_on(Cluster::start(2, cluster_config, &modules)));
    let keys = Arc::new(rt.block_on(keys_owned_by(
        cluster.node(0),
        cluster.node(1),
        "counter",
        "remote",
        64,
    )));
    let raw = Raw::new(&cluster_config(0), &counter);
    let raw_keys = rt.block_on(raw_keys(&raw, &keys));
    let raw_addr = rt.block_on(serve_raw_tcp(raw_keys));

    let fief_run = |callers: usize, total: u64| {
        let (cluster, keys) = (cluster.clone(), keys.clone());
        rt.block_on(rt.spawn(async move {
            drive(callers, total, move |i, n| {
                let (cluster, keys) = (cluster.clone(), keys.clone());
                async move {
                    let key = &keys[(i + n as usize * callers) % keys.len()];
                    let reply = cluster.node(0).call("counter", key, b"incr".to_vec()).await;
                    std::hint::black_box(reply.expect("cross-node call"));
                }
            })
            .await
        }))
        .expect("cross-node run")
    };
    let raw_run = |callers: usize, total: u64| {
        let keys = keys.clone();
        rt.block_on(rt.spawn(async move {
            let mut conns = Vec::new();
            for _ in 0..callers {
                conns.push(Arc::new(tokio::sync::Mutex::new(
                    RawTcpConn::open(raw_addr).await,
                )));
            }
            let conns = Arc::new(conns);
            drive(callers, total, move |i, n| {
                let (conns, keys) = (conns.clone(), keys.clone());
                async move {
                    let key = &keys[(i + n as usize * callers) % keys.len()];
                    let reply = conns[i].lock().await.call(key, b"incr").await;
                    std::hint::black_box(reply);
                }
            })
            .await
        }))
        .expect("raw TCP run")
    };

    // Warm up both paths (connections, caches).
    fief_run(4, 2000.min(calls));
    raw_run(4, 2000.min(calls));

    let (_, mut f1) = fief_run(1, calls);
    let (_, mut r1) = raw_run(1, calls);
    let (f50, r50) = (quantile(&mut f1, 0.5), quantile(&mut r1, 0.5));
    let (f99, r99) = (quantile(&mut f1, 0.99), quantile(&mut r1, 0.99));
    report.add(
        Row::new("cross-node call, one caller, p50", fmt_duration(f50))
            .raw(fmt_duration(r50) + " (raw TCP hop)", us(f50) / us(r50))
            .target("p50 ≤ 100 µs", f50 <= Duration::from_micros(100)),
    );
    report.add(
        Row::new("cross-node call, one caller, p99", fmt_duration(f99))
            .raw(fmt_duration(r99), us(f99) / us(r99)),
    );
    let (fe, mut fl) = fief_run(CROSS_CALLERS, loaded_calls);
    let (re, mut rl) = raw_run(CROSS_CALLERS, loaded_calls);
    let (frate, rrate) = (
        loaded_calls as f64 / fe.as_secs_f64(),
        loaded_calls as f64 / re.as_secs_f64(),
    );
    report.add(
        Row::new(
            format!("cross-node throughput, {CROSS_CALLERS} callers"),
            format!("{:.0} k calls/s", frate / 1e3),
        )
        .raw(format!("{:.0} k calls/s", rrate / 1e3), rrate / frate)
        .target("≥ 100 k calls/s", frate >= 100e3),
    );
    let (fl50, rl50) = (quantile(&mut fl, 0.5), quantile(&mut rl, 0.5));
    let (fl99, rl99) = (quantile(&mut fl, 0.99), quantile(&mut rl, 0.99));
    report.add(
        Row::new(
            "cross-node call under that load, p50 / p99",
            format!("{} / {}", fmt_duration(fl50), fmt_duration(fl99)),
        )
        .raw(
            format!("{} / {}", fmt_duration(rl50), fmt_duration(rl99)),
            us(fl50) / us(rl50),
        )
        .target("p50 ≤ 100 µs", fl50 <= Duration::from_micros(100)),
    );
    let Ok(cluster) = Arc::try_unwrap(cluster) else {
        return;
    };
    rt.block_on(async move {
        for node in cluster.nodes.into_iter().flatten() {
            node.shutdown().await;
        }
    });
}

// ---------------------------------------------------------------------------
// Fence, memory, max keys: child processes
// ---------------------------------------------------------------------------

/// Run `job` in a fresh child process of this binary and collect its rows.
fn in_child(report: &mut Report, job: &str) {
    let exe = std::env::current_exe().expect("this binary's path");
    let output = Command::new(exe)
        .env("FIEF_SCALE_CHILD", job)
        .output()
        .expect("running a child");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut rows = 0;
    for line in stdout.lines() {
        if let Some(row) = Row::decode(line) {
            report.add(row);
            rows += 1;
        } else if let Some(info) = line.strip_prefix("INFO\t") {
            println!("  ({job}) {info}");
        }
    }
    if !output.status.success() || rows == 0 {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        let why = tail.into_iter().rev().collect::<Vec<_>>().join(" / ");
        report.failed = true;
        report.add(Row::new(
            format!("{job}: the child failed ({})", output.status),
            why.replace('\t', " "),
        ));
    }
}

fn child_main(job: &str) {
    if let Some(path) = std::env::var_os("FIEF_SCALE_LOG") {
        // The node's own default logging (`fief node`: `info`, text), so
        // that a figure includes what its log lines cost in production.
        let file = std::fs::File::create(&path)
            .unwrap_or_else(|e| panic!("creating the log file {}: {e}", path.display()));
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_writer(std::sync::Mutex::new(file))
            .with_ansi(false)
            .init();
    }
    let mut words = job.split_whitespace();
    let what = words.next().unwrap_or_default();
    let n: usize = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
    let rows = match what {
        "fence" => fence_child(n),
        "memory" => memory_child(n),
        "memory-raw" => memory_raw_child(n),
        "max-keys" => max_keys_child(n),
        "warm-fief" => warm_child(n, false),
        "warm-raw" => warm_child(n, true),
        other => panic!("unknown child job {other:?}"),
    };
    for row in rows {
        println!("{}", row.encode());
    }
}

/// Largest wasm memory a key of the scale children may have. It sizes the
/// reservation per memory slot (64 MiB: the node refuses less than the default
/// module `memory_limit`); the counter needs about 1.1 MiB.
const SCALE_MEMORY: ByteSize = ByteSize::mib(64);

/// A node for `keys` live keys, for the scale children.
fn scale_config(keys: usize) -> NodeConfig {
    NodeConfig {
        max_live_keys: u32::try_from(keys).expect("key count") + 64,
        max_memory_per_key: SCALE_MEMORY,
        guest_threads: std::env::var("FIEF_SCALE_GUEST_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
        // spin_options asks for more CPU than the default ceiling.
        module_ceilings: fief::ModuleCeilings {
            cpu_limit: Duration::from_secs(600),
            ..fief::ModuleCeilings::default()
        },
        ..NodeConfig::default()
    }
}

fn scale_counter_options(keys: usize) -> ModuleOptions {
    ModuleOptions {
        max_live_keys: u32::try_from(keys).expect("key count") + 64,
        memory_limit: SCALE_MEMORY,
        ..ModuleOptions::default()
    }
}

/// Activate `keys` keys of `counter` named `<prefix>-<i>` from `tasks`
/// tasks; returns the first error, if any, and how many succeeded.
async fn activate(
    node: &Arc<Instance>,
    prefix: &str,
    range: std::ops::Range<usize>,
    tasks: usize,
) -> (usize, Option<String>) {
    let ok = Arc::new(AtomicUsize::new(0));
    let error: Arc<Mutex<Option<String>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = (0..tasks)
        .map(|t| {
            let (node, ok, error, stop) = (node.clone(), ok.clone(), error.clone(), stop.clone());
            let prefix = prefix.to_owned();
            let range = range.clone();
            tokio::spawn(async move {
                for i in range.skip(t).step_by(tasks) {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    match node
                        .call("counter", &format!("{prefix}-{i}"), b"get".to_vec())
                        .await
                    {
                        Ok(_) => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            stop.store(true, Ordering::Relaxed);
                            error.lock().unwrap().get_or_insert(e.to_string());
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.await.expect("activation task");
    }
    let e = error.lock().unwrap().clone();
    (ok.load(Ordering::Relaxed), e)
}

fn fence_child(n: usize) -> Vec<Row> {
    let rt = runtime();
    let ends = Arc::new(Ends::default());
    let node = Arc::new(rt.block_on(async {
        Instance::builder(scale_config(n))
            .observer(ends.observer("spinner"))
            .module("counter", guest(COUNTER_WASM), scale_counter_options(n))
            .module("spin", guest(SPIN_WASM), spin_options())
            .start()
            .await
            .expect("starting the node")
    }));
    let (rss_empty, smaps_empty) = (rss_bytes(), smaps());
    let (live, error) = rt.block_on(activate(&node, "key", 0..n, 16));
    assert_eq!(live, n, "activating {n} keys: {error:?}");
    // One guest spinning when the fence comes. Its key task lives on a
    // runtime of its own (a key task runs where its first message was
    // delivered), so when it stops is not hidden behind the node's workers
    // tearing down the other keys: its end marks when the guest code that
    // was running at the fence stopped.
    let spinner = std::thread::spawn({
        let node = node.clone();
        move || {
            let own = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the spinner's runtime");
            own.block_on(async move {
                let reply = node.call("spin", "spinner", b"spin".to_vec()).await;
                assert!(reply.is_err(), "a spinning call returned");
            });
        }
    });
    std::thread::sleep(Duration::from_millis(200));
    let ends_before = ends.count.load(Ordering::SeqCst);
    let rss_full = rss_bytes();
    let rss_target = rss_empty + (rss_full.saturating_sub(rss_empty)) / 10;

    let (t0, t1) = rt
        .block_on(rt.spawn({
            let node = node.clone();
            async move {
                let t0 = Instant::now();
                node.fence_now();
                (t0, Instant::now())
            }
        }))
        .expect("fencing");
    let stopped = rt.block_on(ends.wait_for("spinner", Duration::from_secs(60)));
    let deadline = Instant::now() + Duration::from_secs(120);
    while ends.count.load(Ordering::SeqCst) < ends_before + n + 1 {
        assert!(Instant::now() < deadline, "the keys did not all end");
        std::thread::sleep(Duration::from_micros(200));
    }
    let dropped = ends.last.lock().unwrap().expect("an end");
    // Memory back with the OS. Not all of it comes back: the pool keeps
    // some pages of each memory slot and each fiber stack resident, and
    // the allocator's arenas keep freed heap (the INFO line says which).
    let mut reclaimed = None;
    let give_up = Instant::now() + Duration::from_secs(2);
    while Instant::now() < give_up {
        if rss_bytes() <= rss_target {
            reclaimed = Some(Instant::now());
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let rss_after = rss_bytes();
    println!(
        "INFO\tstill resident after the fence: {}",
        smaps_growth(&smaps_empty, &smaps())
    );
    spinner.join().expect("the spinner's thread");
    let flagged = t1 - t0;
    // Past the fence point no guest code starts (routing, the key loop and
    // the side-effect gate read the fenced lease) and running code stops at
    // its next epoch check: the spinner's end is when that happened.
    let nothing_runs = stopped.saturating_duration_since(t0);
    let label = if n >= 1000 {
        format!("{}k", n / 1000)
    } else {
        n.to_string()
    };
    let mut rows = vec![
        Row::new(
            format!(
                "fence, {label} live keys: every key flagged and the epoch bumped (`fence_now` returns)"
            ),
            fmt_duration(flagged),
        ),
        Row::new(
            format!(
                "fence, {label} keys: until no guest code can run (the spinning guest stopped)"
            ),
            fmt_duration(nothing_runs),
        )
        .target(
            if n >= 100_000 {
                "≤ 10 ms (100k keys)"
            } else {
                "—"
            },
            n < 100_000 || nothing_runs <= Duration::from_millis(10),
        ),
        Row::new(
            format!("fence, {label} keys: until every store is dropped"),
            fmt_duration(dropped.saturating_duration_since(t0)),
        ),
    ];
    rows.push(Row::new(
        format!(
            "fence, {label} keys: until RSS is back to within 10% of its level before the keys ({} MiB used by them)",
            (rss_full.saturating_sub(rss_empty)) >> 20
        ),
        reclaimed.map_or_else(
            || {
                let used = rss_full.saturating_sub(rss_empty).max(1);
                let back = rss_full.saturating_sub(rss_after);
                format!(
                    "{}% back after 2 s (the child prints what is still resident)",
                    back * 100 / used
                )
            },
            |r| fmt_duration(r.saturating_duration_since(t0)),
        ),
    ));
    if n < 100_000 {
        rows[1].target = "—".into();
        rows[1].met = "—".into();
    }
    rows
}

fn memory_child(n: usize) -> Vec<Row> {
    let rt = runtime();
    let node = Arc::new(rt.block_on(embedded_node(
        scale_config(n),
        &[("counter", &guest(COUNTER_WASM), scale_counter_options(n))],
    )));
    rt.block_on(activate(&node, "warm", 0..16, 1));
    std::thread::sleep(Duration::from_millis(200));
    let (rss0, pss0, maps0, smaps0) = (rss_bytes(), pss_bytes(), map_count(), smaps());
    let (live, error) = rt.block_on(activate(&node, "key", 0..n, 16));
    assert_eq!(live, n, "activating {n} keys: {error:?}");
    std::thread::sleep(Duration::from_millis(500));
    let (rss1, pss1, maps1) = (rss_bytes(), pss_bytes(), map_count());
    println!("INFO\twhere it went: {}", smaps_growth(&smaps0, &smaps()));
    if std::env::var_os("FIEF_SCALE_PAUSE").is_some() {
        std::thread::sleep(Duration::from_secs(30));
    }
    let per_key = rss1.saturating_sub(rss0) as f64 / n as f64;
    let maps_per_key = maps1.saturating_sub(maps0) as f64 / n as f64;
    println!(
        "INFO\tRSS {} → {} MiB, maps {maps0} → {maps1}",
        rss0 >> 20,
        rss1 >> 20
    );
    let pss_per_key = pss1.saturating_sub(pss0) as f64 / n as f64;
    vec![
        Row::new(
            format!("memory per idle live key (RSS delta / {n} keys)"),
            format!("{:.1} KiB", per_key / 1024.0),
        )
        .target("≤ 32 KiB", per_key <= 32.0 * 1024.0),
        Row::new(
            "memory per idle live key, shared data pages counted once (PSS delta / keys)",
            format!("{:.1} KiB", pss_per_key / 1024.0),
        ),
        Row::new("memory mappings per live key", format!("{maps_per_key:.2}")),
    ]
}

fn memory_raw_child(n: usize) -> Vec<Row> {
    let rt = runtime();
    let raw = Raw::new(&scale_config(n), &guest(COUNTER_WASM));
    let mut warm = rt.block_on(raw.start("warm"));
    rt.block_on(warm.call(b"get"));
    let (rss0, pss0, maps0, smaps0) = (rss_bytes(), pss_bytes(), map_count(), smaps());
    let keys = rt.block_on(async {
        let mut keys = Vec::with_capacity(n);
        for i in 0..n {
            let mut key = raw.start(&format!("key-{i}")).await;
            key.call(b"get").await;
            keys.push(key);
        }
        keys
    });
    std::thread::sleep(Duration::from_millis(500));
    let (rss1, pss1, maps1) = (rss_bytes(), pss_bytes(), map_count());
    println!(
        "INFO\traw: where it went: {}",
        smaps_growth(&smaps0, &smaps())
    );
    drop(keys);
    vec![
        Row::new(
            "raw: memory per idle live instance (RSS / PSS delta)",
            format!(
                "{:.1} KiB / {:.1} KiB",
                rss1.saturating_sub(rss0) as f64 / n as f64 / 1024.0,
                pss1.saturating_sub(pss0) as f64 / n as f64 / 1024.0
            ),
        ),
        Row::new(
            "raw: memory mappings per live instance",
            format!("{:.2}", maps1.saturating_sub(maps0) as f64 / n as f64),
        ),
    ]
}

/// `n` warm calls in a row, Fief's or raw wasmtime's, for profiling under
/// `valgrind --tool=callgrind` (compare two values of `n`: the difference
/// divided by the difference in calls is the cost of one call).
fn warm_child(n: usize, raw: bool) -> Vec<Row> {
    let rt = runtime();
    let wasm = guest(COUNTER_WASM);
    let config = NodeConfig {
        max_live_keys: 64,
        ..NodeConfig::default()
    };
    let elapsed = if raw {
        let raw = Arc::new(Raw::new(&config, &wasm));
        rt.block_on(rt.spawn(async move {
            let mut key = raw.start("alice").await;
            let start = Instant::now();
            for _ in 0..n {
                std::hint::black_box(key.call(b"incr").await);
            }
            start.elapsed()
        }))
    } else {
        let node = Arc::new(rt.block_on(embedded_node(
            config,
            &[("counter", &wasm, ModuleOptions::default())],
        )));
        rt.block_on(rt.spawn(async move {
            node.call("counter", "alice", b"get".to_vec())
                .await
                .expect("activating");
            let start = Instant::now();
            for _ in 0..n {
                let reply = node.call("counter", "alice", b"incr".to_vec()).await;
                std::hint::black_box(reply.expect("warm call"));
            }
            start.elapsed()
        }))
    }
    .expect("the calling task");
    vec![Row::new(
        format!("{} warm calls ({})", n, if raw { "raw" } else { "Fief" }),
        fmt_duration(elapsed / n.max(1) as u32),
    )]
}

fn max_keys_child(target: usize) -> Vec<Row> {
    let rt = runtime();
    // The machine is shared: take at most 8 GiB (or what the environment
    // variable says) and always leave 4 GiB available.
    let cap = std::env::var("FIEF_SCALE_MAX_KEYS_GIB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(8)
        << 30;
    let budget = mem_available().saturating_sub(4 << 30).min(cap);
    let start = rt.block_on(async {
        let node = Instance::start_embedded(scale_config(target)).await?;
        node.deploy(
            "counter",
            &guest(COUNTER_WASM),
            scale_counter_options(target),
        )
        .await?;
        Ok::<_, fief::Error>(node)
    });
    let node = match start {
        Ok(node) => Arc::new(node),
        Err(e) => {
            return vec![
                Row::new(
                    format!("most live keys on one node (max_live_keys = {target})"),
                    format!("the node does not start: {e}"),
                )
                .target("≥ 1,000,000", false),
            ];
        }
    };
    let rss0 = rss_bytes();
    let batch = 10_000;
    let mut live = 0;
    let mut stop = String::new();
    while live < target {
        let (ok, error) = rt.block_on(activate(&node, "key", live..(live + batch).min(target), 16));
        live += ok;
        if let Some(e) = error {
            stop = format!("activation failed: {e}");
            break;
        }
        let used = rss_bytes().saturating_sub(rss0);
        if used > budget {
            stop = format!(
                "stopped by the bench at its memory budget of {} MiB",
                budget >> 20
            );
            break;
        }
    }
    if stop.is_empty() {
        stop = "all activated".to_owned();
    }
    let used = rss_bytes().saturating_sub(rss0);
    println!(
        "INFO\t{live} keys live, RSS +{} MiB, {} mappings (vm.max_map_count {})",
        used >> 20,
        map_count(),
        max_map_count()
    );
    let per_key = used as f64 / live.max(1) as f64;
    let total_ram = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024);
    vec![
        Row::new(
            format!("most live keys on one node (max_live_keys = {target})"),
            format!(
                "{live} ({stop}); all of this machine's {} GiB would hold about {:.0}k",
                total_ram >> 30,
                total_ram as f64 / per_key / 1e3
            ),
        )
        .target("≥ 1,000,000", live >= 1_000_000),
        Row::new(
            format!("memory per idle live key at {live} keys"),
            format!("{:.1} KiB", used as f64 / live.max(1) as f64 / 1024.0),
        )
        .target("≤ 32 KiB", per_key <= 32.0 * 1024.0),
    ]
}

// ---------------------------------------------------------------------------
// Failover
// ---------------------------------------------------------------------------

/// Lease timing of the failover clusters: the defaults (TTL 5 s, renewal
/// every 1 s, fence margin 1 s) in a full run; a short valid timing (TTL
/// 2 s, 400 ms, 500 ms) otherwise.
fn failover_config(mode: Mode) -> impl Fn(usize) -> NodeConfig {
    move |i| {
        let mut config = cluster_config(i);
        config.call_timeout = Duration::from_secs(2);
        if mode != Mode::Full {
            config.lease_ttl = Duration::from_secs(2);
            config.renew_interval = Duration::from_millis(400);
            config.fence_margin = Duration::from_millis(500);
        }
        config
    }
}

fn failover(report: &mut Report, mode: Mode) {
    let samples = mode.pick(3, 1, 1);
    let rt = runtime();
    let counter = guest(COUNTER_WASM);
    let ttl = failover_config(mode)(0).lease_ttl;
    let mut crash = Vec::new();
    let mut leave = Vec::new();
    let mut leave_call = Vec::new();
    for _ in 0..samples {
        // Crash: n1 owns the key and dies; n0 (the leader) takes over.
        let (took, left, first) = rt
            .block_on(rt.spawn({
                let counter = counter.clone();
                async move {
                    let modules = [("counter", counter.as_slice(), ModuleOptions::default())];
                    let mut cluster = Cluster::start(2, failover_config(mode), &modules).await;
                    let key = keys_owned_by(cluster.node(0), cluster.node(1), "counter", "f", 1)
                        .await
                        .remove(0);
                    let n1 = cluster.nodes[1].take().expect("n1");
                    let t0 = Instant::now();
                    // A crashed process takes its sockets with it; an
                    // in-process `crash` leaves n0's open connection to it
                    // served, so cut that link as the dead process would.
                    assert!(cluster.node(0).set_peer_link("n1", false).await);
                    n1.crash().await;
                    loop {
                        if cluster
                            .node(0)
                            .call("counter", &key, b"get".to_vec())
                            .await
                            .is_ok()
                        {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    let took = t0.elapsed();
                    for node in cluster.nodes.into_iter().flatten() {
                        node.shutdown().await;
                    }

                    // Leave: n1 owns the key (value 5) and leaves; the handoff is
                    // complete when `leave` returns; the first call on n0 then
                    // sees the value.
                    let mut cluster = Cluster::start(2, failover_config(mode), &modules).await;
                    let key = keys_owned_by(cluster.node(0), cluster.node(1), "counter", "l", 1)
                        .await
                        .remove(0);
                    for _ in 0..5 {
                        cluster
                            .node(0)
                            .call("counter", &key, b"incr".to_vec())
                            .await
                            .expect("incr");
                    }
                    let t0 = Instant::now();
                    cluster
                        .node(1)
                        .leave(Duration::from_secs(60))
                        .await
                        .expect("leaving");
                    let left = t0.elapsed();
                    let reply = cluster
                        .node(0)
                        .call("counter", &key, b"get".to_vec())
                        .await
                        .expect("the call after the handoff");
                    assert_eq!(reply, b"5", "the handoff carried the value");
                    let first = t0.elapsed();
                    let n1 = cluster.nodes[1].take().expect("n1");
                    n1.shutdown().await;
                    for node in cluster.nodes.into_iter().flatten() {
                        node.shutdown().await;
                    }
                    (took, left, first)
                }
            }))
            .expect("failover sample");
        crash.push(took);
        leave.push(left);
        leave_call.push(first);
    }
    let worst = *crash.iter().max().expect("a sample");
    report.add(
        Row::new(
            format!(
                "failover: owner crash → first successful call on the survivor (TTL {}, worst of {samples})",
                fmt_duration(ttl)
            ),
            fmt_duration(worst),
        )
        .target(
            format!("≤ TTL + 1 s = {}", fmt_duration(ttl + Duration::from_secs(1))),
            worst <= ttl + Duration::from_secs(1),
        ),
    );
    report.add(Row::new(
        format!("leave → handoff complete (`leave` returns), worst of {samples}"),
        fmt_duration(*leave.iter().max().expect("a sample")),
    ));
    report.add(Row::new(
        "leave → first call on the new owner answered with the handed-off state",
        fmt_duration(*leave_call.iter().max().expect("a sample")),
    ));
}

// ---------------------------------------------------------------------------

/// The kernel's mapping limit against what 100k and 1M keys need (six
/// mappings per key, `host/src/runtime.rs`).
fn map_count_note() -> String {
    let limit = max_map_count();
    let fits = |keys: u64| {
        if keys * 6 + 8192 <= limit {
            "fits"
        } else {
            "refused"
        }
    };
    format!(
        "vm.max_map_count = {limit}: 100k keys {}, 1M keys {} (raise it with \
         `sysctl -w vm.max_map_count=6100000`)",
        fits(100_064),
        fits(1_000_064)
    )
}

fn main() {
    if let Ok(job) = std::env::var("FIEF_SCALE_CHILD") {
        child_main(&job);
        return;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = if !args.iter().any(|a| a == "--bench") {
        Mode::Test
    } else if args.iter().any(|a| a == "--quick") {
        Mode::Quick
    } else {
        Mode::Full
    };
    let wanted = common::sections(&args);
    let sections = [
        "kill",
        "cross_node",
        "fence",
        "memory",
        "max_keys",
        "failover",
    ];
    if !sections.iter().any(|s| wanted(s)) {
        return;
    }
    println!(
        "scale figures ({mode:?} mode; load average {})",
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    let mut report = Report::default();
    let started = Instant::now();
    if wanted("kill") {
        kill(&mut report, mode);
    }
    if wanted("cross_node") {
        cross_node(&mut report, mode);
    }
    // 100 000 and 1 000 000 live keys need a raised vm.max_map_count (a
    // node refuses more keys than the kernel can map, about 10 000 by
    // default) and minutes: only with FIEF_BENCH_FULL=1, never in the smoke.
    let huge = mode != Mode::Test && std::env::var_os("FIEF_BENCH_FULL").is_some();
    if huge {
        println!(
            "FIEF_BENCH_FULL is set: 100k-key fence and memory, max keys; {}",
            map_count_note()
        );
    }
    if wanted("fence") {
        let mut sizes = mode.pick(vec![1_000, 10_000], vec![1_000, 10_000], vec![1_000]);
        if huge {
            sizes.push(100_000);
        }
        for n in sizes {
            in_child(&mut report, &format!("fence {n}"));
        }
    }
    if wanted("memory") {
        let n = if huge {
            100_000
        } else {
            mode.pick(10_000, 10_000, 1_000)
        };
        in_child(&mut report, &format!("memory {n}"));
        in_child(&mut report, &format!("memory-raw {n}"));
    }
    if wanted("max_keys") && huge {
        in_child(&mut report, "max-keys 1000000");
    }
    if wanted("failover") {
        failover(&mut report, mode);
    }
    report.print();
    println!("\n(measured in {:.1} s)", started.elapsed().as_secs_f64());
    if report.failed {
        eprintln!("a figure's child process failed (see its row above)");
        std::process::exit(1);
    }
}
