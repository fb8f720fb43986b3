//! The sections of the scale bench that need a clean process (the module
//! header of `scale.rs` says what they measure): `fence`, `memory` and
//! `max_keys`, each run in a child process of this binary ([`in_child`],
//! [`child_main`]), which prints its rows for the parent to collect.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fief::config::ByteSize;
use fief::{Instance, ModuleOptions, NodeConfig};

use crate::common::{
    COUNTER_WASM, Raw, SPIN_WASM, embedded_node, fmt_duration, guest, map_count, max_map_count,
    mem_available, pss_bytes, rss_bytes, smaps, smaps_growth,
};
use crate::{Ends, Report, Row, runtime, spin_options};

/// Run `job` in a fresh child process of this binary and collect its rows.
pub(crate) fn in_child(report: &mut Report, job: &str) {
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

pub(crate) fn child_main(job: &str) {
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
