//! Set-up shared by the bench targets (`runtime`, criterion; `scale`, a
//! table-printing harness): the raw wasmtime baseline, in-process clusters,
//! load clients for the HTTP API and for raw TCP, and process statistics.
//!
//! Each bench target compiles this module on its own and uses a part of it.
#![allow(dead_code, reason = "each bench target uses a part of this module")]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fief::arbiter::LocalArbiter;
use fief::bindings::storage::StorageError;
use fief::bindings::types::{CacheError, CallError, EffectError, LogLevel};
use fief::bindings::{KeyModule, KeyModulePre};
use fief::core::PartitionCount;
use fief::{Instance, ModuleOptions, NodeConfig, TokioClock};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use wasmtime::component::{Component, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, UpdateDeadline,
};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

/// How much a table-printing bench measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `cargo bench`: the full figures.
    Full,
    /// `cargo bench -- --quick`: the CI smoke run, small sizes.
    Quick,
    /// `cargo test --benches`: every routine once, tiny sizes.
    Test,
}

/// The sections a table-printing bench's arguments (without the program's
/// name) ask for: every argument not starting with `-` is a filter, and a
/// section is wanted when no filter is given or its name contains one.
pub fn sections(args: &[String]) -> impl Fn(&str) -> bool + '_ {
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    move |section: &str| filters.is_empty() || filters.iter().any(|f| section.contains(f.as_str()))
}

impl Mode {
    /// The mode the bench binary's arguments ask for.
    pub fn from_args(args: &[String]) -> Mode {
        if !args.iter().any(|a| a == "--bench") {
            Mode::Test
        } else if args.iter().any(|a| a == "--quick") {
            Mode::Quick
        } else {
            Mode::Full
        }
    }

    /// `full`, `quick` or `test`, as the mode is.
    pub fn pick<T>(self, full: T, quick: T, test: T) -> T {
        match self {
            Mode::Full => full,
            Mode::Quick => quick,
            Mode::Test => test,
        }
    }
}

/// The counter component, built from source by `build.rs`.
pub const COUNTER_WASM: &str = env!("FIEF_GUEST_COUNTER");
/// The spin test guest (`call spin` loops forever), built by `build.rs`.
pub const SPIN_WASM: &str = env!("FIEF_GUEST_SPIN");

/// The bytes of a guest component.
pub fn guest(path: &str) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

// ---------------------------------------------------------------------------
// Raw wasmtime baseline
// ---------------------------------------------------------------------------

