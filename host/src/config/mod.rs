//! Configuration of a node and of a module, with the checks that refuse a
//! configuration that cannot work.
//!
//! [`NodeConfig`] (this file) is read from a TOML file, `FIEF_*` environment
//! variables and flags (the CLI layers them); [`ModuleOptions`] come with a
//! deploy and [`ModuleCeilings`] bound them (`module.rs`); key and module
//! names are checked in `names.rs`, a granted host directory ([`DirGrant`])
//! in `dir.rs`. Durations are written as `5s`, `500ms`;
//! sizes as `64MiB`. Everything an outsider can make the node allocate has a
//! named limit here. This module must not read files or the environment
//! (the CLI does) nor apply a configuration (the node does).

pub(crate) mod compile;
mod cpu;
mod dir;
mod etcd_url;
pub(crate) mod http;
mod memory_init;
mod module;
mod names;
pub mod option_table;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use fief_core::fence::DEFAULT_KILL_BOUND;
use fief_core::lease::{
    DEFAULT_FENCE_MARGIN, DEFAULT_LEASE_TTL, DEFAULT_MAX_CLOCK_DRIFT_PPM, DEFAULT_RENEW_INTERVAL,
};
use fief_core::partition::DEFAULT_PARTITIONS;
use fief_core::{FenceBudget, LeaseTiming, PartitionCount};
use serde::{Deserialize, Serialize};

/// Byte sizes in options and config (`64MiB`).
pub use bytesize::ByteSize;

use crate::error::{Error, Result};
pub use cpu::{CpuCores, CpuShare, GuestThreadPolicy};
pub use dir::DirGrant;
pub use etcd_url::EtcdUrl;
pub use memory_init::MemoryInit;
pub use module::{ModuleCeilings, ModuleOptions};
pub use names::{validate_key, validate_module_name, validate_qualified_module_name};

/// Longest key name, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// Most WebSocket connections a node may be configured to hold
/// (`max_connections`): each holds two tasks, buffers and a file
/// descriptor.
pub const MAX_CONNECTIONS: u32 = 1_000_000;

/// The largest weight `tenant_cpu_weights` may give a tenant.
pub const MAX_TENANT_CPU_WEIGHT: u32 = 1000;

/// Most tenants `tenant_cpu_weights` may name.
pub const MAX_TENANT_CPU_WEIGHTS: usize = 10_000;

/// Why a node on an etcd arbiter needs PostgreSQL storage (the refusal's
/// message, at validation and at start).
pub const ETCD_NEEDS_POSTGRES: &str = "an etcd arbiter keeps no modules (etcd is not a blob \
    store): give --storage postgres://… where the modules and the keys' durable state are kept";

