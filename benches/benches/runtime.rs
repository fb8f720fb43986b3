//! Criterion benchmarks of the Fief runtime, each beside a raw wasmtime
//! baseline on the same `counter.wasm` component in the same run.
//!
//! - `cold_activation`: the first message to a brand-new key, until its reply.
//!   Fief: `Instance::call` with a fresh key each iteration. Raw: store +
//!   instantiate (pooling `InstancePre`) + `init` + `handle-call get` + drop;
//!   `raw_batched` keeps the stores alive and drops them outside the timed
//!   section, as the Fief side does with its keys.
//! - `warm_call`: `incr` on a key that is already live. Fief: `Instance::call`
//!   through the key's mailbox. Raw: the generated `call_handle_call`.
//!   `fief_current_thread` is a diagnostic: the same Fief calls on a node
//!   living on a current-thread runtime (no cross-thread wake-ups).
//! - `throughput_many_keys`: 64 live keys, calls issued concurrently from 8
//!   tokio tasks; criterion reports calls per second.
//! - `http`: calls through the node's HTTP API on loopback from a hyper
//!   client with 32 keep-alive connections (32 requests in flight) over 64
//!   keys. Raw: an axum server on the same path calling raw instances.
//! - `cross_node`: 32 tasks calling, through node `n0`, 64 keys that node
//!   `n1` owns (two in-process nodes sharing a local arbiter, over their TCP
//!   transport). Raw: one loopback TCP hop (a connection per caller) into
//!   raw instances.
//!
//! Latency distributions and one-shot figures (kill, fence, memory, max keys,
//! failover) are in the `scale` bench.
//!
//! Both sides use an engine with the same configuration (component model,
//! epoch interruption, the pooling allocator sized as Fief sizes it), the
//! async WASI p2 linker and the generated `fief:key` bindings, and both are
//! driven from tasks on one multi-thread tokio runtime.
//!
//! Run with `cargo bench -p fief-benches` (add `-- --quick` for a smoke run);
//! the figures and how to read them are in `docs/benchmarks.md`.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{COUNTER_WASM, Cluster, HttpConn, Raw, RawKey, RawTcpConn};
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use fief::{Instance, ModuleOptions, NodeConfig};
use tokio::runtime::Runtime;

/// Module name the counter is deployed under.
const MODULE: &str = "counter";

/// Live keys in `throughput_many_keys`.
const KEYS: usize = 64;

/// Tokio tasks issuing calls in `throughput_many_keys`.
const CALLERS: usize = 8;

/// Most fresh keys activated before they are killed (outside the timed
/// section) in `cold_activation`; well under the node's `max_live_keys`.
const COLD_CHUNK: u64 = 1000;

// ---------------------------------------------------------------------------
// Set-up shared by every group
// ---------------------------------------------------------------------------

/// A tokio runtime, a Fief node with the counter deployed, and the baseline.
struct Fixture {
    rt: Runtime,
    node: Arc<Instance>,
    raw: Arc<Raw>,
    wasm: Vec<u8>,
    next_key: AtomicU64,
}

impl Fixture {
    fn new() -> Self {
        let wasm =
            std::fs::read(COUNTER_WASM).unwrap_or_else(|e| panic!("reading {COUNTER_WASM}: {e}"));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        // 4096 keys, not the default 10 000: the node and the baseline each
        // make a pool, and both (6 memory mappings per key) must fit under
        // the default `vm.max_map_count` (65 530) in this one process.
        let config = NodeConfig {
            max_live_keys: 4096,
            ..NodeConfig::default()
        };
        let raw = Arc::new(Raw::new(&config, &wasm));
        let node = rt.block_on(async {
            let node = Instance::start_embedded(config)
                .await
                .expect("starting the node");
            node.deploy(MODULE, &wasm, ModuleOptions::default())
                .await
                .expect("deploying the counter");
            // The embedded node serves once it holds its lease.
            node.call(MODULE, "warm-up", b"get".to_vec())
                .await
                .expect("the node serves");
            node
        });
        Fixture {
            rt,
            node: Arc::new(node),
            raw,
            wasm,
            next_key: AtomicU64::new(0),
        }
    }

