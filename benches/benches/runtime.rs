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
//!
//! Both sides use an engine with the same configuration (component model,
//! epoch interruption, the pooling allocator sized as Fief sizes it), the
//! async WASI p2 linker and the generated `fief:key` bindings, and both are
//! driven from tasks on one multi-thread tokio runtime.
//!
//! Run with `cargo bench -p fief-benches` (add `-- --quick` for a smoke run);
//! the figures and how to read them are in `docs/benchmarks.md`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use fief::bindings::types::{CacheError, CallError, EffectError, LogLevel};
use fief::bindings::{KeyModule, KeyModulePre};
use fief::{Instance, ModuleOptions, NodeConfig};
use tokio::runtime::Runtime;
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// The counter component, built from source by `build.rs`.
const COUNTER_WASM: &str = env!("FIEF_GUEST_COUNTER");

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
// Raw wasmtime baseline
// ---------------------------------------------------------------------------

/// Store data of the raw baseline: WASI p2 and nothing else.
struct RawCtx {
    wasi: WasiCtx,
    table: ResourceTable,
}

impl WasiView for RawCtx {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl fief::bindings::types::Host for RawCtx {}

/// `fief:key/host` for the baseline: the counter's `get`/`incr` never call it,
/// so every import is a trivial answer.
impl fief::bindings::host::Host for RawCtx {
    fn self_key(&mut self) -> wasmtime::Result<String> {
        Ok(String::new())
    }

    fn self_module(&mut self) -> wasmtime::Result<String> {
        Ok(String::new())
    }

    fn ownership_token(&mut self) -> wasmtime::Result<u64> {
        Ok(0)
    }

    fn send_after(
        &mut self,
        _delay_ms: u64,
        _tag: Vec<u8>,
    ) -> wasmtime::Result<Result<u64, EffectError>> {
        Ok(Err(EffectError::Invalid("not in the baseline".to_owned())))
    }

    fn cancel_timer(&mut self, _id: u64) -> wasmtime::Result<bool> {
        Ok(false)
    }

    fn subscribe(&mut self, _topic: String) -> wasmtime::Result<Result<(), EffectError>> {
        Ok(Err(EffectError::Invalid("not in the baseline".to_owned())))
    }

    fn unsubscribe(&mut self, _topic: String) -> wasmtime::Result<()> {
        Ok(())
    }

    fn publish(
        &mut self,
        _topic: String,
        _payload: Vec<u8>,
    ) -> wasmtime::Result<Result<u32, EffectError>> {
        Ok(Ok(0))
    }

    async fn call(
        &mut self,
        _module: String,
        _key: String,
        _message: Vec<u8>,
        _timeout_ms: u32,
    ) -> wasmtime::Result<Result<Vec<u8>, CallError>> {
        Ok(Err(CallError::Unavailable(
            "not in the baseline".to_owned(),
        )))
    }

    fn cast(
        &mut self,
        _module: String,
        _key: String,
        _message: Vec<u8>,
    ) -> wasmtime::Result<Result<(), EffectError>> {
        Ok(Err(EffectError::Invalid("not in the baseline".to_owned())))
    }

    async fn cache_get(
        &mut self,
        _namespace: String,
        _key: String,
    ) -> wasmtime::Result<Result<Option<fief::bindings::types::CacheEntry>, CacheError>> {
        Ok(Ok(None))
    }

    async fn cache_put(
        &mut self,
        _namespace: String,
        _key: String,
        _value: Vec<u8>,
        _ttl_ms: Option<u64>,
        _expected_version: Option<u64>,
    ) -> wasmtime::Result<Result<u64, CacheError>> {
        Ok(Ok(1))
    }

    async fn cache_delete(
        &mut self,
        _namespace: String,
        _key: String,
        _expected_version: Option<u64>,
    ) -> wasmtime::Result<Result<bool, CacheError>> {
        Ok(Ok(false))
    }

    fn log(&mut self, _level: LogLevel, _message: String) -> wasmtime::Result<()> {
        Ok(())
    }
}

/// The raw baseline: an engine configured like Fief's and the counter
/// pre-instantiated against the async WASI p2 linker.
struct Raw {
    pre: KeyModulePre<RawCtx>,
}

/// One live instance of the baseline.
struct RawKey {
    store: Store<RawCtx>,
    guest: KeyModule,
}

impl Raw {
    /// Build the engine the way `host/src/runtime.rs` does for `config`.
    fn new(config: &NodeConfig, wasm: &[u8]) -> Self {
        // host/src/runtime.rs: MEMORY_GUARD and MAX_CORE_INSTANCES_PER_COMPONENT.
        const MEMORY_GUARD: u64 = 64 * 1024;
        const MAX_CORE_INSTANCES_PER_COMPONENT: u32 = 32;
        let keys = config.max_live_keys;
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(keys)
            .total_core_instances(keys.saturating_mul(4))
            .total_memories(keys.saturating_mul(2))
            .total_tables(keys.saturating_mul(4))
            .total_stacks(keys)
            .max_core_instances_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_memories_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_tables_per_component(MAX_CORE_INSTANCES_PER_COMPONENT)
            .max_memory_size(config.max_memory_per_key.as_u64() as usize);
        let mut wasm_config = Config::new();
        wasm_config
            .wasm_component_model(true)
            .epoch_interruption(true)
            .memory_reservation(config.max_memory_per_key.as_u64())
            .memory_guard_size(MEMORY_GUARD)
            .memory_reservation_for_growth(0)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let engine = Engine::new(&wasm_config).expect("raw engine");
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).expect("linking WASI");
        KeyModule::add_to_linker::<RawCtx, HasSelf<RawCtx>>(&mut linker, |ctx| ctx)
            .expect("linking fief:key/host");
        let component = Component::new(&engine, wasm).expect("compiling the counter");
        let pre = linker
            .instantiate_pre(&component)
            .expect("pre-instantiating");
        Raw {
            pre: KeyModulePre::new(pre).expect("the counter implements key-module"),
        }
    }

    /// A fresh store and instance, with `init` run: what a key activation is.
    async fn start(&self, key: &str) -> RawKey {
        let ctx = RawCtx {
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
        };
        let mut store = Store::new(self.pre.engine(), ctx);
        // No ticker runs for this engine, so the deadline is never reached;
        // the generated code still checks it, as it does in Fief.
        store.set_epoch_deadline(1);
        let guest = self
            .pre
            .instantiate_async(&mut store)
            .await
            .expect("instantiating");
        guest
            .fief_key_lifecycle()
            .call_init(&mut store, key, None)
            .await
            .expect("init trapped")
            .expect("init refused");
        RawKey { store, guest }
    }
}

impl RawKey {
    async fn call(&mut self, message: &[u8]) -> Vec<u8> {
        self.guest
            .fief_key_lifecycle()
            .call_handle_call(&mut self.store, message)
            .await
            .expect("handle-call trapped")
            .expect("handle-call refused")
    }
}

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
        let config = NodeConfig::default();
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

fn benches(c: &mut Criterion) {
    let fx = Fixture::new();
    cold_activation(c, &fx);
    warm_call(c, &fx);
    throughput_many_keys(c, &fx);
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
