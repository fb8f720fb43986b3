//! Starting a node: [`InstanceBuilder`] and [`Instance::start_embedded`].
//!
//! This file owns what a node is made of when it starts: its arbiter (a fresh
//! local one unless given), its clock, its peer listener and advertised
//! address, the wasmtime runtime and the guest threads, limbo, the cache and
//! the host-memory and CPU ledgers, the builder's modules (deployed before
//! the node joins, so it never owns a partition without them), and the
//! coordination thread. It must not route a message or make a coordination
//! decision itself: once started, the node is driven by `coordination.rs` and
//! serves through `routing.rs`.

use arc_swap::ArcSwap;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use fief_core::{Membership, MembershipConfig, NodeId};
use tokio::sync::watch;
use tokio_util::task::TaskTracker;

use super::coordination::{Coordination, supervise};
use super::{Instance, NodeShared};
use crate::arbiter::{Arbiter, EtcdArbiter, EtcdOptions, LocalArbiter, PostgresArbiter};
use crate::cache::CacheStore;
use crate::clock::{NodeClock, TokioClock};
use crate::config::{ModuleOptions, NodeConfig};
use crate::dedicated::DedicatedRuntime;
use crate::error::{Error, Result};
use crate::event_log::NodeEventObserver;
use crate::handoff::HandoffStates;
use crate::host_bytes::TenantLedgers;
use crate::key::{KeyLifeObserver, KeyServices};
use crate::limbo::Limbo;
use crate::pubsub::PubSub;
use crate::runtime::Runtime;
use crate::scheduler::GuestPool;
use crate::transport::PeerPool;

/// Chooses how an [`Instance`] starts: its arbiter, clock and peer listener.
pub struct InstanceBuilder {
    config: NodeConfig,
    arbiter: Option<Arc<dyn Arbiter>>,
    clock: Option<Arc<dyn NodeClock>>,
    peer_listener: Option<tokio::net::TcpListener>,
    observer: Option<KeyLifeObserver>,
    events: Option<NodeEventObserver>,
    storage: Option<Arc<dyn crate::storage::Backend>>,
    modules: Vec<(String, Vec<u8>, ModuleOptions)>,
    alarm_reconcile_period: Option<Duration>,
}

impl InstanceBuilder {
    /// Deploy a module before the node joins its cluster, so it never owns
    /// a partition without the module (repeatable).
    pub fn module(mut self, name: &str, wasm: Vec<u8>, options: ModuleOptions) -> Self {
        self.modules.push((name.to_owned(), wasm, options));
        self
    }