    /// Run `future` as a task on the runtime (as callers in a tokio program
    /// do) and wait for it.
    fn run<T: Send + 'static>(&self, future: impl Future<Output = T> + Send + 'static) -> T {
        self.rt
            .block_on(self.rt.spawn(future))
            .expect("benchmark task panicked")
    }

    /// `n` key names never used before.
    fn fresh_keys(&self, n: u64) -> Vec<String> {
        let first = self.next_key.fetch_add(n, Ordering::Relaxed);
        (first..first + n).map(|i| format!("cold-{i}")).collect()
    }

    fn live_keys(&self) -> usize {
        self.node.status().live_keys
    }

    /// Kill `keys` and wait until their processes are gone (untimed).
    fn kill_and_wait(&self, keys: &[String], live_before: usize) {
        for key in keys {
            self.node.kill_key(MODULE, key);
        }
        self.rt.block_on(async {
            let deadline = Instant::now() + Duration::from_secs(30);
            while self.live_keys() > live_before {
                assert!(Instant::now() < deadline, "killed keys did not go away");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
    }
}

fn configure(group: &mut BenchmarkGroup<'_, WallTime>) {
    group
        .warm_up_time(Duration::from_secs(2))
        .measurement_time(Duration::from_secs(5))
        .sample_size(50);
}

// ---------------------------------------------------------------------------
// Groups
// ---------------------------------------------------------------------------

fn cold_activation(c: &mut Criterion, fx: &Fixture) {
    let mut group = c.benchmark_group("cold_activation");
    configure(&mut group);

    group.bench_function("fief", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(COLD_CHUNK);
                left -= n;
                let keys = Arc::new(fx.fresh_keys(n));
                let live_before = fx.live_keys();
                let (node, timed_keys) = (fx.node.clone(), keys.clone());
                total += fx.run(async move {
                    let start = Instant::now();
                    for key in timed_keys.iter() {
                        let reply = node.call(MODULE, key, b"get".to_vec()).await;
                        assert_eq!(reply.expect("cold call"), b"0");
                    }
                    start.elapsed()
                });
                fx.kill_and_wait(&keys, live_before);
            }
            total
        });
    });

    group.bench_function("raw", |b| {
        b.iter_custom(|iters| {
            let raw = fx.raw.clone();
            fx.run(async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let mut key = raw.start("cold").await;
                    assert_eq!(key.call(b"get").await, b"0");
                    drop(key);
                }
                start.elapsed()
            })
        });
    });

    group.bench_function("raw_batched", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(COLD_CHUNK);
                left -= n;
                let raw = fx.raw.clone();
                let (elapsed, live) = fx.run(async move {
                    let mut live = Vec::with_capacity(n as usize);
                    let start = Instant::now();
                    for _ in 0..n {
                        let mut key = raw.start("cold").await;
                        assert_eq!(key.call(b"get").await, b"0");
                        live.push(key);
                    }
                    (start.elapsed(), live)
                });
                total += elapsed;
                drop(live);
            }
            total
        });
    });

    group.finish();
}

fn warm_call(c: &mut Criterion, fx: &Fixture) {
    let mut group = c.benchmark_group("warm_call");
    configure(&mut group);

    fx.run({
        let node = fx.node.clone();
        async move { node.call(MODULE, "alice", b"get".to_vec()).await }
    })
    .expect("activating alice");
    group.bench_function("fief", |b| {
        b.iter_custom(|iters| {
            let node = fx.node.clone();
            fx.run(async move {
                let start = Instant::now();
                for _ in 0..iters {
                    let reply = node.call(MODULE, "alice", b"incr".to_vec()).await;
                    std::hint::black_box(reply.expect("warm call"));
                }
                start.elapsed()
            })
        });
    });

    // Diagnostic, not a target figure: the same calls on a node that lives
    // on a current-thread runtime, where the caller and the key task never
    // wake each other across threads. The gap to `fief` is the cost of the
    // cross-worker wake-ups of the multi-thread scheduler.
    let single = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("current-thread runtime");
    let single_node = single.block_on(async {
        // A small pool: three full-size pools in one process would pass
        // `vm.max_map_count` (each pooled stack adds a guard-page mapping).
        let config = NodeConfig {
            max_live_keys: 64,
            ..NodeConfig::default()
        };
        let node = Instance::start_embedded(config)
            .await
            .expect("starting the second node");
        node.deploy(MODULE, &fx.wasm, ModuleOptions::default())
            .await
            .expect("deploying the counter");
        node.call(MODULE, "alice", b"get".to_vec())
            .await
            .expect("activating alice");
        node
    });
    group.bench_function("fief_current_thread", |b| {
        b.iter_custom(|iters| {
            single.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let reply = single_node.call(MODULE, "alice", b"incr".to_vec()).await;
                    std::hint::black_box(reply.expect("warm call"));
                }
                start.elapsed()
            })
        });
    });
    single.block_on(single_node.shutdown());

    let raw = fx.raw.clone();
    let alice = Arc::new(tokio::sync::Mutex::new(
        fx.run(async move { raw.start("alice").await }),
    ));
    group.bench_function("raw", |b| {
        b.iter_custom(|iters| {
            let alice = alice.clone();
            fx.run(async move {
                let mut alice = alice.lock().await;
                let start = Instant::now();
                for _ in 0..iters {
                    std::hint::black_box(alice.call(b"incr").await);
                }
                start.elapsed()
            })
        });
    });

    group.finish();
}

