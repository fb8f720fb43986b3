//! Configuration of a node and of a module, with the checks that refuse a
//! configuration that cannot work.
//!
//! [`NodeConfig`] is read from a TOML file, `FIEF_*` environment variables
//! and flags (the CLI layers them); [`ModuleOptions`] come with a deploy.
//! Durations are written as `5s`, `500ms`; sizes as `64MiB`. Everything an
//! outsider can make the node allocate has a named limit here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use fief_core::fence::{DEFAULT_HANDLE_FENCE_DEADLINE, DEFAULT_KILL_BOUND};
use fief_core::lease::{
    DEFAULT_FENCE_MARGIN, DEFAULT_LEASE_TTL, DEFAULT_MAX_CLOCK_DRIFT_PPM, DEFAULT_RENEW_INTERVAL,
};
use fief_core::partition::DEFAULT_PARTITIONS;
use fief_core::{FenceBudget, LeaseTiming, OnFence, PartitionCount};
use serde::{Deserialize, Serialize};

/// Byte sizes in options and config (`64MiB`).
pub use bytesize::ByteSize;

pub use crate::cpu_budget::{CpuCores, CpuShare};
use crate::error::{Error, Result};
use crate::guest_log::{MAX_LOG_BYTES_PER_SECOND, MAX_LOG_LINES_PER_SECOND};

/// Longest key name, in bytes.
pub const MAX_KEY_BYTES: usize = 1024;

/// Configuration of one node (one instance of a namespace).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NodeConfig {
    /// The namespace: every node of one cluster uses the same.
    pub namespace: String,
    /// This node's id, unique within the namespace.
    pub node_id: String,
    /// The arbiter: `local` (in-process, the embedded default) or a
    /// PostgreSQL URL (`postgres://user@host:5432/db`).
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
    /// Most key processes live at once on this node, over all modules (the
    /// size of the instance pool).
    pub max_live_keys: u32,
    /// Largest linear memory any key may have; a module's `memory_limit` must
    /// not exceed it (it sizes each slot of the instance pool).
    pub max_memory_per_key: ByteSize,
    /// How long a call waits for a reply before it fails with `timeout`.
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
    /// node's certificate); `None`: plain TCP. See [`crate::tls::PeerTls`].
    pub peer_tls: Option<crate::tls::PeerTls>,
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
}

/// The node's ceilings over module options: a deploy asking for more is
/// refused, naming the option, its value and the ceiling. Options not listed
/// here have theirs elsewhere: `memory_limit` (`max_memory_per_key`), the
/// sizes (`max_message_size`), `handle_fence_deadline` (the fence budget).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModuleCeilings {
    /// Most CPU time one callback may take.
    #[serde(with = "humantime_serde")]
    pub cpu_limit: Duration,
    /// Longest a key may stay live idle.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Most live keys of one module.
    pub max_live_keys: u32,
    /// Deepest mailbox of one key.
    pub mailbox_depth: u32,
    /// Most timers one key may have armed.
    pub max_timers_per_key: u32,
    /// Most topics one key may subscribe to.
    pub max_subscriptions_per_key: u32,
    /// Most publications per second of one key.
    pub max_publishes_per_second: u32,
    /// Most host memory one key may make the node hold.
    pub max_host_bytes_per_key: ByteSize,
    /// Largest `cpu_budget` (share of a core over its window) of one key.
    pub cpu_budget: CpuShare,
}

impl Default for ModuleCeilings {
    fn default() -> Self {
        ModuleCeilings {
            cpu_limit: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(24 * 3600),
            max_live_keys: 1_000_000,
            mailbox_depth: 65_536,
            max_timers_per_key: 65_536,
            max_subscriptions_per_key: 4096,
            max_publishes_per_second: 100_000,
            max_host_bytes_per_key: ByteSize::gib(1),
            cpu_budget: CpuShare::WHOLE_CORE,
        }
    }
}

impl ModuleCeilings {
    /// The names [`ModuleCeilings::set`] takes.
    pub const NAMES: &'static str = "cpu_limit, idle_timeout, max_live_keys, mailbox_depth, \
        max_timers_per_key, max_subscriptions_per_key, max_publishes_per_second, \
        max_host_bytes_per_key, cpu_budget";