    /// Report every key process's start and end to `observer` (for
    /// single-ownership checkers and audits).
    pub fn observer(mut self, observer: KeyLifeObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Report leases granted, fences and every routed message handed to a
    /// guest to `events` (see [`NodeEvent`](crate::event_log::NodeEvent);
    /// `fief node --event-log` writes them to a file with
    /// [`crate::event_log::EventLog`]).
    pub fn events(mut self, events: NodeEventObserver) -> Self {
        self.events = Some(events);
        self
    }

    /// Keep keys' durable state in `backend` (default: as the
    /// configuration's `storage` says). Nodes of one namespace must share
    /// one store: give in-process nodes the same backend.
    pub fn storage(mut self, backend: Arc<dyn crate::storage::Backend>) -> Self {
        self.storage = Some(backend);
        self
    }

    /// Use `arbiter` (default: a fresh [`LocalArbiter`] of the node's own).
    pub fn arbiter(mut self, arbiter: Arc<dyn Arbiter>) -> Self {
        self.arbiter = Some(arbiter);
        self
    }

    /// Measure the lease on `clock` (default: [`TokioClock`]).
    pub fn clock(mut self, clock: Arc<dyn NodeClock>) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Serve peers on `listener` (default: bind `peer_listen` from the
    /// config, if set; otherwise the node takes no forwarded messages).
    pub fn peer_listener(mut self, listener: tokio::net::TcpListener) -> Self {
        self.peer_listener = Some(listener);
        self
    }

    /// Let the alarm loop look at the routing view only every `period` when
    /// nothing wakes it (default 250 ms; at least 10 ms, so the loop never
    /// spins). For tests: a long period shows that partitions taken wake the
    /// loop without it.
    #[doc(hidden)]
    pub fn alarm_reconcile_period(mut self, period: Duration) -> Self {
        self.alarm_reconcile_period = Some(period.max(Duration::from_millis(10)));
        self
    }

    /// Start the node. Returns once it holds a lease and knows the table, or
    /// after one lease TTL if the arbiter cannot be reached (the node keeps
    /// trying in the background and serves nothing meanwhile).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the configuration cannot work or a listener
    /// cannot be bound.
    pub async fn start(self) -> Result<Instance> {
        let config = self.config;
        config.validate()?;
        let timing = config.lease_timing()?;
        let clock: Arc<dyn NodeClock> = self.clock.unwrap_or_else(|| Arc::new(TokioClock::new()));
        // An etcd arbiter's modules are kept in the PostgreSQL storage:
        // refuse before opening any store.
        let etcd_modules = match &self.arbiter {
            None if config.arbiter.starts_with("etcd://") => Some(etcd_module_store(&config)?),
            _ => None,
        };
        let backend = match self.storage {
            Some(backend) => backend,
            None => crate::storage::open(&config).await?,
        };
        let arbiter: Arc<dyn Arbiter> = match (self.arbiter, etcd_modules) {
            (Some(arbiter), _) => arbiter,
            (None, _) if config.arbiter == "local" => {
                // A fresh embedded arbiter on a store that outlived an
                // earlier run: grant tokens above every one it has seen.
                let seen = backend.highest_fence_token().await.map_err(|e| {
                    Error::Config(format!(
                        "cannot read the storage's fence tokens ({}): {e}",
                        backend.describe()
                    ))
                })?;
                Arc::new(
                    LocalArbiter::new(clock.clone(), config.partition_count()).numbered_after(seen),
                )
            }
            (None, Some(modules_url)) => {
                let seen = backend.highest_fence_token().await.map_err(|e| {
                    Error::Config(format!(
                        "cannot read the storage's fence tokens ({}): {e}",
                        backend.describe()
                    ))
                })?;
                let modules = PostgresArbiter::connect(
                    &modules_url,
                    &config.namespace,
                    config.partition_count(),
                )
                .await
                .map_err(|e| {
                    Error::Config(format!(
                        "cannot use the etcd arbiter's module store (the storage's database): {e}"
                    ))
                })?;
                let options = EtcdOptions {
                    request_timeout: etcd_request_timeout(config.renew_interval),
                    numbered_after: seen,
                };
                Arc::new(
                    EtcdArbiter::connect(
                        &config.arbiter,
                        &config.namespace,
                        config.partition_count(),
                        options,
                        Arc::new(modules),
                    )
                    .await
                    .map_err(|e| Error::Config(format!("cannot use the arbiter: {e}")))?,
                )
            }
            (None, None) => Arc::new(
                PostgresArbiter::connect(
                    &config.arbiter,
                    &config.namespace,
                    config.partition_count(),
                )
                .await
                .map_err(|e| Error::Config(format!("cannot use the arbiter: {e}")))?,
            ),
        };
        let metrics = crate::metrics::Metrics::new();
        let storage = crate::storage::writer::StorageWriter::start(backend, metrics.storage());
        let alarms = Arc::new(super::alarms::NodeAlarms::new(
            metrics.alarms(),
            self.alarm_reconcile_period
                .unwrap_or(super::alarms::RECONCILE_PERIOD),
        ));
        storage.set_alarm_sink(alarms.clone());
        let peer_listener = match (self.peer_listener, config.peer_listen) {
            (Some(listener), _) => Some(listener),
            (None, Some(addr)) => {
                Some(tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                    Error::Config(format!("cannot listen for peers on {addr}: {e}"))
                })?)
            }
            (None, None) => None,
        };
        let peer_addr = match &peer_listener {
            // The address registered for peers: the advertised one if set
            // (peers reach the node through a proxy), else the listener's.
            Some(_) if config.peer_advertise.is_some() => config.peer_advertise.clone(),
            Some(l) => Some(
                l.local_addr()
                    .map_err(|e| Error::Config(format!("peer listener: {e}")))?
                    .to_string(),
            ),
            None => None,
        };
        let runtime = Runtime::new(&config)?;
        // Guest code runs on threads of its own, never on this runtime's
        // workers (which serve the API and the peer links).
        let guest_pool = GuestPool::start(
            crate::scheduler::guest_threads(config.guest_threads),
            config.guest_thread_nice,
            config.guest_thread_policy,
        )?;
        let limbo = Limbo::start(runtime.engine.clone());
        let cache_max_bytes =
            usize::try_from(config.cache_max_bytes.as_u64()).unwrap_or(usize::MAX);
        let cache_tenant_max_bytes =
            usize::try_from(config.cache_max_bytes_per_tenant.as_u64()).unwrap_or(usize::MAX);
        let cache_namespace_max_bytes =
            usize::try_from(config.cache_max_bytes_per_namespace.as_u64()).unwrap_or(usize::MAX);
        let host_bytes_per_tenant =
            usize::try_from(config.max_host_bytes_per_tenant.as_u64()).unwrap_or(usize::MAX);
        let tenant_cpu = crate::cpu_budget::TenantCpuMeters::new(
            config
                .cpu_budget_per_tenant
                .map(|cores| (cores, config.cpu_budget_per_tenant_window)),
        );
        let membership = Membership::new(MembershipConfig {
            me: NodeId::new(&config.node_id),
            timing,
            partitions: config.partition_count(),
            step_timeout: config.call_timeout,
        });
        let peers = PeerPool::new(
            &config.namespace,
            &config.node_id,
            config.max_message_size.as_u64() as usize,
            crate::peer_auth::PeerSecurity::load(&config)?,
        );
        let guest = guest_pool.handle().clone();
        let fence_gate = membership.gate();
        let pubsub = PubSub::new(&config.node_id);
        let epoch_tick = config.epoch_tick;
        let shared = Arc::new_cyclic(|node: &Weak<NodeShared>| NodeShared {
            services: Arc::new(KeyServices {
                node_id: NodeId::new(&config.node_id),
                fence_gate,
                config,
                runtime,
                guest,
                pubsub,
                connections: crate::connections::Connections::default(),
                tasks: TaskTracker::new(),
                limbo,
                clock,
                host_bytes: TenantLedgers::new(host_bytes_per_tenant),
                tenant_cpu,
                // The callers' workers: the runtime the node starts on runs
                // its HTTP API and peer links.
                inline_shares: crate::inline_share::InlineShares::new(
                    tokio::runtime::Handle::current().metrics(),
                    epoch_tick,
                ),
                metrics,
                pool_freed: tokio::sync::Notify::new(),
                start_rendezvous: Mutex::new(None),
                guest_memory: Arc::default(),
                storage,
                observer: self.observer,
                events: self.events,
                node: node.clone(),
            }),
            view: ArcSwap::new(membership.view()),
            membership: Mutex::new(membership),
            executing: Mutex::new(()),
            move_states: Mutex::new(HashMap::new()),
            refreshes: Mutex::new(HashMap::new()),
            leave_waiter: Mutex::new(None),
            wake: tokio::sync::Notify::new(),
            main: tokio::runtime::Handle::current(),
            coordination_rt: std::sync::OnceLock::new(),
            ready: watch::channel(false).0,
            peers,
            arbiter,
            members: RwLock::new(BTreeMap::new()),
            alarms,
            peer_addr,
            modules: ArcSwap::default(),
            deploys: super::deploy::Deploys::default(),
            fences: Mutex::new(0),
            arbiter_regression: Mutex::new(None),
            handoffs: Mutex::new(HandoffStates::default()),
            leave_losses: Mutex::new(Vec::new()),
            coordination_crash: std::sync::atomic::AtomicBool::new(false),
            route_delay_ms: std::sync::atomic::AtomicU64::new(0),
            stop_requested: watch::channel(false).0,
            cache: Mutex::new(CacheStore::new(
                cache_max_bytes,
                cache_tenant_max_bytes,
                cache_namespace_max_bytes,
            )),
            history: Mutex::new(crate::dashboard_history::History::new(
                crate::dashboard_history::HISTORY_SAMPLES,
            )),
        });
        // Builder modules go through the module store like any deploy; then
        // the node loads everything the store has before it joins, so it
        // never owns a partition without its modules.
        for (name, wasm, options) in self.modules {
            shared.deploy_at_start(&name, wasm.into(), options).await?;
        }
        if let Err(e) = shared.sync_modules().await {
            tracing::warn!(node = %shared.node_id, error = %e, "cannot load the stored modules at start; the module follower keeps trying");
        }
        let alarm_loop =
            super::AbortOnDrop(tokio::spawn(super::alarms::run(Arc::downgrade(&shared))));
        let topics_loop =
            super::AbortOnDrop(tokio::spawn(super::topics::run(Arc::downgrade(&shared))));
        let sockets_loop =
            super::AbortOnDrop(tokio::spawn(super::sockets::run(Arc::downgrade(&shared))));
        let history_loop = super::AbortOnDrop(tokio::spawn(crate::dashboard_history::run(
            Arc::downgrade(&shared),
        )));
        let peer_server = peer_listener.map(|listener| {
            tokio::spawn(crate::transport::serve(Arc::downgrade(&shared), listener))
        });
        let mut ready_rx = shared.ready.subscribe();
        // The coordination loop runs on a thread of its own, so its timing
        // does not depend on how busy this runtime is with guest code; what
        // it starts that must run here goes through `main`.
        let coordination = {
            let (shared, main) = (shared.clone(), tokio::runtime::Handle::current());
            DedicatedRuntime::start("fief-coordinate", move || supervise(shared, main)).map_err(
                |e| Error::Internal(format!("cannot start the coordination thread: {e}")),
            )?
        };
        let ttl = shared.config.lease_ttl;
        let _ = tokio::time::timeout(ttl, ready_rx.wait_for(|ready| *ready)).await;
        tracing::info!(node = %shared.node_id, namespace = %shared.config.namespace, "node started");
        Ok(Instance {
            shared,
            coordination: Coordination(coordination),
            peer_server,
            alarm_loop,
            topics_loop,
            sockets_loop,
            history_loop,
            _guest_pool: guest_pool,
        })
    }
}