/// Split `iters` calls over `CALLERS` callers as evenly as possible.
fn share(iters: u64, caller: usize) -> u64 {
    let callers = CALLERS as u64;
    iters / callers + u64::from((caller as u64) < iters % callers)
}

fn throughput_many_keys(c: &mut Criterion, fx: &Fixture) {
    let mut group = c.benchmark_group("throughput_many_keys");
    configure(&mut group);
    group.throughput(Throughput::Elements(1));

    // Caller `t` calls keys t, t + CALLERS, t + 2*CALLERS, ... in turn.
    let names: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("many-{i}")).collect());
    fx.run({
        let (node, names) = (fx.node.clone(), names.clone());
        async move {
            for key in names.iter() {
                node.call(MODULE, key, b"get".to_vec())
                    .await
                    .expect("activating");
            }
        }
    });
    group.bench_function("fief", |b| {
        b.iter_custom(|iters| {
            let (node, names) = (fx.node.clone(), names.clone());
            fx.run(async move {
                let start = Instant::now();
                let callers: Vec<_> = (0..CALLERS)
                    .map(|t| {
                        let (node, names) = (node.clone(), names.clone());
                        tokio::spawn(async move {
                            let mine: Vec<&String> =
                                names.iter().skip(t).step_by(CALLERS).collect();
                            for i in 0..share(iters, t) {
                                let key = mine[i as usize % mine.len()];
                                let reply = node.call(MODULE, key, b"incr".to_vec()).await;
                                std::hint::black_box(reply.expect("call"));
                            }
                        })
                    })
                    .collect();
                for caller in callers {
                    caller.await.expect("caller task");
                }
                start.elapsed()
            })
        });
    });

    // The same, each caller owning its keys' stores and calling them directly.
    let raw = fx.raw.clone();
    let stores: Vec<Arc<tokio::sync::Mutex<Vec<RawKey>>>> = fx.run(async move {
        let mut stores = Vec::new();
        for t in 0..CALLERS {
            let mut mine = Vec::new();
            for i in (t..KEYS).step_by(CALLERS) {
                mine.push(raw.start(&format!("many-{i}")).await);
            }
            stores.push(Arc::new(tokio::sync::Mutex::new(mine)));
        }
        stores
    });
    let stores = Arc::new(stores);
    group.bench_function("raw", |b| {
        b.iter_custom(|iters| {
            let stores = stores.clone();
            fx.run(async move {
                let start = Instant::now();
                let callers: Vec<_> = (0..CALLERS)
                    .map(|t| {
                        let mine = stores[t].clone();
                        tokio::spawn(async move {
                            let mut mine = mine.lock().await;
                            let len = mine.len();
                            for i in 0..share(iters, t) {
                                std::hint::black_box(mine[i as usize % len].call(b"incr").await);
                            }
                        })
                    })
                    .collect();
                for caller in callers {
                    caller.await.expect("caller task");
                }
                start.elapsed()
            })
        });
    });

    group.finish();
}

/// Connections of the HTTP load client, and callers of the cross-node group.
const LOAD_CALLERS: usize = 32;

/// Keys the HTTP and cross-node groups call, spread over the callers.
const LOAD_KEYS: usize = 64;

