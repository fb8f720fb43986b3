//! A module's options ([`ModuleOptions`]: fence mode and resource limits,
//! sent with a deploy) and the node's ceilings over them
//! ([`ModuleCeilings`]), with the checks that refuse an option past its
//! ceiling or one that cannot work on this node, and the defaults and
//! ceilings of the options whose machinery lives elsewhere (the guest log's
//! rates: `crate::guest_log` keeps them). It must not know how a module runs
//! (that is `sandbox`, `key` and `runtime`).

use std::time::Duration;

use fief_core::fence::DEFAULT_HANDLE_FENCE_DEADLINE;
use fief_core::{LeaseTiming, OnFence};
use serde::{Deserialize, Serialize};

use super::{ByteSize, CpuShare, NodeConfig};
use crate::error::{Error, Result};

/// Default of `max_log_lines_per_second`.
const DEFAULT_LOG_LINES_PER_SECOND: u32 = 100;

/// Default of `max_log_bytes_per_second` (100 KiB).
const DEFAULT_LOG_BYTES_PER_SECOND: ByteSize = ByteSize::kib(100);

/// Ceiling of `max_log_lines_per_second` a module may ask for.
const MAX_LOG_LINES_PER_SECOND: u32 = 10_000;

/// Ceiling of `max_log_bytes_per_second` a module may ask for (10 MiB).
const MAX_LOG_BYTES_PER_SECOND: ByteSize = ByteSize::mib(10);

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
    /// Largest stored value of one key.
    pub max_storage_value_size: ByteSize,
    /// Most bytes one key may store.
    pub max_storage_bytes_per_key: ByteSize,
    /// Most storage writes of one callback.
    pub max_storage_writes_per_callback: u32,
    /// Most durable alarms of one key.
    pub max_alarms_per_key: u32,
    /// Most WebSocket connections of one key.
    pub max_connections_per_key: u32,
    /// Most frames per second from one WebSocket connection.
    pub max_frames_per_second: u32,
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
            max_storage_value_size: ByteSize::mib(1),
            max_storage_bytes_per_key: ByteSize::gib(1),
            max_storage_writes_per_callback: 100_000,
            max_alarms_per_key: 1024,
            max_connections_per_key: 65_536,
            max_frames_per_second: 100_000,
        }
    }
}

impl ModuleCeilings {
    /// Set one ceiling from text (`--module-ceiling cpu_limit=5s`); the
    /// names are those of [`super::option_table::OPTIONS`] with a ceiling.
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for an unknown name or an unparsable value.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        super::option_table::set_ceiling(self, name, value)
    }

    /// Refuse `options` over a ceiling.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] naming the option, its value and the
    /// ceiling.
    pub fn check(&self, o: &ModuleOptions) -> Result<()> {
        match super::option_table::first_over(self, o) {
            None => Ok(()),
            Some((name, value, ceiling)) => Err(Error::InvalidOptions(format!(
                "{name} ({value}) is over this node's ceiling ({ceiling}); ask for at most \
                 {ceiling}, or have the operator raise module_ceilings.{name} \
                 (--module-ceiling {name}=VALUE)"
            ))),
        }
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
    pub dir: Option<super::DirGrant>,
    /// Share of one core one key may use over `cpu_budget_window` (`250m`,
    /// `0.25`, `25%`); a key over it is throttled — its callbacks wait — not
    /// killed ([`crate::cpu_budget`]). Default: a whole core (no throttling).
    pub cpu_budget: CpuShare,
    /// The window `cpu_budget` is measured over: a key may use up to
    /// `cpu_budget × cpu_budget_window` in a burst. 10 ms to 1 minute;
    /// default 1 s.
    #[serde(with = "humantime_serde")]
    pub cpu_budget_window: Duration,
    /// Largest value one key may store under one name (`fief:key/storage`);
    /// a larger `put` fails with `invalid`. Default 1 MiB.
    pub max_storage_value_size: ByteSize,
    /// Most bytes (names plus values) one key may store; a `put` past it
    /// fails with `limit`. The state is held in the key's memory on the
    /// host once loaded. Default 16 MiB.
    pub max_storage_bytes_per_key: ByteSize,
    /// Most storage writes (puts, deletes, range deletes) one callback may
    /// make; past it they fail with `limit`. Default 1000.
    pub max_storage_writes_per_callback: u32,
    /// Most durable alarms one key may hold (`fief:key/alarms`); a
    /// `set-alarm` of a new name past it fails with `limit`. Default 16.
    pub max_alarms_per_key: u32,
    /// Most WebSocket connections one key may have attached
    /// (`docs/realtime.md`); one more is closed at once with code 1008.
    /// Default 64.
    pub max_connections_per_key: u32,
    /// Most frames per second one WebSocket connection's client may send
    /// (a bucket of one second's worth); past it the connection is closed
    /// with code 1008. Default 100.
    pub max_frames_per_second: u32,
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
            max_log_lines_per_second: DEFAULT_LOG_LINES_PER_SECOND,
            max_log_bytes_per_second: DEFAULT_LOG_BYTES_PER_SECOND,
            dir: None,
            cpu_budget: CpuShare::WHOLE_CORE,
            cpu_budget_window: Duration::from_secs(1),
            max_storage_value_size: ByteSize::mib(1),
            max_storage_bytes_per_key: ByteSize::mib(16),
            max_storage_writes_per_callback: 1000,
            max_alarms_per_key: 16,
            max_connections_per_key: 64,
            max_frames_per_second: 100,
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
        if self.max_frames_per_second == 0 {
            return bad("max_frames_per_second must be at least 1".to_owned());
        }
        if self.max_storage_writes_per_callback == 0 {
            return bad("max_storage_writes_per_callback must be at least 1".to_owned());
        }
        if self.max_storage_value_size > self.max_storage_bytes_per_key {
            return bad(format!(
                "max_storage_value_size ({}) must be at most max_storage_bytes_per_key ({})",
                self.max_storage_value_size, self.max_storage_bytes_per_key
            ));
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

    /// Set one option from its string form (the table of options:
    /// [`super::option_table::OPTIONS`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for an unknown option or an unparsable value.
    pub fn set(&mut self, name: &str, value: &str) -> Result<()> {
        super::option_table::set_option(self, name, value)
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