/// The PostgreSQL URL an etcd arbiter keeps its modules at: the storage's
/// (etcd is not a blob store).
///
/// # Errors
///
/// [`Error::Config`] when the storage is not PostgreSQL.
fn etcd_module_store(config: &NodeConfig) -> Result<String> {
    match config.storage.as_deref() {
        Some(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            Ok(url.to_owned())
        }
        _ => Err(Error::Config(crate::config::ETCD_NEEDS_POSTGRES.to_owned())),
    }
}

/// Each HTTP request of an etcd arbiter is bounded well below the renewal
/// interval (a renewal is two requests, and a hung endpoint costs one
/// timeout before the next is tried), within 100 ms to 2 s.
fn etcd_request_timeout(renew_interval: Duration) -> Duration {
    (renew_interval / 3).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

impl Instance {
    /// Start a node with its own in-process arbiter (the embedded default):
    /// it is the namespace's only node and owns every partition.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] if the configuration cannot work.
    pub async fn start_embedded(config: NodeConfig) -> Result<Instance> {
        Instance::builder(config).start().await
    }

    /// A builder, to choose the arbiter, the clock and the peer listener.
    pub fn builder(config: NodeConfig) -> InstanceBuilder {
        InstanceBuilder {
            config,
            arbiter: None,
            clock: None,
            peer_listener: None,
            observer: None,
            events: None,
            storage: None,
            modules: Vec::new(),
            alarm_reconcile_period: None,
        }
    }
}