/// Configuration of one node (one instance of a namespace).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// The namespace: every node of one cluster uses the same.
    pub namespace: String,
    /// This node's id, unique within the namespace.
    pub node_id: String,
    /// The arbiter: `local` (in-process, the embedded default), a
    /// PostgreSQL URL (`postgres://user@host:5432/db`), or an etcd cluster
    /// (`etcd://host:port[,host:port…]/prefix`, which needs `storage` to be
    /// a `postgres://` URL: the modules are kept there).
    pub arbiter: String,
    /// Address of the HTTP API.
    pub listen: SocketAddr,
    /// Address of the node-to-node transport; `None` for a node that takes
    /// no forwarded messages (a single embedded node).
    pub peer_listen: Option<SocketAddr>,
    /// The address (`host:port`) peers are told to reach this node at, in
    /// its lease at the arbiter; `None` registers the address `peer_listen`
    /// is bound to. Set it when peers reach the node through a proxy, NAT or
    /// a name. Only used with a peer listener.
    pub peer_advertise: Option<String>,
    /// Lease time-to-live at the arbiter.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// How often the lease is renewed.
    #[serde(with = "humantime_serde")]
    pub renew_interval: Duration,
    /// How long before the arbiter's expiry the node fences itself.
    #[serde(with = "humantime_serde")]
    pub fence_margin: Duration,
    /// Bound on clock-rate drift between node and arbiter, parts per million.
    pub max_clock_drift_ppm: u32,
    /// Partitions in the namespace; fixed for its lifetime.
    pub partitions: u32,
    /// Period of the epoch ticker that interrupts running guests.
    #[serde(with = "humantime_serde")]
    pub epoch_tick: Duration,
    /// Bound on the time from a kill to "no guest code of that key runs".
    #[serde(with = "humantime_serde")]
    pub kill_bound: Duration,
    /// Largest message or reply accepted, in bytes.
    pub max_message_size: ByteSize,
    /// Most key processes live at once on this node, over all modules,
    /// besides those retiring to make room (the instance pool holds this
    /// many and a reserve for them: `docs/eviction.md`). At it, a new key
    /// evicts the least recently used idle key of any module.
    pub max_live_keys: u32,
    /// Largest linear memory any key may have; a module's `memory_limit` must
    /// not exceed it (it sizes each slot of the instance pool).
    pub max_memory_per_key: ByteSize,
    /// Linear memory the node's live keys may hold together before each new
    /// activation evicts the least recently used idle key (of any module)
    /// to make room (`docs/eviction.md`): a soft budget, never a refusal.
    /// At least `max_memory_per_key`. `None` (the default): no such budget
    /// (the pool's slots and the keys' `memory_limit`s bound memory).
    pub max_guest_memory: Option<ByteSize>,
    /// Most WebSocket connections this node holds (`docs/realtime.md`);
    /// a connect past it is refused (503). Default 10 000, at most
    /// [`MAX_CONNECTIONS`].
    pub max_connections: u32,
    /// Most WebSocket connections one tenant's clients may hold on this
    /// node; a connect past it is refused (429). Default 1 000, at most
    /// `max_connections`.
    pub max_connections_per_tenant: u32,
    /// How long a call waits for a reply before it fails with `timeout`,
    /// counted from when the call first waits: a call that runs on its
    /// caller's task (an idle key) may first run up to one and a half epoch
    /// ticks.
    #[serde(with = "humantime_serde")]
    pub call_timeout: Duration,
    /// Longest a deploy waits for its component to compile; a slower one is
    /// refused (a compile bomb within the static limits). With a
    /// `compile_worker` the worker is killed at it; compiling in-process
    /// (no worker) the compile goes on in the background, holding the
    /// node's compile slot, until it ends.
    #[serde(with = "humantime_serde")]
    pub compile_timeout: Duration,
    /// The program that compiles components in a process of its own, run as
    /// `PROGRAM compile-worker` ([`crate::compile_worker`]): the node kills it
    /// at `compile_timeout` and caps its memory at `compile_memory_limit`,
    /// so a compile bomb costs the node neither memory nor a stuck compile
    /// slot. `fief node` sets it to its own executable; `None` (the
    /// library's default) compiles on a thread of the node's process.
    pub compile_worker: Option<PathBuf>,
    /// The address space a compile worker may use (its `RLIMIT_AS`); a
    /// compile needing more is refused with this limit named. Only with a
    /// `compile_worker`.
    pub compile_memory_limit: ByteSize,
    /// Directory of compiled components, keyed by content hash and engine
    /// settings, so a restarted node does not recompile; `None` compiles
    /// every deploy. It must be writable only by the node's user.
    pub compile_cache: Option<PathBuf>,
    /// Bound on the coherent cache's entries this node holds (values, names
    /// and bookkeeping); least recently used entries are evicted beyond it.
    pub cache_max_bytes: ByteSize,
    /// Bound on the coherent cache's entries of one tenant (its namespaces
    /// `tenant/…`), at most `cache_max_bytes`: a tenant evicts only its own
    /// entries, so this keeps one tenant from holding the whole cache.
    pub cache_max_bytes_per_tenant: ByteSize,
    /// Bound on the coherent cache's entries of one namespace, at most its
    /// tenant's bound: past it a put evicts only that namespace's own
    /// entries, so one namespace cannot push out its siblings'.
    pub cache_max_bytes_per_namespace: ByteSize,
    /// Host memory the key processes of one tenant (the modules `tenant/…`;
    /// modules of no tenant count as one) may make this node hold outside
    /// their linear memories, together: queued messages, timer tags,
    /// subscriptions, waiting handoff states ([`crate::host_bytes`]). Each
    /// key is also held to its module's `max_host_bytes_per_key`.
    pub max_host_bytes_per_tenant: ByteSize,
    /// A file holding the cluster secret (16 bytes or more, surrounding
    /// whitespace ignored): peers prove they know it before any request is
    /// served (see [`crate::transport`]). Every node of a cluster uses the
    /// same; `None`: peer links are not authenticated.
    pub cluster_secret_file: Option<PathBuf>,
    /// TLS for peer links (certificate, key, and the CA that signed every
    /// node's certificate); `None`: plain TCP. See [`PeerTls`].
    pub peer_tls: Option<PeerTls>,
    /// Ceilings over every module's options, for every deploy (an open
    /// node's, the admin's and a tenant's); tenant caps only lower them.
    pub module_ceilings: ModuleCeilings,
    /// How long an API client has to send a request's head (request line
    /// and headers): on a new connection from when it is accepted (the TLS
    /// handshake included), on a kept-alive one from the head's first byte.
    /// Past it the connection is closed ([`crate::http_limits`]).
    #[serde(with = "humantime_serde")]
    pub http_header_read_timeout: Duration,
    /// How long a kept-alive API connection may wait for its next request
    /// before it is closed.
    #[serde(with = "humantime_serde")]
    pub http_idle_timeout: Duration,
    /// How long an API client has to send a request's body, from the end of
    /// its head, plus one second per
    /// [`MIN_BODY_RATE`](crate::http_limits::MIN_BODY_RATE) bytes it sent:
    /// a client that stalls or dribbles its body is cut off past it.
    #[serde(with = "humantime_serde")]
    pub http_body_read_timeout: Duration,
    /// Most API connections open at once; `None`: the lowest of 4096, three
    /// quarters of the open-file limit, and the limit less the descriptors
    /// the node keeps for everything else. At the cap the connection idle
    /// the longest is closed to admit a new one; with every connection busy
    /// the new one is answered `503` ([`crate::http_limits`]).
    pub http_max_connections: Option<u32>,
    /// Threads that run guest code (every key task; see
    /// [`crate::scheduler`]), apart from the API's and the coordination
    /// loop's; 0: one per core.
    pub guest_threads: u32,
    /// The niceness the guest threads run at (0 to 19; default 10): under
    /// contention for the cores, the API, the peer links and the lease
    /// threads (at the process's own niceness) are scheduled ahead of guest
    /// code, so a node whose keys keep every core busy still answers and
    /// renews. 0 runs guest code at the process's priority. Raising it needs
    /// no privilege; a thread cannot lower it again.
    pub guest_thread_nice: u8,
    /// How the guest threads give way to the node's other threads: `nice`
    /// (the default: at `guest_thread_nice`, with a short OS time
    /// slice) or `idle` (Linux `SCHED_IDLE`: only on cores nothing else
    /// wants; for a node alone on its machine). See [`GuestThreadPolicy`].
    pub guest_thread_policy: GuestThreadPolicy,
    /// How each key's memory gets its module's initial data: `copy-on-write`
    /// (the default: the module's data image mapped, pages shared until
    /// written) or `copy` (the data segments copied at each activation: for
    /// small images and heavy activation churn). See [`MemoryInit`].
    pub memory_init: MemoryInit,
    /// Cores one tenant's keys (the modules `tenant/…`; modules of no tenant
    /// count as one) may use together on this node over
    /// `cpu_budget_per_tenant_window` (`1500m`, `1.5`); past it they are
    /// throttled, not killed ([`crate::cpu_budget`]). `None` (the default):
    /// tenants share the guest threads by fair turns, with no budget.
    pub cpu_budget_per_tenant: Option<CpuCores>,
    /// The window `cpu_budget_per_tenant` is measured over (10 ms to 1
    /// minute; default 1 s): a tenant may use up to one window's worth in a
    /// burst.
    #[serde(with = "humantime_serde")]
    pub cpu_budget_per_tenant_window: Duration,
    /// Each named tenant's weight when tenants contend for the guest
    /// threads (1 to 1000; a tenant not named, and modules of no tenant,
    /// weigh 1): a tenant of weight 3 gets three turns to one of weight 1's
    /// ([`crate::scheduler`]). Weights share the cores only while they are
    /// contended; a budget over time is `cpu_budget_per_tenant`.
    pub tenant_cpu_weights: std::collections::BTreeMap<String, u32>,
    /// Where keys' durable state is kept (`fief:key/storage`): `embedded`
    /// (a redb file, `state.redb` in `data_dir`; in memory without a
    /// `data_dir`), `memory` (in memory, lost when the node stops: for
    /// tests), or a `postgres://` URL. `None` (the default): the arbiter's
    /// PostgreSQL database if the arbiter is one, else `embedded` (an etcd
    /// arbiter needs a `postgres://` URL: its modules are kept there too).
    pub storage: Option<String>,
    /// The node's own files (the embedded storage's `state.redb`). `None`:
    /// nothing is written to disk, and embedded storage is in memory.
    pub data_dir: Option<std::path::PathBuf>,
    /// Most bytes a tenant may store (every key of every module of it,
    /// names plus values), as this node last learnt from the store; a
    /// `put` past it fails with `limit`. Default 1 GiB.
    pub max_storage_bytes_per_tenant: ByteSize,
}