    /// Set one ceiling from text (`--module-ceiling cpu_limit=5s`).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an unknown name or an unparsable value.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let bad = |e: String| Error::Config(format!("module ceiling {name} = {value:?}: {e}"));
        let duration = || humantime::parse_duration(value).map_err(|e| bad(e.to_string()));
        let count = || value.parse::<u32>().map_err(|e| bad(e.to_string()));
        match name {
            "cpu_limit" => self.cpu_limit = duration()?,
            "idle_timeout" => self.idle_timeout = duration()?,
            "max_live_keys" => self.max_live_keys = count()?,
            "mailbox_depth" => self.mailbox_depth = count()?,
            "max_timers_per_key" => self.max_timers_per_key = count()?,
            "max_subscriptions_per_key" => self.max_subscriptions_per_key = count()?,
            "max_publishes_per_second" => self.max_publishes_per_second = count()?,
            "max_host_bytes_per_key" => {
                self.max_host_bytes_per_key = value.parse().map_err(|e: String| bad(e))?;
            }
            "cpu_budget" => self.cpu_budget = value.parse().map_err(bad)?,
            other => {
                return Err(Error::Config(format!(
                    "unknown module ceiling {other:?}; known: {}",
                    Self::NAMES
                )));
            }
        }
        Ok(())
    }

    /// Refuse `options` over a ceiling.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] naming the option, its value and the
    /// ceiling.
    pub fn check(&self, o: &ModuleOptions) -> Result<()> {
        fn over<T: PartialOrd + std::fmt::Debug>(name: &str, value: T, ceiling: T) -> Result<()> {
            if value > ceiling {
                return Err(Error::InvalidOptions(format!(
                    "{name} ({value:?}) is over this node's ceiling ({ceiling:?}); ask for at \
                     most {ceiling:?}, or have the operator raise module_ceilings.{name} \
                     (--module-ceiling {name}=VALUE)"
                )));
            }
            Ok(())
        }
        over("cpu_limit", o.cpu_limit, self.cpu_limit)?;
        over("idle_timeout", o.idle_timeout, self.idle_timeout)?;
        over("max_live_keys", o.max_live_keys, self.max_live_keys)?;
        over("mailbox_depth", o.mailbox_depth, self.mailbox_depth)?;
        over(
            "max_timers_per_key",
            o.max_timers_per_key,
            self.max_timers_per_key,
        )?;
        over(
            "max_subscriptions_per_key",
            o.max_subscriptions_per_key,
            self.max_subscriptions_per_key,
        )?;
        over(
            "max_publishes_per_second",
            o.max_publishes_per_second,
            self.max_publishes_per_second,
        )?;
        over(
            "max_host_bytes_per_key",
            o.max_host_bytes_per_key,
            self.max_host_bytes_per_key,
        )?;
        over("cpu_budget", o.cpu_budget, self.cpu_budget)
    }
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
            compile_memory_limit: crate::compile_worker::DEFAULT_MEMORY_LIMIT,
            compile_cache: None,
            cache_max_bytes: ByteSize::mib(64),
            cache_max_bytes_per_tenant: ByteSize::mib(16),
            cache_max_bytes_per_namespace: ByteSize::mib(16),
            max_host_bytes_per_tenant: ByteSize::mib(512),
            cluster_secret_file: None,
            peer_tls: None,
            module_ceilings: ModuleCeilings::default(),
            http_header_read_timeout: crate::http_limits::DEFAULT_HEADER_READ_TIMEOUT,
            http_idle_timeout: crate::http_limits::DEFAULT_IDLE_TIMEOUT,
            http_body_read_timeout: crate::http_limits::DEFAULT_BODY_READ_TIMEOUT,
            http_max_connections: None,
            guest_threads: 0,
            guest_thread_nice: 10,
            cpu_budget_per_tenant: None,
            cpu_budget_per_tenant_window: Duration::from_secs(1),
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
        if self.arbiter != "local"
            && !self.arbiter.starts_with("postgres://")
            && !self.arbiter.starts_with("postgresql://")
        {
            return bad(format!(
                "arbiter {:?} is neither `local` nor a postgres:// URL",
                self.arbiter
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
        crate::http_limits::validate_config(self)?;
        crate::compile_worker::validate_config(self)?;
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
    pub(crate) fn partition_count(&self) -> PartitionCount {
        PartitionCount::new(self.partitions).unwrap_or_default()
    }
}

/// How a module's keys run: fence mode and resource limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModuleOptions {
    /// What happens to the module's keys when their node fences.
    #[serde(with = "on_fence_serde")]
    pub on_fence: OnFence,
    /// Deadline for `handle-fence` under `on_fence = callback`.
    #[serde(with = "humantime_serde")]
    pub handle_fence_deadline: Duration,
    /// Largest linear memory one key may grow to.
    pub memory_limit: ByteSize,
    /// CPU time one callback may use before the key is killed (measured in
    /// epoch ticks while guest code runs).
    #[serde(with = "humantime_serde")]
    pub cpu_limit: Duration,
    /// Most live keys of this module on one node.
    pub max_live_keys: u32,
    /// A key with no message for this long is stopped (`terminate(idle)`).
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Messages that may wait in one key's mailbox.
    pub mailbox_depth: u32,
    /// Timers one key may have armed at once.
    pub max_timers_per_key: u32,
    /// Topics one key may be subscribed to at once.
    pub max_subscriptions_per_key: u32,
    /// Largest message to one of this module's keys; `None`: the node's
    /// `max_message_size`, which is also the ceiling.
    pub max_message_size: Option<ByteSize>,
    /// Largest reply from one of this module's keys; `None`: the node's
    /// `max_message_size`, which is also the ceiling.
    pub max_reply_size: Option<ByteSize>,
    /// Largest state one of this module's keys may hand on from `handoff`
    /// (checked when `handoff` returns; a larger one is that key's loss,
    /// reported by name); `None`: the node's `max_message_size`, which is
    /// also the ceiling.
    pub max_handoff_size: Option<ByteSize>,
    /// Publications one key may make per second (a token bucket with a burst
    /// of one second's worth); over it `publish` fails with `limit`.
    pub max_publishes_per_second: u32,
    /// Host memory one key process may make the node hold on its behalf
    /// outside its linear memory: queued messages, armed timers' tags,
    /// subscriptions ([`crate::host_bytes`]). Past it a message to the key
    /// is refused (429 `host_memory`), `send-after` and `subscribe` fail
    /// with `limit`, a publication misses it. Default 32 MiB.
    pub max_host_bytes_per_key: ByteSize,
    /// Log lines one key may make per second, over the `log` import, stdout
    /// and stderr together (a token bucket with a burst of ten seconds'
    /// worth); lines over it are dropped, counted in the metric
    /// `fief_guest_log_lines_dropped_total` and noted in the log. 1 to
    /// 10 000; default 100.
    pub max_log_lines_per_second: u32,
    /// Log bytes one key may make per second, likewise (each line is also
    /// cut at 8 KiB). 1 KiB to 10 MiB; default 100 KiB.
    pub max_log_bytes_per_second: ByteSize,
    /// A host directory preopened at `/data` in every key, read-only or
    /// read-write (`"/srv/data:ro"`); `None`: no filesystem at all. See
    /// [`crate::sandbox`] for who may name host paths.
    pub dir: Option<crate::sandbox::DirGrant>,
    /// Share of one core one key may use over `cpu_budget_window` (`250m`,
    /// `0.25`, `25%`); a key over it is throttled — its callbacks wait — not
    /// killed ([`crate::cpu_budget`]). Default: a whole core (no throttling).
    pub cpu_budget: CpuShare,
    /// The window `cpu_budget` is measured over: a key may use up to
    /// `cpu_budget × cpu_budget_window` in a burst. 10 ms to 1 minute;
    /// default 1 s.
    #[serde(with = "humantime_serde")]
    pub cpu_budget_window: Duration,
}

impl Default for ModuleOptions {
    fn default() -> Self {
        ModuleOptions {
            on_fence: OnFence::Terminate,
            handle_fence_deadline: DEFAULT_HANDLE_FENCE_DEADLINE,
            memory_limit: ByteSize::mib(64),
            cpu_limit: Duration::from_millis(100),
            max_live_keys: 10_000,
            idle_timeout: Duration::from_secs(300),
            mailbox_depth: 1024,
            max_timers_per_key: 1024,
            max_subscriptions_per_key: 64,
            max_message_size: None,
            max_reply_size: None,
            max_handoff_size: None,
            max_publishes_per_second: 1000,
            max_host_bytes_per_key: ByteSize::mib(32),
            max_log_lines_per_second: crate::guest_log::DEFAULT_LOG_LINES_PER_SECOND,
            max_log_bytes_per_second: crate::guest_log::DEFAULT_LOG_BYTES_PER_SECOND,
            dir: None,
            cpu_budget: CpuShare::WHOLE_CORE,
            cpu_budget_window: Duration::from_secs(1),
        }
    }
}

impl ModuleOptions {
    /// Check the options against a node's configuration.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] naming the option and the numbers.
    pub fn validate_for(&self, node: &NodeConfig, timing: &LeaseTiming) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidOptions(m));
        node.fence_budget()
            .check(timing, self.handle_fence_deadline)
            .map_err(|e| Error::InvalidOptions(e.to_string()))?;
        if self.memory_limit > node.max_memory_per_key {
            return bad(format!(
                "memory_limit ({}) is over this node's max_memory_per_key ({})",
                self.memory_limit, node.max_memory_per_key
            ));
        }
        if self.memory_limit < ByteSize::kib(64) {
            return bad(format!(
                "memory_limit ({}) must be at least one wasm page (64 KiB)",
                self.memory_limit
            ));
        }
        if self.cpu_limit < node.epoch_tick {
            return bad(format!(
                "cpu_limit ({:?}) must be at least one epoch tick ({:?})",
                self.cpu_limit, node.epoch_tick
            ));
        }
        if self.max_live_keys == 0 || self.mailbox_depth == 0 {
            return bad("max_live_keys and mailbox_depth must be at least 1".to_owned());
        }
        node.module_ceilings.check(self)?;
        let largest_message = self.max_message_size.unwrap_or(node.max_message_size);
        if self.max_host_bytes_per_key < largest_message {
            return bad(format!(
                "max_host_bytes_per_key ({}) must be at least the largest message the module \
                 takes ({largest_message}, max_message_size): a key must be able to hold one",
                self.max_host_bytes_per_key
            ));
        }
        if self.idle_timeout.is_zero() {
            return bad("idle_timeout must be above zero".to_owned());
        }
        for (name, size) in [
            ("max_message_size", self.max_message_size),
            ("max_reply_size", self.max_reply_size),
            ("max_handoff_size", self.max_handoff_size),
        ] {
            if let Some(size) = size
                && (size.as_u64() == 0 || size > node.max_message_size)
            {
                return bad(format!(
                    "{name} ({size}) must be between 1 byte and this node's max_message_size ({})",
                    node.max_message_size
                ));
            }
        }
        if self.max_publishes_per_second == 0 {
            return bad("max_publishes_per_second must be at least 1".to_owned());
        }
        if !(1..=MAX_LOG_LINES_PER_SECOND).contains(&self.max_log_lines_per_second) {
            return bad(format!(
                "max_log_lines_per_second ({}) must be between 1 and {MAX_LOG_LINES_PER_SECOND}",
                self.max_log_lines_per_second
            ));
        }
        if self.max_log_bytes_per_second < ByteSize::kib(1)
            || self.max_log_bytes_per_second > MAX_LOG_BYTES_PER_SECOND
        {
            return bad(format!(
                "max_log_bytes_per_second ({}) must be between 1 KiB and {MAX_LOG_BYTES_PER_SECOND}",
                self.max_log_bytes_per_second
            ));
        }
        if self.cpu_budget_window < Duration::from_millis(10)
            || self.cpu_budget_window > Duration::from_secs(60)
        {
            return bad(format!(
                "cpu_budget_window ({:?}) must be between 10ms and 1m",
                self.cpu_budget_window
            ));
        }
        if let Some(dir) = &self.dir {
            dir.check_exists()?;
        }
        Ok(())
    }

    /// Options from string pairs (HTTP query parameters, CLI flags), starting
    /// from the defaults.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for an unknown option or an unparsable value.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<Self> {
        let mut options = ModuleOptions::default();
        for (name, value) in pairs {
            options.set(name, value)?;
        }
        Ok(options)
    }

    /// Set one option from its string form.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for an unknown option or an unparsable value.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        let duration = |v: &str| {
            humantime::parse_duration(v).map_err(|e| {
                Error::InvalidOptions(format!(
                    "{name} = {v:?}: {e} (write durations like 100ms or 5s)"
                ))
            })
        };
        let size = |v: &str| {
            v.parse::<ByteSize>().map_err(|e| {
                Error::InvalidOptions(format!(
                    "{name} = {v:?}: {e} (write sizes like 64MiB or 65536)"
                ))
            })
        };
        let count = |v: &str| {
            v.parse::<u32>().map_err(|e| {
                Error::InvalidOptions(format!("{name} = {v:?}: {e} (expected a whole number)"))
            })
        };
        match name {
            "on_fence" => {
                self.on_fence = value
                    .parse()
                    .map_err(|e: String| Error::InvalidOptions(e))?
            }
            "handle_fence_deadline" => self.handle_fence_deadline = duration(value)?,
            "memory_limit" => self.memory_limit = size(value)?,
            "cpu_limit" => self.cpu_limit = duration(value)?,
            "max_live_keys" => self.max_live_keys = count(value)?,
            "idle_timeout" => self.idle_timeout = duration(value)?,
            "mailbox_depth" => self.mailbox_depth = count(value)?,
            "max_timers_per_key" => self.max_timers_per_key = count(value)?,
            "max_subscriptions_per_key" => self.max_subscriptions_per_key = count(value)?,
            "max_message_size" => self.max_message_size = Some(size(value)?),
            "max_reply_size" => self.max_reply_size = Some(size(value)?),
            "max_handoff_size" => self.max_handoff_size = Some(size(value)?),
            "max_publishes_per_second" => self.max_publishes_per_second = count(value)?,
            "max_host_bytes_per_key" => self.max_host_bytes_per_key = size(value)?,
            "max_log_lines_per_second" => self.max_log_lines_per_second = count(value)?,
            "max_log_bytes_per_second" => self.max_log_bytes_per_second = size(value)?,
            "dir" => self.dir = Some(value.parse().map_err(Error::InvalidOptions)?),
            "cpu_budget" => {
                self.cpu_budget = value
                    .parse()
                    .map_err(|e| Error::InvalidOptions(format!("{name}: {e}")))?
            }
            "cpu_budget_window" => self.cpu_budget_window = duration(value)?,
            other => {
                return Err(Error::InvalidOptions(format!(
                    "unknown option {other:?}; known options: on_fence, handle_fence_deadline, memory_limit, cpu_limit, max_live_keys, idle_timeout, mailbox_depth, max_timers_per_key, max_subscriptions_per_key, max_message_size, max_reply_size, max_handoff_size, max_publishes_per_second, max_host_bytes_per_key, max_log_lines_per_second, max_log_bytes_per_second, dir, cpu_budget, cpu_budget_window"
                )));
            }
        }
        Ok(())
    }
}