/// Store data of the raw baseline: WASI p2 and nothing else.
pub struct RawCtx {
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

/// The raw baseline keeps no durable state: every key reads as empty (so a
/// guest's read-only call runs as it would on a key with nothing stored),
/// and every other storage call is refused.
impl fief::bindings::storage::Host for RawCtx {
    fn get(&mut self, _: String) -> wasmtime::Result<Result<Option<Vec<u8>>, StorageError>> {
        Ok(Ok(None))
    }
    fn put(&mut self, _: String, _: Vec<u8>) -> wasmtime::Result<Result<(), StorageError>> {
        Ok(Err(no_storage()))
    }
    fn delete(&mut self, _: String) -> wasmtime::Result<Result<bool, StorageError>> {
        Ok(Err(no_storage()))
    }
    fn list(
        &mut self,
        _: String,
        _: Option<String>,
        _: u32,
    ) -> wasmtime::Result<Result<Vec<(String, Vec<u8>)>, StorageError>> {
        Ok(Err(no_storage()))
    }
    fn delete_range(
        &mut self,
        _: String,
        _: Option<String>,
    ) -> wasmtime::Result<Result<u64, StorageError>> {
        Ok(Err(no_storage()))
    }
}

/// Nor alarms.
impl fief::bindings::alarms::Host for RawCtx {
    fn set_alarm(&mut self, _: String, _: u64) -> wasmtime::Result<Result<(), StorageError>> {
        Ok(Err(no_storage()))
    }
    fn cancel_alarm(&mut self, _: String) -> wasmtime::Result<Result<bool, StorageError>> {
        Ok(Err(no_storage()))
    }
    fn list_alarms(&mut self) -> wasmtime::Result<Result<Vec<(String, u64)>, StorageError>> {
        Ok(Err(no_storage()))
    }
}

/// Nor WebSocket connections: the baseline's keys have none.
impl fief::bindings::connections::Host for RawCtx {
    fn send_text(&mut self, _: u64, _: String) -> wasmtime::Result<Result<(), EffectError>> {
        Ok(Err(EffectError::Invalid("not in the baseline".to_owned())))
    }
    fn send_binary(&mut self, _: u64, _: Vec<u8>) -> wasmtime::Result<Result<(), EffectError>> {
        Ok(Err(EffectError::Invalid("not in the baseline".to_owned())))
    }
    fn close(&mut self, _: u64, _: u16, _: String) -> wasmtime::Result<()> {
        Ok(())
    }
    fn list_connections(&mut self) -> wasmtime::Result<Vec<u64>> {
        Ok(Vec::new())
    }
}

fn no_storage() -> StorageError {
    StorageError::Unavailable("the raw baseline keeps no state".to_owned())
}

/// `fief:key/host` for the baseline: the guests' benchmarked paths never
/// call it, so every import is a trivial answer.
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

/// The raw baseline: an engine configured like the notes' raw wasmtime
/// prototype and like Fief's engine before its memory strategy (component
/// model, epoch interruption, the pooling allocator sized for
/// `config.max_live_keys`), and one component pre-instantiated against the
/// async WASI p2 linker. No epoch ticker runs for it: stores set a deadline
/// that is reached only when a bench bumps the epoch itself.
pub struct Raw {
    pre: KeyModulePre<RawCtx>,
}

/// One live instance of the baseline.
pub struct RawKey {
    store: Store<RawCtx>,
    guest: KeyModule,
}

impl Raw {
    /// Build the engine for `config` and pre-instantiate `wasm`.
    pub fn new(config: &NodeConfig, wasm: &[u8]) -> Self {
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
        let component = Component::new(&engine, wasm).expect("compiling the guest");
        let pre = linker
            .instantiate_pre(&component)
            .expect("pre-instantiating");
        Raw {
            pre: KeyModulePre::new(pre).expect("the guest implements key-module"),
        }
    }

    /// The baseline's engine.
    pub fn engine(&self) -> &Engine {
        self.pre.engine()
    }

    /// A fresh store and instance, with `init` run: what a key activation is.
    pub async fn start(&self, key: &str) -> RawKey {
        self.start_killable(key, None).await
    }