/// TLS for peer links: this node's certificate and key, and the CA that
/// signed every node's certificate (a node's certificate must name the
/// host or IP address its peers dial, as in `peer_advertise`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerTls {
    /// This node's certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The cluster's CA certificate(s) (PEM): peers are trusted when it
    /// signed theirs.
    pub ca: PathBuf,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            namespace: "default".to_owned(),
            node_id: "node-1".to_owned(),
            arbiter: "local".to_owned(),
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            peer_listen: None,
            peer_advertise: None,
            lease_ttl: DEFAULT_LEASE_TTL,
            renew_interval: DEFAULT_RENEW_INTERVAL,
            fence_margin: DEFAULT_FENCE_MARGIN,
            max_clock_drift_ppm: DEFAULT_MAX_CLOCK_DRIFT_PPM,
            partitions: DEFAULT_PARTITIONS,
            epoch_tick: Duration::from_millis(1),
            kill_bound: DEFAULT_KILL_BOUND,
            max_message_size: ByteSize::mib(1),
            max_live_keys: 10_000,
            max_memory_per_key: ByteSize::mib(256),
            call_timeout: Duration::from_secs(5),
            compile_timeout: Duration::from_secs(300),
            compile_worker: None,
            compile_memory_limit: compile::DEFAULT_MEMORY_LIMIT,
            compile_cache: None,
            cache_max_bytes: ByteSize::mib(64),
            cache_max_bytes_per_tenant: ByteSize::mib(16),
            cache_max_bytes_per_namespace: ByteSize::mib(16),
            max_host_bytes_per_tenant: ByteSize::mib(512),
            cluster_secret_file: None,
            peer_tls: None,
            module_ceilings: ModuleCeilings::default(),
            http_header_read_timeout: http::DEFAULT_HEADER_READ_TIMEOUT,
            http_idle_timeout: http::DEFAULT_IDLE_TIMEOUT,
            http_body_read_timeout: http::DEFAULT_BODY_READ_TIMEOUT,
            http_max_connections: None,
            guest_threads: 0,
            guest_thread_nice: 10,
            guest_thread_policy: GuestThreadPolicy::Nice,
            memory_init: MemoryInit::CopyOnWrite,
            cpu_budget_per_tenant: None,
            cpu_budget_per_tenant_window: Duration::from_secs(1),
            tenant_cpu_weights: std::collections::BTreeMap::new(),
            max_guest_memory: None,
            max_connections: 10_000,
            max_connections_per_tenant: 1_000,
            storage: None,
            data_dir: None,
            max_storage_bytes_per_tenant: ByteSize::gib(1),
        }
    }
}

