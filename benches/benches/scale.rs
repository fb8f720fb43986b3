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
//!
//! This file holds the table, what the sections share and `main`; the
//! sections are in `scale/`: `kill.rs`, `clusters.rs` (`cross_node`,
//! `failover`) and `children.rs` (`fence`, `memory`, `max_keys`).

#[path = "scale/children.rs"]
mod children;
#[path = "scale/clusters.rs"]
mod clusters;
mod common;
#[path = "scale/kill.rs"]
mod kill;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use children::{child_main, in_child};
use clusters::{cross_node, failover};
use common::*;
use fief::{KeyLife, KeyLifeEvent, ModuleOptions};
use kill::kill;

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
// Key ends and the spin guest (the kill and fence sections)
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
