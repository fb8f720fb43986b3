//! Other keys' call latency while hostile keys attack the node, beside the
//! same latency without an attack (issue 5 item 6).
//!
//! One embedded node runs `counter` (the victim: `incr` on one live key)
//! and the `hostile` test guest (the attackers). Each benchmark measures the
//! victim's warm call with criterion while `FIEF_HOSTILE_ATTACKERS` (4) tokio tasks keep one
//! attack going each, starting it again as soon as the node contains it:
//!
//! - `quiet`: no attack (the baseline).
//! - `spinning`: each attacker's key loops in `handle-call` until its CPU
//!   limit (100 ms) kills it.
//! - `memory_bombs`: each attacker's key allocates until its memory limit
//!   (16 MiB) kills it.
//! - `publish_flood`: each attacker's key publishes to a topic the victim's
//!   module does not hear until `max_publishes_per_second` (1000) refuses it.
//! - `timer_storm`: each attacker's key (of `budgeted`, with `cpu_budget`
//!   100m) re-arms a 0 ms timer forever: short callbacks, none near its CPU
//!   limit, held to its budget by throttling (issue 16 finding 9). Armed
//!   once; last in each list, since it never stops.
//!
//! Then the HTTP form (issue 17): the victim's `incr` over the node's HTTP
//! API on a real loopback socket, from a client on a thread and runtime of
//! its own (as an external load generator would be), one call at a time;
//! printed as p50 / p99 over 2 000 calls (`FIEF_HOSTILE_HTTP_CALLS`), quiet and under each
//! attack, with how many of the attackers' requests waited for a turn
//! (`host/src/request_turns.rs`) and the load average; twice: with the attackers as in-process
//! tasks on the node's runtime (an embedding program's own), and with the
//! attackers as external HTTP clients too, each on a connection of its own.
//! The attackers' modules are of tenant `mallory`; the victim's is of none.
//!
//! Run with `cargo bench -p fief-benches --bench hostile` (add `-- --quick`
//! for a smoke run; `FIEF_HOSTILE_BOMB_MIB` sets the attackers' memory
//! limit, default 16, `FIEF_HOSTILE_EPOCH_TICK_US` the node's epoch
//! tick, `FIEF_HOSTILE_GUEST_POLICY` the guest threads' policy (`nice` or
//! `idle`), `FIEF_HOSTILE_HTTP_CALLS` the victim's calls per HTTP figure and
//! `FIEF_HOSTILE_HTTP_ATTACKS` which attacks the HTTP form runs); the
//! figures are in `docs/benchmarks.md`, "Hostile guests".

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{COUNTER_WASM, HttpConn, embedded_node, guest, serve_fief_http_with};
use criterion::Criterion;
use fief::config::{ByteSize, GuestThreadPolicy};
use fief::{Instance, ModuleOptions, NodeConfig};
use tokio::runtime::Runtime;
use tokio::task::JoinHandle;

/// The hostile test guest, built from source by `build.rs`.
const HOSTILE_WASM: &str = env!("FIEF_GUEST_HOSTILE");

/// Attacking keys, each driven by its own task (over HTTP, its own client
/// thread and connection): `FIEF_HOSTILE_ATTACKERS`, default 4.
fn attackers() -> usize {
    env_number("FIEF_HOSTILE_ATTACKERS").map_or(4, |n| n.max(1) as usize)
}

/// The attackers' modules, of another tenant than the victim's `counter`
/// (a module of no tenant): fair turns go first between tenants.
const HOSTILE: &str = "mallory/hostile";
/// The attackers' module with a `cpu_budget` (the timer storm).
const BUDGETED: &str = "mallory/budgeted";

/// The attackers' memory limit in MiB: `FIEF_HOSTILE_BOMB_MIB`, default 16
/// (to see whether what a bomb costs its neighbours follows its size).
fn bomb_mib() -> u64 {
    env_number("FIEF_HOSTILE_BOMB_MIB").unwrap_or(16)
}