/// Run `LOAD_CALLERS` tasks that make `iters` calls between them, caller `t`
/// making its `i`-th with `call(t, i)`; returns the elapsed time.
async fn load<F, Fut>(iters: u64, call: F) -> Duration
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    let start = Instant::now();
    let tasks: Vec<_> = (0..LOAD_CALLERS)
        .map(|t| {
            let call = call.clone();
            tokio::spawn(async move {
                for i in 0..common::share(iters, LOAD_CALLERS, t) {
                    call(t, i).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("caller task");
    }
    start.elapsed()
}

/// The key caller `t` uses for its `i`-th call.
fn load_key(keys: &[String], t: usize, i: u64) -> &str {
    &keys[(t + i as usize * LOAD_CALLERS) % keys.len()]
}

fn http(c: &mut Criterion, fx: &Fixture) {
    let mut group = c.benchmark_group("http");
    configure(&mut group);
    group.throughput(Throughput::Elements(1));

    let names: Vec<String> = (0..LOAD_KEYS).map(|i| format!("web-{i}")).collect();
    let paths: Arc<Vec<String>> = Arc::new(
        names
            .iter()
            .map(|k| format!("/v1/keys/{MODULE}/{k}/call"))
            .collect(),
    );
    // Fief: the node's own axum API on loopback.
    let conns = fx.run({
        let node = fx.node.clone();
        async move {
            let addr = common::serve_fief_http(node).await;
            open_http(addr).await
        }
    });
    group.bench_function("fief", |b| {
        b.iter_custom(|iters| {
            let (conns, paths) = (conns.clone(), paths.clone());
            fx.run(load(iters, move |t, i| {
                let (conns, paths) = (conns.clone(), paths.clone());
                async move {
                    let path = load_key(&paths, t, i);
                    std::hint::black_box(conns[t].lock().await.post(path, b"incr").await);
                }
            }))
        });
    });

    // Raw: axum on the same path, straight into raw instances.
    let conns = fx.run({
        let raw = fx.raw.clone();
        async move {
            let keys = common::raw_keys(&raw, &names).await;
            let addr = common::serve_raw_http(keys).await;
            open_http(addr).await
        }
    });
    group.bench_function("raw", |b| {
        b.iter_custom(|iters| {
            let (conns, paths) = (conns.clone(), paths.clone());
            fx.run(load(iters, move |t, i| {
                let (conns, paths) = (conns.clone(), paths.clone());
                async move {
                    let path = load_key(&paths, t, i);
                    std::hint::black_box(conns[t].lock().await.post(path, b"incr").await);
                }
            }))
        });
    });
    group.finish();
}

type Shared<T> = Arc<Vec<tokio::sync::Mutex<T>>>;

/// `LOAD_CALLERS` keep-alive connections to `addr`.
async fn open_http(addr: std::net::SocketAddr) -> Shared<HttpConn> {
    let mut conns = Vec::new();
    for _ in 0..LOAD_CALLERS {
        conns.push(tokio::sync::Mutex::new(HttpConn::open(addr).await));
    }
    Arc::new(conns)
}

fn cross_node(c: &mut Criterion, fx: &Fixture) {
    let mut group = c.benchmark_group("cross_node");
    configure(&mut group);
    group.throughput(Throughput::Elements(1));

    // Two nodes sharing a local arbiter, talking over their TCP transport;
    // calls go to n0 for keys n1 owns.
    let wasm = fx.wasm.clone();
    let (cluster, keys) = fx.run(async move {
        let modules = [(MODULE, wasm.as_slice(), ModuleOptions::default())];
        let config = |i: usize| NodeConfig {
            node_id: format!("n{i}"),
            partitions: 64,
            max_live_keys: 1024,
            ..NodeConfig::default()
        };
        let cluster = Cluster::start(2, config, &modules).await;
        let keys = common::keys_owned_by(
            cluster.node(0),
            cluster.node(1),
            MODULE,
            "remote",
            LOAD_KEYS,
        )
        .await;
        (Arc::new(cluster), Arc::new(keys))
    });
    group.bench_function("fief", |b| {
        b.iter_custom(|iters| {
            let (cluster, keys) = (cluster.clone(), keys.clone());
            fx.run(load(iters, move |t, i| {
                let (cluster, keys) = (cluster.clone(), keys.clone());
                async move {
                    let key = load_key(&keys, t, i);
                    let reply = cluster.node(0).call(MODULE, key, b"incr".to_vec()).await;
                    std::hint::black_box(reply.expect("cross-node call"));
                }
            }))
        });
    });

    // Raw: one loopback TCP hop (a connection per caller, length-prefixed
    // request and reply) straight into raw instances.
    let conns: Shared<RawTcpConn> = fx.run({
        let (raw, keys) = (fx.raw.clone(), keys.clone());
        async move {
            let raw_keys = common::raw_keys(&raw, &keys).await;
            let addr = common::serve_raw_tcp(raw_keys).await;
            let mut conns = Vec::new();
            for _ in 0..LOAD_CALLERS {
                conns.push(tokio::sync::Mutex::new(RawTcpConn::open(addr).await));
            }
            Arc::new(conns)
        }
    });
    group.bench_function("raw_tcp", |b| {
        b.iter_custom(|iters| {
            let (conns, keys) = (conns.clone(), keys.clone());
            fx.run(load(iters, move |t, i| {
                let (conns, keys) = (conns.clone(), keys.clone());
                async move {
                    let key = load_key(&keys, t, i);
                    std::hint::black_box(conns[t].lock().await.call(key, b"incr").await);
                }
            }))
        });
    });
    group.finish();
    if let Ok(cluster) = Arc::try_unwrap(cluster) {
        fx.rt.block_on(async move {
            for node in cluster.nodes.into_iter().flatten() {
                node.shutdown().await;
            }
        });
    }
}

fn benches(c: &mut Criterion) {
    let fx = Fixture::new();
    cold_activation(c, &fx);
    warm_call(c, &fx);
    throughput_many_keys(c, &fx);
    http(c, &fx);
    cross_node(c, &fx);
    let Fixture { rt, node, .. } = fx;
    if let Ok(node) = Arc::try_unwrap(node) {
        rt.block_on(node.shutdown());
    }
}

// What `criterion_group!` + `criterion_main!` expand to, written out so that
// the entry point is not an undocumented `pub fn`.
fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    benches(&mut criterion);
    criterion.final_summary();
}