    /// As [`Raw::start`]; with `kill`, the store's epoch callback interrupts
    /// the guest once the flag is set (Fief's kill path without Fief), and
    /// yields to the caller otherwise.
    pub async fn start_killable(&self, key: &str, kill: Option<Arc<AtomicBool>>) -> RawKey {
        let ctx = RawCtx {
            wasi: WasiCtx::builder().build(),
            table: ResourceTable::new(),
        };
        let mut store = Store::new(self.pre.engine(), ctx);
        store.set_epoch_deadline(1);
        if let Some(kill) = kill {
            store.epoch_deadline_callback(move |_| {
                if kill.load(Ordering::SeqCst) {
                    Ok(UpdateDeadline::Interrupt)
                } else {
                    Ok(UpdateDeadline::Yield(1))
                }
            });
        }
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
    /// `handle-call`; panics on a trap or a refusal.
    pub async fn call(&mut self, message: &[u8]) -> Vec<u8> {
        self.try_call(message)
            .await
            .expect("handle-call trapped")
            .expect("handle-call refused")
    }

    /// `handle-call`, returning a trap as an error.
    pub async fn try_call(&mut self, message: &[u8]) -> wasmtime::Result<Result<Vec<u8>, String>> {
        self.guest
            .fief_key_lifecycle()
            .call_handle_call(&mut self.store, message)
            .await
    }
}

/// Raw keys by name, each behind its own lock (one caller at a time, as a
/// key's mailbox would serialize them).
pub type RawKeys = Arc<HashMap<String, Arc<tokio::sync::Mutex<RawKey>>>>;

/// Start a raw key for each of `names`.
pub async fn raw_keys(raw: &Raw, names: &[String]) -> RawKeys {
    let mut keys = HashMap::new();
    for name in names {
        let key = raw.start(name).await;
        keys.insert(name.clone(), Arc::new(tokio::sync::Mutex::new(key)));
    }
    Arc::new(keys)
}

// ---------------------------------------------------------------------------
// Nodes and clusters
// ---------------------------------------------------------------------------

/// Start an embedded node with `modules` (name, wasm, options) deployed and
/// wait until it serves.
pub async fn embedded_node(
    config: NodeConfig,
    modules: &[(&str, &[u8], ModuleOptions)],
) -> Instance {
    let node = Instance::start_embedded(config)
        .await
        .expect("starting the node");
    for (name, wasm, options) in modules {
        node.deploy(name, wasm, options.clone())
            .await
            .unwrap_or_else(|e| panic!("deploying {name}: {e}"));
    }
    node
}

/// Nodes in one process sharing a [`LocalArbiter`] and one real-time clock,
/// talking through their TCP transport on loopback (as `tests/all/cluster.rs`
/// builds them, but on the OS clock).
pub struct Cluster {
    /// `nodes[i]` is `n<i>`; `n0` starts first and leads.
    pub nodes: Vec<Option<Instance>>,
    /// The shared arbiter.
    pub arbiter: LocalArbiter,
}

impl Cluster {
    /// Start `n` nodes with `config(i)` and `modules`, then wait until every
    /// node owns its fair share of the partitions (the leader's graceful
    /// moves are done).
    pub async fn start(
        n: usize,
        config: impl Fn(usize) -> NodeConfig,
        modules: &[(&str, &[u8], ModuleOptions)],
    ) -> Cluster {
        let clock = Arc::new(TokioClock::new());
        let partitions = config(0).partitions;
        let arbiter = LocalArbiter::new(
            clock.clone(),
            PartitionCount::new(partitions).expect("partition count"),
        );
        let mut nodes = Vec::new();
        for i in 0..n {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
            let mut builder = Instance::builder(config(i))
                .arbiter(Arc::new(arbiter.clone()))
                .clock(clock.clone())
                .peer_listener(listener);
            for (name, wasm, options) in modules {
                builder = builder.module(name, wasm.to_vec(), options.clone());
            }
            nodes.push(Some(builder.start().await.expect("starting a node")));
        }
        let cluster = Cluster { nodes, arbiter };
        cluster
            .wait_balanced(partitions, Duration::from_secs(60))
            .await;
        cluster
    }

    /// Node `n<i>`.
    pub fn node(&self, i: usize) -> &Instance {
        self.nodes[i].as_ref().expect("the node is running")
    }