/// The whole number in `var`, if it is set; a value that is not one stops
/// the bench with its name (a typo must not measure the default silently).
fn env_number(var: &str) -> Option<u64> {
    let value = std::env::var(var).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{var}={value:?}: expected a whole number")),
    )
}

/// The node's epoch tick: `FIEF_HOSTILE_EPOCH_TICK_US` microseconds, default
/// the node's (1 ms). It is the longest an inline call holds its caller's
/// worker before it is demoted.
fn epoch_tick() -> Duration {
    env_number("FIEF_HOSTILE_EPOCH_TICK_US")
        .map_or(NodeConfig::default().epoch_tick, Duration::from_micros)
}

/// The guest threads' policy: `FIEF_HOSTILE_GUEST_POLICY` (`nice` or
/// `idle`), default the node's.
fn guest_thread_policy() -> GuestThreadPolicy {
    std::env::var("FIEF_HOSTILE_GUEST_POLICY").map_or_else(
        |_| NodeConfig::default().guest_thread_policy,
        |text| {
            text.parse()
                .unwrap_or_else(|why| panic!("FIEF_HOSTILE_GUEST_POLICY: {why}"))
        },
    )
}

/// The node: `counter` with default options, `mallory/hostile` with a 100 ms CPU
/// limit and a 16 MiB memory limit (see [`bomb_mib`]), `mallory/budgeted` (the
/// same guest) with a `cpu_budget` of 100m as well.
async fn node() -> Arc<Instance> {
    let config = NodeConfig {
        max_live_keys: 64,
        max_memory_per_key: ByteSize::mib(64),
        epoch_tick: epoch_tick(),
        guest_thread_policy: guest_thread_policy(),
        ..NodeConfig::default()
    };
    let hostile = ModuleOptions {
        cpu_limit: Duration::from_millis(100),
        memory_limit: ByteSize::mib(bomb_mib()),
        max_publishes_per_second: 1000,
        ..ModuleOptions::default()
    };
    let node = embedded_node(
        config,
        &[
            ("counter", &guest(COUNTER_WASM), ModuleOptions::default()),
            (HOSTILE, &guest(HOSTILE_WASM), hostile.clone()),
            (
                BUDGETED,
                &guest(HOSTILE_WASM),
                ModuleOptions {
                    cpu_budget: "100m".parse().expect("a share"),
                    ..hostile
                },
            ),
        ],
    )
    .await;
    node.call("counter", "victim", b"incr".to_vec())
        .await
        .expect("the victim answers");
    Arc::new(node)
}

/// Start [`attackers`] tasks, each sending `attack` to its own hostile key
/// again and again (each call ends when the node contains the attack); for
/// the timer storm, arm each attacker's timer once (it never stops).
async fn start_attack(node: &Arc<Instance>, attack: &'static [u8]) -> Vec<JoinHandle<()>> {
    if attack == TIMER_STORM {
        for i in 0..attackers() {
            node.call(BUDGETED, &format!("attacker-{i}"), attack.to_vec())
                .await
                .expect("the timer is armed");
        }
        return Vec::new();
    }
    (0..attackers())
        .map(|i| {
            let node = node.clone();
            tokio::spawn(async move {
                let key = format!("attacker-{i}");
                loop {
                    let _ = node.call(HOSTILE, &key, attack.to_vec()).await;
                }
            })
        })
        .collect()
}

/// The attack that arms a 0 ms timer re-armed forever.
const TIMER_STORM: &[u8] = b"rearm-zero";

/// Every attack, by name; `None` is the baseline.
const ATTACKS: [(&str, Option<&[u8]>); 5] = [
    ("quiet", None),
    ("spinning", Some(b"loop")),
    ("memory_bombs", Some(b"memory")),
    ("publish_flood", Some(b"publish-flood")),
    ("timer_storm", Some(TIMER_STORM)),
];