impl NodeConfig {
    /// The lease timing, checked.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] naming the numbers when the timing cannot be safe.
    pub fn lease_timing(&self) -> Result<LeaseTiming> {
        LeaseTiming::new(
            self.lease_ttl,
            self.renew_interval,
            self.fence_margin,
            self.max_clock_drift_ppm,
        )
        .map_err(|e| Error::Config(e.to_string()))
    }

    /// The fence budget of this node.
    pub fn fence_budget(&self) -> FenceBudget {
        FenceBudget {
            kill_bound: self.kill_bound,
        }
    }

    /// Check the whole configuration.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] saying which value is wrong and why.
    pub fn validate(&self) -> Result<()> {
        let timing = self.lease_timing()?;
        let bad = |m: String| Err(Error::Config(m));
        if self.namespace.is_empty() || self.node_id.is_empty() {
            return bad("namespace and node_id must not be empty".to_owned());
        }
        PartitionCount::new(self.partitions).map_err(Error::Config)?;
        if self.arbiter.starts_with("etcd://") {
            EtcdUrl::parse(&self.arbiter).map_err(Error::Config)?;
            if let Some(storage) = self.storage.as_deref()
                && !storage.starts_with("postgres://")
                && !storage.starts_with("postgresql://")
            {
                return bad(format!("storage `{storage}`: {ETCD_NEEDS_POSTGRES}"));
            }
        } else if self.arbiter != "local"
            && !self.arbiter.starts_with("postgres://")
            && !self.arbiter.starts_with("postgresql://")
        {
            return bad(format!(
                "arbiter {:?} is none of `local`, a postgres:// URL or an \
                 etcd://host:port[,host:port…]/prefix URL",
                self.arbiter
            ));
        }
        if let Some(storage) = &self.storage
            && !matches!(storage.as_str(), "embedded" | "memory")
            && !storage.starts_with("postgres://")
            && !storage.starts_with("postgresql://")
        {
            return bad(format!(
                "storage {storage:?} is none of `embedded`, `memory` or a postgres:// URL"
            ));
        }
        // Nodes of a PostgreSQL arbiter form a cluster, and a key moves
        // between them: a store of this node's own would let a moved key
        // start empty on its new owner, its acknowledged writes left behind.
        if self.arbiter != "local"
            && let Some(storage) = self.storage.as_deref()
            && matches!(storage, "embedded" | "memory")
        {
            return bad(format!(
                "storage `{storage}` keeps keys' state on this node only, but the arbiter is a \
                 shared PostgreSQL database, so keys move between nodes and a moved key would \
                 not find its state; leave `storage` unset (the arbiter's database) or give a \
                 postgres:// URL every node of the namespace shares"
            ));
        }
        if let Some(addr) = &self.peer_advertise
            && !addr
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok())
        {
            return bad(format!(
                "peer_advertise {addr:?} is not host:port (for example 10.0.0.5:7071)"
            ));
        }
        if self.epoch_tick.is_zero() || self.epoch_tick > Duration::from_millis(100) {
            return bad(format!(
                "epoch_tick ({:?}) must be above zero and at most 100ms: it bounds how fast a running guest can be killed",
                self.epoch_tick
            ));
        }
        if self.kill_bound < self.epoch_tick * 2 {
            return bad(format!(
                "kill_bound ({:?}) must be at least two epoch ticks ({:?}): a running guest notices a kill at the next tick",
                self.kill_bound,
                self.epoch_tick * 2
            ));
        }
        if self.guest_thread_nice > 19 {
            return bad(format!(
                "guest_thread_nice ({}) must be between 0 and 19 (Linux niceness)",
                self.guest_thread_nice
            ));
        }
        if self.cpu_budget_per_tenant_window < Duration::from_millis(10)
            || self.cpu_budget_per_tenant_window > Duration::from_secs(60)
        {
            return bad(format!(
                "cpu_budget_per_tenant_window ({:?}) must be between 10ms and 1m",
                self.cpu_budget_per_tenant_window
            ));
        }
        if self.max_connections == 0 || self.max_connections > MAX_CONNECTIONS {
            return bad(format!(
                "max_connections ({}) must be between 1 and {MAX_CONNECTIONS}",
                self.max_connections
            ));
        }
        if self.max_connections_per_tenant == 0
            || self.max_connections_per_tenant > self.max_connections
        {
            return bad(format!(
                "max_connections_per_tenant ({}) must be between 1 and max_connections ({})",
                self.max_connections_per_tenant, self.max_connections
            ));
        }
        if let Some(budget) = self.max_guest_memory
            && budget < self.max_memory_per_key
        {
            return bad(format!(
                "max_guest_memory ({budget}) must be at least max_memory_per_key ({}): one key \
                 must fit",
                self.max_memory_per_key
            ));
        }
        if self.tenant_cpu_weights.len() > MAX_TENANT_CPU_WEIGHTS {
            return bad(format!(
                "tenant_cpu_weights names {} tenants; at most {MAX_TENANT_CPU_WEIGHTS}",
                self.tenant_cpu_weights.len()
            ));
        }
        for (tenant, weight) in &self.tenant_cpu_weights {
            if validate_module_name(tenant).is_err() {
                return bad(format!(
                    "tenant_cpu_weights: tenant name {tenant:?} must be 1 to 128 letters, digits, '_', '-' or '.' (no '/')"
                ));
            }
            if !(1..=MAX_TENANT_CPU_WEIGHT).contains(weight) {
                return bad(format!(
                    "tenant_cpu_weights: {tenant}'s weight ({weight}) must be between 1 and {MAX_TENANT_CPU_WEIGHT}"
                ));
            }
        }
        if self.max_host_bytes_per_tenant < self.max_message_size {
            return bad(format!(
                "max_host_bytes_per_tenant ({}) must be at least max_message_size ({}): a \
                 tenant's key must be able to hold one message",
                self.max_host_bytes_per_tenant, self.max_message_size
            ));
        }
        if self.cache_max_bytes_per_namespace.as_u64() < 4096 {
            return bad(format!(
                "cache_max_bytes_per_namespace ({}) must be at least 4 KiB",
                self.cache_max_bytes_per_namespace
            ));
        }
        if self.cache_max_bytes_per_tenant.as_u64() < 4096 {
            return bad(format!(
                "cache_max_bytes_per_tenant ({}) must be at least 4 KiB",
                self.cache_max_bytes_per_tenant
            ));
        }
        if self.cache_max_bytes.as_u64() < 4096 {
            return bad(format!(
                "cache_max_bytes ({}) must be at least 4 KiB",
                self.cache_max_bytes
            ));
        }
        if self.max_live_keys == 0 {
            return bad("max_live_keys must be at least 1".to_owned());
        }
        if self.max_message_size.as_u64() == 0 || self.max_message_size > ByteSize::mib(64) {
            return bad(format!(
                "max_message_size ({}) must be between 1 byte and 64 MiB",
                self.max_message_size
            ));
        }
        if self.max_memory_per_key < ByteSize::mib(1) || self.max_memory_per_key > ByteSize::gib(4)
        {
            return bad(format!(
                "max_memory_per_key ({}) must be between 1 MiB and 4 GiB",
                self.max_memory_per_key
            ));
        }
        let c = &self.module_ceilings;
        if c.cpu_limit < self.epoch_tick || c.idle_timeout.is_zero() || c.max_live_keys == 0 {
            return bad(format!(
                "module_ceilings: cpu_limit ({:?}) must be at least one epoch tick ({:?}), and \
                 idle_timeout and max_live_keys above zero",
                c.cpu_limit, self.epoch_tick
            ));
        }
        self.validate_http()?;
        self.validate_compile()?;
        // The default module options must fit this node, or nothing deploys.
        ModuleOptions::default()
            .validate_for(self, &timing)
            .map_err(|e| match e {
                Error::InvalidOptions(why) => Error::Config(format!(
                    "the default module options do not fit this node: {why}"
                )),
                other => other,
            })
    }

    /// The partition count, as the core's type.
    pub fn partition_count(&self) -> PartitionCount {
        PartitionCount::new(self.partitions).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        NodeConfig::default().validate().unwrap();
    }

    #[test]
    fn a_config_file_names_the_guest_thread_policy() {
        let config: NodeConfig =
            toml::from_str("guest_thread_policy = \"idle\"").expect("the policy is read");
        assert_eq!(config.guest_thread_policy, GuestThreadPolicy::Idle);
        let default: NodeConfig = toml::from_str("").expect("an empty file");
        assert_eq!(default.guest_thread_policy, GuestThreadPolicy::Nice);
        let why = toml::from_str::<NodeConfig>("guest_thread_policy = \"realtime\"")
            .expect_err("no such policy")
            .to_string();
        assert!(why.contains("realtime") && why.contains("idle"), "{why}");
    }

    #[test]
    fn a_config_file_names_how_memory_is_initialised() {
        let config: NodeConfig = toml::from_str("memory_init = \"copy\"").expect("it is read");
        assert_eq!(config.memory_init, MemoryInit::Copy);
        let default: NodeConfig = toml::from_str("").expect("an empty file");
        assert_eq!(default.memory_init, MemoryInit::CopyOnWrite);
        let why = toml::from_str::<NodeConfig>("memory_init = \"mmap\"")
            .expect_err("no such setting")
            .to_string();
        assert!(
            why.contains("mmap") && why.contains("copy-on-write"),
            "{why}"
        );
    }

    #[test]
    fn an_etcd_arbiter_needs_a_well_formed_url_and_postgres_storage() {
        let with = |arbiter: &str, storage: Option<&str>| NodeConfig {
            arbiter: arbiter.to_owned(),
            storage: storage.map(str::to_owned),
            ..NodeConfig::default()
        };
        let url = "etcd://10.0.0.1:2379,10.0.0.2:2379/fief";
        with(url, Some("postgres://postgres@127.0.0.1:5432/fief"))
            .validate()
            .unwrap();
        let err = with(url, Some("embedded"))
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("etcd is not a blob store"), "{err}");
        let err = with("etcd://10.0.0.1/fief", None)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("not host:port"), "{err}");
        let err = with("consul://x/y", None)
            .validate()
            .unwrap_err()
            .to_string();
        assert!(err.contains("etcd://host:port"), "{err}");
    }

    #[test]
    fn a_store_of_one_node_under_a_shared_arbiter_is_refused() {
        for storage in ["embedded", "memory"] {
            let config = NodeConfig {
                arbiter: "postgres://postgres@127.0.0.1:5432/fief".to_owned(),
                storage: Some(storage.to_owned()),
                ..NodeConfig::default()
            };
            let err = config.validate().unwrap_err().to_string();
            assert!(
                err.contains(&format!("storage `{storage}`"))
                    && err.contains("leave `storage` unset"),
                "{err}"
            );
        }
        for storage in [None, Some("postgres://postgres@127.0.0.1:5432/state")] {
            NodeConfig {
                arbiter: "postgres://postgres@127.0.0.1:5432/fief".to_owned(),
                storage: storage.map(str::to_owned),
                ..NodeConfig::default()
            }
            .validate()
            .unwrap();
        }
        NodeConfig {
            storage: Some("embedded".to_owned()),
            ..NodeConfig::default()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn unsafe_timing_is_refused_with_numbers() {
        let config = NodeConfig {
            fence_margin: Duration::from_secs(5),
            ..NodeConfig::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(err.contains("fence_margin (5s)"), "{err}");
    }

    #[test]
    fn options_parse_and_refuse_nonsense() {
        let o =
            ModuleOptions::from_pairs([("memory_limit", "32MiB"), ("cpu_limit", "50ms")]).unwrap();
        assert_eq!(o.memory_limit, ByteSize::mib(32));
        assert_eq!(o.cpu_limit, Duration::from_millis(50));
        let err = ModuleOptions::from_pairs([("cpu_limit", "soon")]).unwrap_err();
        assert!(err.to_string().contains("cpu_limit"), "{err}");
        let err = ModuleOptions::from_pairs([("colour", "red")]).unwrap_err();
        assert!(err.to_string().contains("unknown option"), "{err}");
    }

    #[test]
    fn log_rates_are_held_under_their_ceilings() {
        let node = NodeConfig::default();
        let timing = node.lease_timing().unwrap();
        for (name, value) in [
            ("max_log_lines_per_second", "0"),
            ("max_log_lines_per_second", "10001"),
            ("max_log_bytes_per_second", "100"),
            ("max_log_bytes_per_second", "11MiB"),
        ] {
            let o = ModuleOptions::from_pairs([(name, value)]).unwrap();
            let err = o.validate_for(&node, &timing).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
        let o = ModuleOptions::from_pairs([
            ("max_log_lines_per_second", "10000"),
            ("max_log_bytes_per_second", "10MiB"),
        ])
        .unwrap();
        o.validate_for(&node, &timing).unwrap();
    }

    #[test]
    fn a_fence_deadline_that_does_not_fit_is_refused() {
        let node = NodeConfig::default();
        let o = ModuleOptions::from_pairs([("handle_fence_deadline", "2s")]).unwrap();
        let err = o
            .validate_for(&node, &node.lease_timing().unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("fence_margin (1s)"), "{err}");
    }

    #[test]
    fn keys_and_module_names() {
        assert!(validate_key("").is_err());
        assert!(validate_key(&"k".repeat(1025)).is_err());
        assert!(validate_key("alice").is_ok());
        assert!(validate_module_name("counter").is_ok());
        assert!(validate_module_name("a/b").is_err());
        assert!(validate_qualified_module_name("a/b").is_ok());
        assert!(validate_qualified_module_name("a/b/c").is_err());
        assert!(validate_qualified_module_name("/b").is_err());
    }

    #[test]
    fn a_guest_memory_budget_smaller_than_one_key_is_refused() {
        let with = |mib| NodeConfig {
            max_guest_memory: Some(ByteSize::mib(mib)),
            ..NodeConfig::default()
        };
        let one_key = NodeConfig::default().max_memory_per_key.as_u64() >> 20;
        assert!(with(one_key).validate().is_ok());
        let err = with(one_key - 1).validate().unwrap_err().to_string();
        assert!(err.contains("max_guest_memory"), "{err}");
        assert!(err.contains("one key must fit"), "{err}");
    }

    #[test]
    fn tenant_cpu_weights_past_their_bounds_are_refused_with_the_bound() {
        let with = |tenant: &str, weight: u32| NodeConfig {
            tenant_cpu_weights: [(tenant.to_owned(), weight)].into(),
            ..NodeConfig::default()
        };
        assert!(with("acme", 1).validate().is_ok());
        assert!(with("acme", MAX_TENANT_CPU_WEIGHT).validate().is_ok());
        let err = with("acme", 0).validate().unwrap_err().to_string();
        assert!(err.contains("between 1 and 1000"), "{err}");
        let err = with("acme", 1001).validate().unwrap_err().to_string();
        assert!(err.contains("acme's weight (1001)"), "{err}");
        let err = with("a/b", 2).validate().unwrap_err().to_string();
        assert!(err.contains("tenant name \"a/b\""), "{err}");
        let many = NodeConfig {
            tenant_cpu_weights: (0..=MAX_TENANT_CPU_WEIGHTS)
                .map(|i| (format!("t{i}"), 1))
                .collect(),
            ..NodeConfig::default()
        };
        let err = many.validate().unwrap_err().to_string();
        assert!(err.contains("at most 10000"), "{err}");
    }
}