mod on_fence_serde {
    use fief_core::OnFence;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(mode: &OnFence, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(mode.as_str())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<OnFence, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Check a key name.
///
/// # Errors
///
/// [`Error::InvalidKey`] when it is empty or over [`MAX_KEY_BYTES`].
pub fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidKey("a key must not be empty".to_owned()));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(Error::InvalidKey(format!(
            "a key is at most {MAX_KEY_BYTES} bytes; this one is {} bytes",
            key.len()
        )));
    }
    Ok(())
}

/// Check a module name: 1–128 characters of `[a-zA-Z0-9_.-]`.
///
/// # Errors
///
/// [`Error::InvalidModuleName`] saying what is wrong.
pub fn validate_module_name(name: &str) -> Result<()> {
    let why = if name.is_empty() || name.len() > 128 {
        Some("a module name is 1 to 128 characters long")
    } else if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Some("a module name uses only letters, digits, '_', '-' and '.'")
    } else if !name.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
        // `.` and `..` name no module in a path or URL, and `-x` reads as a
        // flag to the CLI: such a module could be deployed but not called.
        Some("a module name starts with a letter, a digit or '_'")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::InvalidModuleName {
            name: name.to_owned(),
            why: why.to_owned(),
        }),
        None => Ok(()),
    }
}

/// Check a stored module name: a plain name (see [`validate_module_name`])
/// or a tenant's `tenant/name`, both parts plain names
/// ([`crate::auth`]).
///
/// # Errors
///
/// [`Error::InvalidModuleName`] saying what is wrong.
pub fn validate_qualified_module_name(name: &str) -> Result<()> {
    match name.split_once('/') {
        None => validate_module_name(name),
        Some((tenant, local)) => {
            if validate_module_name(tenant).is_err() || validate_module_name(local).is_err() {
                return Err(Error::InvalidModuleName {
                    name: name.to_owned(),
                    why: "a tenant's module is `tenant/name`, each part 1 to 128 letters, digits, '_', '-' or '.'".to_owned(),
                });
            }
            Ok(())
        }
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
}