fn bench(c: &mut Criterion) {
    let rt = Runtime::new().expect("tokio runtime");
    let node = rt.block_on(node());
    let mut group = c.benchmark_group("hostile/victim_warm_call");
    group.measurement_time(Duration::from_secs(5));
    for (name, attack) in ATTACKS {
        let attackers = attack.map(|a| rt.block_on(start_attack(&node, a)));
        group.bench_function(name, |b| {
            // Each sample's calls run in one task on the node's runtime,
            // beside the attackers' tasks.
            b.iter_custom(|iters| {
                let node = node.clone();
                rt.block_on(async move {
                    tokio::spawn(async move {
                        let start = Instant::now();
                        for _ in 0..iters {
                            node.call("counter", "victim", b"incr".to_vec())
                                .await
                                .expect("the victim answers during the attack");
                        }
                        start.elapsed()
                    })
                    .await
                    .expect("the victim's task")
                })
            });
        });
        for task in attackers.into_iter().flatten() {
            task.abort();
        }
    }
    group.finish();
    rt.block_on(async {
        if let Ok(node) = Arc::try_unwrap(node) {
            node.shutdown().await;
        }
    });
}

/// Victim calls per HTTP figure: `FIEF_HOSTILE_HTTP_CALLS`, default 2000
/// (about 0.15 s of calls: a longer phase steadies the p99).
fn http_calls() -> usize {
    env_number("FIEF_HOSTILE_HTTP_CALLS").map_or(2000, |n| n.max(1) as usize)
}

/// Whether the HTTP form measures `attack`: `FIEF_HOSTILE_HTTP_ATTACKS`, a
/// comma-separated list of attack names, default all (the baseline,
/// `quiet`, always runs; to trace one attack alone). A name that is no
/// attack stops the bench with the list of names.
fn http_attack_wanted(attack: &str) -> bool {
    let Ok(list) = std::env::var("FIEF_HOSTILE_HTTP_ATTACKS") else {
        return true;
    };
    let names: Vec<&str> = ATTACKS.iter().map(|(name, _)| *name).collect();
    for wanted in list.split(',').map(str::trim) {
        assert!(
            names.contains(&wanted),
            "FIEF_HOSTILE_HTTP_ATTACKS: {wanted:?} is no attack; expected some of {names:?}"
        );
    }
    attack == "quiet" || list.split(',').any(|wanted| wanted.trim() == attack)
}

/// The victim's call latencies over HTTP, from a client on its own thread.
fn http_latencies(addr: std::net::SocketAddr, calls: usize) -> Vec<Duration> {
    std::thread::spawn(move || {
        let client = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("the client's runtime");
        client.block_on(async move {
            let mut conn = HttpConn::open_with_token(addr, ADMIN_TOKEN).await;
            let mut latencies = Vec::with_capacity(calls);
            for _ in 0..calls {
                let start = Instant::now();
                conn.post("/v1/keys/counter/victim/call", b"incr").await;
                latencies.push(start.elapsed());
            }
            latencies
        })
    })
    .join()
    .expect("the client thread")
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".to_owned())
}