    /// Wait until the running nodes own every partition between them, each
    /// at least its fair share less one.
    pub async fn wait_balanced(&self, partitions: u32, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            let running: Vec<&Instance> = self.nodes.iter().flatten().collect();
            let owned: Vec<usize> = running
                .iter()
                .map(|n| n.status().partitions_owned)
                .collect();
            let fair = partitions as usize / running.len().max(1);
            if owned.iter().sum::<usize>() == partitions as usize
                && owned.iter().all(|o| *o + 1 >= fair)
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not balance within {limit:?}: {owned:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Keys of `module` that `via` routes to `owner`: call fresh names through
/// `via` (activating them) and keep those that became live on `owner`.
pub async fn keys_owned_by(
    via: &Instance,
    owner: &Instance,
    module: &str,
    prefix: &str,
    count: usize,
) -> Vec<String> {
    let mut found = Vec::new();
    for i in 0.. {
        if found.len() == count {
            break;
        }
        let key = format!("{prefix}-{i}");
        via.call(module, &key, b"get".to_vec())
            .await
            .unwrap_or_else(|e| panic!("activating {key}: {e}"));
        if owner.keys().iter().any(|k| k.key == key) {
            found.push(key);
        }
    }
    found
}

// ---------------------------------------------------------------------------
// HTTP: the node's API, a raw baseline server, and a load client
// ---------------------------------------------------------------------------

/// Serve `instance`'s HTTP API on a free loopback port; returns the address.
pub async fn serve_fief_http(instance: Arc<Instance>) -> SocketAddr {
    serve_fief_http_with(instance, fief::http::ApiOptions::default()).await
}

/// Fief's HTTP API on a loopback port with `options` (tokens).
pub async fn serve_fief_http_with(
    instance: Arc<Instance>,
    options: fief::http::ApiOptions,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(fief::http::serve_with(
        instance,
        listener,
        options,
        std::future::pending(),
    ));
    addr
}

/// The raw baseline's HTTP server: axum on the same path, each request
/// straight into the named raw instance.
pub async fn serve_raw_http(keys: RawKeys) -> SocketAddr {
    use axum::body::Bytes;
    use axum::extract::{Path, State};
    use axum::http::StatusCode;

    async fn call(
        State(keys): State<RawKeys>,
        Path((_module, key)): Path<(String, String)>,
        body: Bytes,
    ) -> Result<Vec<u8>, StatusCode> {
        let key = keys.get(&key).ok_or(StatusCode::NOT_FOUND)?;
        let mut key = key.lock().await;
        Ok(key.call(&body).await)
    }

    let router = axum::Router::new()
        .route("/v1/keys/{module}/{key}/call", axum::routing::post(call))
        .with_state(keys);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

/// One HTTP/1.1 keep-alive connection of the load client.
pub struct HttpConn {
    sender: hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    host: String,
    /// `Authorization: Bearer` for every request, if set.
    token: Option<String>,
}

impl HttpConn {
    /// Open a connection to `addr`.
    pub async fn open(addr: SocketAddr) -> HttpConn {
        let stream = TcpStream::connect(addr).await.expect("connecting");
        stream.set_nodelay(true).expect("nodelay");
        let (sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("HTTP handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        HttpConn {
            sender,
            host: addr.to_string(),
            token: None,
        }
    }

    /// Open a connection to `addr` whose requests carry `token`.
    pub async fn open_with_token(addr: SocketAddr, token: &str) -> HttpConn {
        HttpConn {
            token: Some(token.to_owned()),
            ..HttpConn::open(addr).await
        }
    }

    /// `POST path` with `body`; panics unless the answer is 200.
    pub async fn post(&mut self, path: &str, body: &'static [u8]) -> bytes::Bytes {
        let (status, body) = self.post_any(path, body).await;
        assert!(status.is_success(), "{path}: {status}: {body:?}");
        body
    }

    /// `POST path` with `body`: the answer's status and body, whatever the
    /// status (an attacker's calls are refused, and it goes on).
    pub async fn post_any(
        &mut self,
        path: &str,
        body: &'static [u8],
    ) -> (hyper::StatusCode, bytes::Bytes) {
        use http_body_util::BodyExt;
        let mut request = hyper::Request::post(path).header(hyper::header::HOST, &self.host);
        if let Some(token) = &self.token {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request
            .body(http_body_util::Full::new(bytes::Bytes::from_static(body)))
            .expect("request");
        self.sender.ready().await.expect("connection ready");
        let response = self
            .sender
            .send_request(request)
            .await
            .expect("sending the request");
        let status = response.status();
        let body = response
            .into_body()
            .collect()
            .await
            .expect("reading the body")
            .to_bytes();
        (status, body)
    }
}

// ---------------------------------------------------------------------------
// Raw TCP: the floor of a network hop (the cross-node baseline)
// ---------------------------------------------------------------------------

/// A loopback TCP server that answers each length-prefixed request (a key
/// name and a message) with the named raw instance's reply.
pub async fn serve_raw_tcp(keys: RawKeys) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("binding");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let _ = stream.set_nodelay(true);
            let keys = keys.clone();
            tokio::spawn(async move {
                loop {
                    let Ok(key) = read_frame(&mut stream).await else {
                        return;
                    };
                    let Ok(message) = read_frame(&mut stream).await else {
                        return;
                    };
                    let key = String::from_utf8(key).expect("key name");
                    let reply = keys[&key].lock().await.call(&message).await;
                    if write_frame(&mut stream, &reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// A client connection of the raw TCP baseline.
pub struct RawTcpConn(TcpStream);

impl RawTcpConn {
    /// Connect to a [`serve_raw_tcp`] server.
    pub async fn open(addr: SocketAddr) -> RawTcpConn {
        let stream = TcpStream::connect(addr).await.expect("connecting");
        stream.set_nodelay(true).expect("nodelay");
        RawTcpConn(stream)
    }

    /// Call `key` with `message` and wait for the reply.
    pub async fn call(&mut self, key: &str, message: &[u8]) -> Vec<u8> {
        let mut request = Vec::with_capacity(8 + key.len() + message.len());
        request.extend_from_slice(&(key.len() as u32).to_le_bytes());
        request.extend_from_slice(key.as_bytes());
        request.extend_from_slice(&(message.len() as u32).to_le_bytes());
        request.extend_from_slice(message);
        self.0.write_all(&request).await.expect("writing");
        read_frame(&mut self.0).await.expect("reading the reply")
    }
}

async fn read_frame(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await?;
    let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
    stream.read_exact(&mut buf).await?;
    Ok(buf)
}

async fn write_frame(stream: &mut TcpStream, bytes: &[u8]) -> std::io::Result<()> {
    let mut frame = Vec::with_capacity(4 + bytes.len());
    frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    frame.extend_from_slice(bytes);
    stream.write_all(&frame).await
}

// ---------------------------------------------------------------------------
// Measuring helpers
// ---------------------------------------------------------------------------

/// Split `total` calls over `callers` as evenly as possible: caller `i`'s share.
pub fn share(total: u64, callers: usize, i: usize) -> u64 {
    let callers = callers as u64;
    total / callers + u64::from((i as u64) < total % callers)
}

/// Run `callers` tasks that together make `total` calls, caller `i` making
/// each with `call(i, n)`; returns the elapsed time and every call's latency.
pub async fn drive<F, Fut>(callers: usize, total: u64, call: F) -> (Duration, Vec<Duration>)
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    let start = Instant::now();
    let tasks: Vec<_> = (0..callers)
        .map(|i| {
            let call = call.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                for n in 0..share(total, callers, i) {
                    let t = Instant::now();
                    call(i, n).await;
                    latencies.push(t.elapsed());
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::with_capacity(total as usize);
    for task in tasks {
        latencies.extend(task.await.expect("caller task"));
    }
    (start.elapsed(), latencies)
}

/// The `q` quantile (0..=1) of `samples` (sorted in place).
pub fn quantile(samples: &mut [Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort_unstable();
    let i = ((samples.len() - 1) as f64 * q).round() as usize;
    samples[i]
}

/// This process's resident set size, in bytes.
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// This process's proportional set size, in bytes: each resident page
/// divided by how many times it is mapped, so a copy-on-write data page
/// shared by a thousand instances counts once, not a thousand times as in
/// the resident set size.
pub fn pss_bytes() -> u64 {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap_or_default();
    rollup
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// The machine's memory in use, in bytes: `MemTotal - MemAvailable` of
/// `/proc/meminfo` (what the kernel could not hand to a new program without
/// swapping; the page cache of files counts as available).
pub fn machine_used_bytes() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        meminfo
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kib| kib * 1024)
    };
    field("MemTotal:").saturating_sub(field("MemAvailable:"))
}

/// Resident bytes per mapping of this process, from `/proc/self/smaps`:
/// (start address, mapping size, resident bytes, name).
pub fn smaps() -> Vec<(u64, u64, u64, String)> {
    let text = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut out: Vec<(u64, u64, u64, String)> = Vec::new();
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if let Some((a, b)) = first.split_once('-')
            && let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16))
        {
            let name = line
                .split_whitespace()
                .nth(5)
                .unwrap_or("[anon]")
                .to_owned();
            out.push((a, b - a, 0, name));
        } else if let Some(kib) = line.strip_prefix("Rss:")
            && let Some(last) = out.last_mut()
        {
            last.2 = kib
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0)
                * 1024;
        }
    }
    out
}

/// Where the resident memory went between two [`smaps`] readings: the
/// largest growths, merged by mapping name and size class.
pub fn smaps_growth(
    before: &[(u64, u64, u64, String)],
    after: &[(u64, u64, u64, String)],
) -> String {
    let classify = |size: u64, name: &str| -> String {
        if name != "[anon]" {
            name.rsplit('/').next().unwrap_or(name).to_owned()
        } else {
            // Anonymous mappings by size class (power of two, rounded up).
            let class = size.next_power_of_two();
            if class >= 1 << 30 {
                format!("anon ≤{} GiB", class >> 30)
            } else if class >= 1 << 20 {
                format!("anon ≤{} MiB", class >> 20)
            } else {
                format!("anon ≤{} KiB", class >> 10)
            }
        }
    };
    let mut by: HashMap<String, (i64, usize)> = HashMap::new();
    for (_, size, rss, name) in before {
        let e = by.entry(classify(*size, name)).or_default();
        e.0 -= *rss as i64;
    }
    for (_, size, rss, name) in after {
        let e = by.entry(classify(*size, name)).or_default();
        e.0 += *rss as i64;
        e.1 += 1;
    }
    let mut v: Vec<_> = by
        .into_iter()
        .filter(|(_, (d, _))| d.abs() >= 1 << 20)
        .collect();
    v.sort_by_key(|(_, (d, _))| -d);
    v.iter()
        .map(|(k, (d, n))| format!("{k}: {:+.1} MiB in {n} mappings", *d as f64 / 1048576.0))
        .collect::<Vec<_>>()
        .join("; ")
}

/// How many memory mappings (VMAs) this process has.
pub fn map_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count())
        .unwrap_or(0)
}

/// The kernel's per-process mapping limit, `vm.max_map_count`.
pub fn max_map_count() -> u64 {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn mem_available() -> u64 {
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    info.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// Format a duration with a unit that suits it.
pub fn fmt_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns < 10_000 {
        format!("{:.2} µs", ns as f64 / 1e3)
    } else if ns < 10_000_000 {
        format!("{:.1} µs", ns as f64 / 1e3)
    } else if ns < 10_000_000_000 {
        format!("{:.1} ms", ns as f64 / 1e6)
    } else {
        format!("{:.2} s", ns as f64 / 1e9)
    }
}

// ---------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------

/// The PostgreSQL server of the benches, without a database
/// (`FIEF_BENCH_POSTGRES` overrides it).
pub const DEFAULT_POSTGRES: &str = "postgres://postgres@127.0.0.1:5432";

/// A connection to `url`, its connection task spawned.
pub async fn pg_connect(url: &str) -> Result<tokio_postgres::Client, String> {
    let connect = tokio_postgres::connect(url, tokio_postgres::NoTls);
    let (client, connection) = tokio::time::timeout(Duration::from_secs(3), connect)
        .await
        .map_err(|_| "no answer within 3 s".to_owned())?
        .map_err(|e| e.to_string())?;
    tokio::spawn(connection);
    Ok(client)
}

/// The throwaway database of one run, dropped by [`drop_database`].
pub struct Throwaway {
    /// The server, without a database.
    pub server: String,
    admin: tokio_postgres::Client,
    /// The database's name.
    pub database: String,
}

/// A fresh database on the server, or why there is none.
pub async fn throwaway_database(purpose: &str) -> Result<Throwaway, String> {
    let server = std::env::var("FIEF_BENCH_POSTGRES").unwrap_or_else(|_| DEFAULT_POSTGRES.into());
    let admin = pg_connect(&format!("{server}/postgres"))
        .await
        .map_err(|e| format!("{server} is not reachable: {e}"))?;
    let database = format!("fief_bench_{purpose}_{}", std::process::id());
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {database}"))
        .await
        .map_err(|e| format!("dropping an old {database}: {e}"))?;
    admin
        .batch_execute(&format!("CREATE DATABASE {database}"))
        .await
        .map_err(|e| format!("creating {database}: {e}"))?;
    Ok(Throwaway {
        server,
        admin,
        database,
    })
}

/// Drop the throwaway database `db`.
pub async fn drop_database(db: Throwaway) {
    if let Err(e) = db
        .admin
        .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", db.database))
        .await
    {
        eprintln!("could not drop the throwaway database {}: {e}", db.database);
    }
}