/// Start [`attackers`] client threads, each sending `attack` over HTTP to its
/// own hostile key on a connection of its own, again and again, until `stop`
/// is set; for the timer storm, arm each attacker's timer once (over HTTP).
fn start_http_attack(
    addr: std::net::SocketAddr,
    attack: &'static [u8],
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<()>> {
    // A tenant's token scopes the names: `hostile` is `mallory/hostile`.
    let module = if attack == TIMER_STORM {
        BUDGETED
    } else {
        HOSTILE
    }
    .trim_start_matches("mallory/");
    let threads: Vec<_> = (0..attackers())
        .map(|i| {
            let (stop, path) = (stop.clone(), format!("/v1/keys/{module}/attacker-{i}/call"));
            std::thread::spawn(move || {
                let client = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("an attacker's runtime");
                client.block_on(async move {
                    let mut conn = HttpConn::open_with_token(addr, MALLORY_TOKEN).await;
                    if attack == TIMER_STORM {
                        conn.post(&path, attack).await;
                        return;
                    }
                    while !stop.load(Ordering::Relaxed) {
                        let _ = conn.post_any(&path, attack).await;
                    }
                });
            })
        })
        .collect();
    threads
}

/// `mallory`'s key requests over the API that waited for a turn so far
/// (`fief_tenant_requests_waited_total`): the attackers' requests held back
/// while the victim's were served.
async fn requests_waited(node: &Instance) -> u64 {
    let text = node.metrics_text().await;
    text.lines()
        .find_map(|line| {
            line.strip_prefix("fief_tenant_requests_waited_total{tenant=\"mallory\"} ")
        })
        .and_then(|value| value.trim().parse::<f64>().ok())
        .map_or(0, |value| value as u64)
}

/// The HTTP form's tokens: the victim calls as the admin, the attackers as
/// tenant `mallory`.
const ADMIN_TOKEN: &str = "admin-token-0123456789abcdef";
const MALLORY_TOKEN: &str = "mallory-token-0123456789abcdef";

fn api_options() -> fief::http::ApiOptions {
    let tokens = format!(
        "[admin]\ntokens = [\"{ADMIN_TOKEN}\"]\n[tenants.mallory]\ntokens = [\"{MALLORY_TOKEN}\"]\n"
    );
    fief::http::ApiOptions {
        auth: Arc::new(fief::auth::Auth::parse(&tokens, false).expect("the tokens parse")),
        tls: None,
    }
}

/// Where the HTTP form's attackers come from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Attackers {
    /// Tasks on the node's runtime calling in-process (an embedding
    /// program's own tasks): they share the API's workers.
    InProcess,
    /// External clients on connections of their own, as the victim.
    OverHttp,
}

/// The HTTP form: the node on a two-worker runtime (like `fief node` on
/// this machine), the victim called over a real socket; a node of its own
/// for each form of attacker (the timer storm never stops).
fn bench_http(quick: bool, attackers: Attackers) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let node = rt.block_on(node());
    let addr = rt.block_on(serve_fief_http_with(node.clone(), api_options()));
    let calls = if quick {
        http_calls() / 10
    } else {
        http_calls()
    }
    .max(1);
    let from = match attackers {
        Attackers::InProcess => "attackers in-process",
        Attackers::OverHttp => "attackers over HTTP",
    };
    println!("hostile/victim_http ({calls} calls, one at a time, over loopback; {from})");
    println!(
        "  {:<14} {:>10} {:>10} {:>8}   load average",
        "attack", "p50", "p99", "waited"
    );
    let mut waited_before = 0;
    for (name, attack) in ATTACKS {
        if !http_attack_wanted(name) {
            continue;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (tasks, threads) = match (attack, attackers) {
            (None, _) => (Vec::new(), Vec::new()),
            (Some(a), Attackers::InProcess) => (rt.block_on(start_attack(&node, a)), Vec::new()),
            (Some(a), Attackers::OverHttp) => (Vec::new(), start_http_attack(addr, a, &stop)),
        };
        // Let the attack get going.
        std::thread::sleep(Duration::from_millis(200));
        let mut latencies = http_latencies(addr, calls);
        latencies.sort();
        let waited = rt.block_on(requests_waited(&node));
        println!(
            "  {name:<14} {:>10.1?} {:>10.1?} {:>8}   {}",
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
            waited - waited_before,
            load_average()
        );
        waited_before = waited;
        for task in tasks {
            task.abort();
        }
        stop.store(true, Ordering::Relaxed);
        for thread in threads {
            thread.join().expect("an attacker's thread");
        }
    }
    rt.block_on(async {
        if let Ok(node) = Arc::try_unwrap(node) {
            node.shutdown().await;
        }
    });
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
    bench_http(quick, Attackers::InProcess);
    bench_http(quick, Attackers::OverHttp);
}
