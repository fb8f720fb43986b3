//! The sandbox a key process runs in: what it may use (capabilities) and how
//! much (limits), and the caps a tenant's modules must stay under.
//!
//! **Capabilities: none by default.** A key's WASI context has no
//! environment, no arguments, no stdin, no filesystem and no network:
//! TCP, UDP and name lookup are refused and every socket address check says
//! no. Stdout and stderr go to the node's log ([`crate::guest_log`]), cut
//! and rate-limited like the `log` import; wall and monotonic clocks and
//! random numbers are allowed. The one capability a module's options may
//! grant is one host directory, preopened read-only or
//! read-write at [`GUEST_DIR`] ([`DirGrant`], the `dir` option, a plain
//! value of `crate::config`). Naming host
//! paths is an operator's decision: a deploy without tenant caps (the admin)
//! may name any directory; a tenant's deploy only a directory under one its
//! [`TenantLimits::allowed_dirs`] grants, with no more permission than the
//! grant.
//!
//! **Limits** are the [`ModuleOptions`]; the CPU budget of a callback is
//! `cpu_limit`, counted in epoch ticks while guest code runs (the engine uses
//! epoch interruption, not fuel). [`TenantLimits`] caps a tenant's options:
//! a deploy whose options exceed a cap is refused with an error naming the
//! option and the cap. [`PublishBucket`] is the per-key publish rate limit.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use fief_core::Instant;
use serde::{Deserialize, Serialize};
use wasmtime_wasi::{FsPerms, ResourceTable, WasiCtx, WasiCtxBuilder};

use crate::config::{ByteSize, DirGrant, ModuleOptions};
use crate::error::{Error, Result};
use crate::guest_log::{GuestLog, GuestLogger, LOG_BURST_SECONDS, MAX_LOG_LINE, Stream};
use crate::token_bucket::TokenBucket;

/// Where a module's granted directory appears inside its keys.
pub const GUEST_DIR: &str = "/data";

/// Caps on a tenant's module options: a module of the tenant may not ask for
/// more than these. `None` leaves an option uncapped (up to the node's own
/// limits). Read from the tenant's configuration; a deploy by the tenant is
/// checked with [`TenantLimits::check`] before anything is compiled.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TenantLimits {
    /// Cap on `memory_limit`.
    pub memory_limit: Option<ByteSize>,
    /// Cap on `cpu_limit`.
    #[serde(with = "humantime_serde")]
    pub cpu_limit: Option<Duration>,
    /// Cap on `max_live_keys`.
    pub max_live_keys: Option<u32>,
    /// Cap on `idle_timeout` (how long an idle key keeps its memory).
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Option<Duration>,
    /// Cap on `mailbox_depth`.
    pub mailbox_depth: Option<u32>,
    /// Cap on `max_timers_per_key`.
    pub max_timers_per_key: Option<u32>,
    /// Cap on `max_subscriptions_per_key`.
    pub max_subscriptions_per_key: Option<u32>,
    /// Cap on `max_message_size` (a module without its own takes this).
    pub max_message_size: Option<ByteSize>,
    /// Cap on `max_reply_size` (a module without its own takes this).
    pub max_reply_size: Option<ByteSize>,
    /// Cap on `max_handoff_size` (a module without its own takes this).
    pub max_handoff_size: Option<ByteSize>,
    /// Cap on `max_publishes_per_second`.
    pub max_publishes_per_second: Option<u32>,
    /// Cap on `max_host_bytes_per_key`.
    pub max_host_bytes_per_key: Option<ByteSize>,
    /// Cap on `max_log_lines_per_second`.
    pub max_log_lines_per_second: Option<u32>,
    /// Cap on `max_log_bytes_per_second`.
    pub max_log_bytes_per_second: Option<ByteSize>,
    /// Host directories the tenant's modules may be granted (`dir`), each
    /// with the most permission allowed beneath it. Empty: none.
    pub allowed_dirs: Vec<DirGrant>,
    /// Cap on `cpu_budget` (a share of one core per key).
    pub cpu_budget: Option<crate::config::CpuShare>,
}

impl TenantLimits {
    /// The default module options for this tenant: the node's defaults with
    /// every capped option lowered to its cap, so a deploy that sets nothing
    /// passes [`check`](Self::check).
    pub fn defaults(&self) -> ModuleOptions {
        let mut o = ModuleOptions::default();
        let low =
            |value: &mut u32, cap: Option<u32>| *value = cap.map_or(*value, |c| c.min(*value));
        if let Some(cap) = self.memory_limit {
            o.memory_limit = o.memory_limit.min(cap);
        }
        if let Some(cap) = self.cpu_limit {
            o.cpu_limit = o.cpu_limit.min(cap);
        }
        if let Some(cap) = self.cpu_budget {
            o.cpu_budget = o.cpu_budget.min(cap);
        }
        if let Some(cap) = self.idle_timeout {
            o.idle_timeout = o.idle_timeout.min(cap);
        }
        low(&mut o.max_live_keys, self.max_live_keys);
        low(&mut o.mailbox_depth, self.mailbox_depth);
        low(&mut o.max_timers_per_key, self.max_timers_per_key);
        low(
            &mut o.max_subscriptions_per_key,
            self.max_subscriptions_per_key,
        );
        low(
            &mut o.max_publishes_per_second,
            self.max_publishes_per_second,
        );
        low(
            &mut o.max_log_lines_per_second,
            self.max_log_lines_per_second,
        );
        if let Some(cap) = self.max_log_bytes_per_second {
            o.max_log_bytes_per_second = o.max_log_bytes_per_second.min(cap);
        }
        if let Some(cap) = self.max_host_bytes_per_key {
            o.max_host_bytes_per_key = o.max_host_bytes_per_key.min(cap);
        }
        o.max_message_size = min_size(o.max_message_size, self.max_message_size);
        o.max_reply_size = min_size(o.max_reply_size, self.max_reply_size);
        o.max_handoff_size = min_size(o.max_handoff_size, self.max_handoff_size);
        o
    }

    /// Options from string pairs (HTTP query parameters, CLI flags) for a
    /// module of this tenant: [`defaults`](Self::defaults), the pairs, then
    /// [`check`](Self::check).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] for an unknown or unparsable option, or one
    /// over its cap.
    pub fn options_from_pairs<'a>(
        &self,
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<ModuleOptions> {
        let mut options = self.defaults();
        for (name, value) in pairs {
            options.set(name, value)?;
        }
        self.check(&options)?;
        Ok(options)
    }

    /// Refuse options that exceed a cap.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidOptions`] naming the option, its value and the cap.
    pub fn check(&self, o: &ModuleOptions) -> Result<()> {
        fn over<T: PartialOrd + fmt::Debug>(name: &str, value: T, cap: Option<T>) -> Result<()> {
            match cap {
                Some(cap) if value > cap => Err(Error::InvalidOptions(format!(
                    "{name} ({value:?}) is over the tenant's cap ({cap:?}); ask for at most \
                     {cap:?} or have an operator raise the tenant's limit"
                ))),
                _ => Ok(()),
            }
        }
        over("memory_limit", o.memory_limit, self.memory_limit)?;
        over("cpu_limit", o.cpu_limit, self.cpu_limit)?;
        over("cpu_budget", o.cpu_budget, self.cpu_budget)?;
        over("max_live_keys", o.max_live_keys, self.max_live_keys)?;
        over("idle_timeout", o.idle_timeout, self.idle_timeout)?;
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
        over(
            "max_log_lines_per_second",
            o.max_log_lines_per_second,
            self.max_log_lines_per_second,
        )?;
        over(
            "max_log_bytes_per_second",
            o.max_log_bytes_per_second,
            self.max_log_bytes_per_second,
        )?;
        for (name, value, cap) in [
            (
                "max_message_size",
                o.max_message_size,
                self.max_message_size,
            ),
            ("max_reply_size", o.max_reply_size, self.max_reply_size),
            (
                "max_handoff_size",
                o.max_handoff_size,
                self.max_handoff_size,
            ),
        ] {
            if let Some(cap) = cap {
                let Some(value) = value else {
                    return Err(Error::InvalidOptions(format!(
                        "{name} is unset (the node's limit) but the tenant's cap is {cap}; \
                         set {name} to at most {cap}"
                    )));
                };
                over(name, value, Some(cap))?;
            }
        }
        if let Some(dir) = &o.dir
            && !self.allowed_dirs.iter().any(|outer| dir.within(outer))
        {
            let allowed = if self.allowed_dirs.is_empty() {
                "none".to_owned()
            } else {
                self.allowed_dirs
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            return Err(Error::InvalidOptions(format!(
                "dir {dir} is not granted to this tenant (its allowed_dirs: {allowed}); only an \
                 operator can grant host directories"
            )));
        }
        Ok(())
    }
}

fn min_size(value: Option<ByteSize>, cap: Option<ByteSize>) -> Option<ByteSize> {
    match (value, cap) {
        (Some(v), Some(c)) => Some(v.min(c)),
        (v, c) => v.or(c),
    }
}

impl ModuleOptions {
    /// The limits and capabilities a module's keys run under, as
    /// `(name, value)` lines for `fief modules --verbose`. A message or
    /// reply size left unset is the node's `max_message_size` (which also
    /// caps one that is set).
    pub fn limits_and_capabilities(&self) -> Vec<(&'static str, String)> {
        let size = |s: Option<ByteSize>| match s {
            Some(s) => format!("{s} (at most the node's max_message_size)"),
            None => "the node's max_message_size".to_owned(),
        };
        vec![
            ("on_fence", self.on_fence.as_str().to_owned()),
            (
                "handle_fence_deadline",
                humantime::format_duration(self.handle_fence_deadline).to_string(),
            ),
            ("memory_limit", self.memory_limit.to_string()),
            (
                "cpu_limit",
                format!(
                    "{} per callback (epoch budget)",
                    humantime::format_duration(self.cpu_limit)
                ),
            ),
            (
                "cpu_budget",
                format!(
                    "{} of a core over {} (over it callbacks wait)",
                    self.cpu_budget,
                    humantime::format_duration(self.cpu_budget_window)
                ),
            ),
            ("max_live_keys", self.max_live_keys.to_string()),
            (
                "idle_timeout",
                humantime::format_duration(self.idle_timeout).to_string(),
            ),
            ("mailbox_depth", self.mailbox_depth.to_string()),
            ("max_message_size", size(self.max_message_size)),
            ("max_reply_size", size(self.max_reply_size)),
            ("max_handoff_size", size(self.max_handoff_size)),
            ("max_timers_per_key", self.max_timers_per_key.to_string()),
            (
                "max_subscriptions_per_key",
                self.max_subscriptions_per_key.to_string(),
            ),
            (
                "max_publishes_per_second",
                self.max_publishes_per_second.to_string(),
            ),
            (
                "max_host_bytes_per_key",
                format!(
                    "{} (queued messages, timer tags, subscriptions)",
                    self.max_host_bytes_per_key
                ),
            ),
            (
                "max_log_lines_per_second",
                format!(
                    "{} (burst {LOG_BURST_SECONDS} s; over it lines are dropped and counted)",
                    self.max_log_lines_per_second
                ),
            ),
            (
                "max_log_bytes_per_second",
                format!(
                    "{} (burst {LOG_BURST_SECONDS} s; one line at most {MAX_LOG_LINE} bytes)",
                    self.max_log_bytes_per_second
                ),
            ),
            (
                "filesystem",
                match &self.dir {
                    None => "none".to_owned(),
                    Some(d) => format!(
                        "{} at {GUEST_DIR} ({})",
                        d.host.display(),
                        if d.writable {
                            "read-write"
                        } else {
                            "read-only"
                        }
                    ),
                },
            ),
            ("network", "none (no TCP, UDP or name lookup)".to_owned()),
            ("clocks, random", "allowed".to_owned()),
            (
                "stdout, stderr",
                "the node's log (with the log import's limits)".to_owned(),
            ),
        ]
    }
}

/// The WASI context of one key process whose module has a directory: the
/// capabilities above and nothing else. `None` for a module without one:
/// its keys' contexts are made on their first WASI call
/// ([`plain_wasi_ctx`]), as most keys never make one, and a context is
/// about a dozen allocations on every activation and as many frees on
/// every eviction and fence.
///
/// # Errors
///
/// [`Error::KeyDied`] when the module's directory cannot be opened (it was
/// removed after the deploy).
pub(crate) fn wasi_ctx(options: &ModuleOptions, log: &Arc<GuestLogger>) -> Result<Option<WasiCtx>> {
    let Some(dir) = &options.dir else {
        return Ok(None);
    };
    let perms = if dir.writable {
        FsPerms::ReadWrite
    } else {
        FsPerms::ReadOnly
    };
    let mut builder = base_wasi(log);
    builder
        .preopened_dir(&dir.host, GUEST_DIR, perms)
        .map_err(|e| {
            Error::KeyDied(format!(
                "cannot open the module's directory {}: {e:#}",
                dir.host.display()
            ))
        })?;
    Ok(Some(builder.build()))
}

/// The WASI context of a key whose module has no directory, made when the
/// key first calls WASI: the capabilities above and nothing else.
pub(crate) fn plain_wasi_ctx(log: &Arc<GuestLogger>) -> WasiCtx {
    base_wasi(log).build()
}

/// What every key's WASI context has: stdout and stderr into the key's log,
/// no network.
fn base_wasi(log: &Arc<GuestLogger>) -> WasiCtxBuilder {
    let mut builder = WasiCtx::builder();
    builder
        .stdout(GuestLog::new(log.clone(), Stream::Stdout))
        .stderr(GuestLog::new(log.clone(), Stream::Stderr))
        // wasmtime-wasi 48 denies these by default; say so here so that a
        // change of default cannot grant them.
        .allow_tcp(false)
        .allow_udp(false)
        .allow_ip_name_lookup(false)
        .socket_addr_check(|_, _| Box::pin(async { false }));
    builder
}

/// Host resources (WASI streams, pollables, descriptors, ...) one key may
/// hold at once. Each lives in host memory, outside the key's
/// `memory_limit`, so a guest that creates them without dropping them must
/// meet a bound (wasmtime's default is a million per store).
pub const MAX_RESOURCES_PER_KEY: usize = 10_000;

/// The resource table of one key's store, bounded by
/// [`MAX_RESOURCES_PER_KEY`]; past it, creating a resource traps the key.
pub(crate) fn resource_table() -> ResourceTable {
    let mut table = ResourceTable::new();
    table.set_max_capacity(MAX_RESOURCES_PER_KEY);
    table
}

/// A token bucket limiting one key's publications to
/// `max_publishes_per_second`, with a burst of one second's worth, on the
/// node's clock.
pub(crate) struct PublishBucket(TokenBucket<Instant>);

impl PublishBucket {
    /// A full bucket.
    pub(crate) fn new(rate: u32, now: Instant) -> Self {
        PublishBucket(TokenBucket::full(f64::from(rate), f64::from(rate), now))
    }

    /// Take one publication, or say why not.
    pub(crate) fn take(&mut self, now: Instant) -> std::result::Result<(), String> {
        if self.0.take_one(now) {
            return Ok(());
        }
        Err(format!(
            "publish rate limit: this key may publish {} times per second \
             (max_publishes_per_second); retry later",
            self.0.per_second()
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn the_publish_bucket_refills_at_its_rate() {
        let t0 = Instant::ZERO;
        let mut bucket = PublishBucket::new(3, t0);
        for _ in 0..3 {
            bucket.take(t0).unwrap();
        }
        let why = bucket.take(t0).unwrap_err();
        assert!(why.contains("max_publishes_per_second"), "{why}");
        // A third of a second brings one token back, not more.
        let t1 = t0 + Duration::from_millis(334);
        bucket.take(t1).unwrap();
        assert!(bucket.take(t1).is_err());
        // A long pause refills only up to the burst.
        let t2 = t1 + Duration::from_secs(60);
        for _ in 0..3 {
            bucket.take(t2).unwrap();
        }
        assert!(bucket.take(t2).is_err());
    }

    #[test]
    fn a_key_without_a_directory_gets_its_wasi_context_on_first_use() {
        let log = Arc::new(GuestLogger::new(
            Arc::from("m"),
            Arc::from("k"),
            crate::guest_log::LogLimits {
                lines_per_second: 10,
                bytes_per_second: 1024,
            },
            Default::default(),
        ));
        // No directory: nothing made at activation.
        let none = wasi_ctx(&ModuleOptions::default(), &log).unwrap();
        assert!(none.is_none());
        // A directory is opened at activation, where failing can be said.
        let dir = |spec: String| ModuleOptions {
            dir: Some(spec.parse().unwrap()),
            ..ModuleOptions::default()
        };
        let here = std::env::temp_dir().display().to_string();
        assert!(
            wasi_ctx(&dir(format!("{here}:ro")), &log)
                .unwrap()
                .is_some()
        );
        let gone = format!("{here}/fief-no-such-dir-{}:ro", std::process::id());
        match wasi_ctx(&dir(gone), &log) {
            Err(Error::KeyDied(why)) => assert!(why.contains("cannot open"), "{why}"),
            other => panic!("a missing directory: {:?}", other.map(|c| c.is_some())),
        }
    }

    #[test]
    fn limits_and_capabilities_name_every_limit_and_grant() {
        let lines = ModuleOptions::default().limits_and_capabilities();
        let get = |name: &str| {
            lines
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no {name} line in {lines:?}"))
        };
        assert_eq!(get("filesystem"), "none");
        assert!(get("network").starts_with("none"));
        assert_eq!(get("clocks, random"), "allowed");
        assert_eq!(get("max_publishes_per_second"), "1000");
        assert!(get("max_log_lines_per_second").starts_with("100 (burst 10 s"));
        assert!(get("max_log_bytes_per_second").contains("8192 bytes"));
        assert!(get("cpu_limit").contains("epoch budget"));
        assert_eq!(get("max_reply_size"), "the node's max_message_size");
        let granted = ModuleOptions {
            dir: Some("/srv/data:rw".parse().unwrap()),
            ..ModuleOptions::default()
        };
        let lines = granted.limits_and_capabilities();
        assert!(
            lines
                .iter()
                .any(|(n, v)| *n == "filesystem" && v == "/srv/data at /data (read-write)"),
            "{lines:?}"
        );
    }

    #[test]
    fn options_over_a_tenant_cap_are_refused_naming_option_and_cap() {
        let caps = TenantLimits {
            memory_limit: Some(ByteSize::mib(32)),
            cpu_limit: Some(Duration::from_millis(50)),
            max_publishes_per_second: Some(10),
            ..TenantLimits::default()
        };
        let err = caps
            .options_from_pairs([("memory_limit", "64MiB")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("memory_limit"), "{err}");
        assert!(err.contains("32.0 MiB"), "{err}");
        assert!(err.contains("tenant's cap"), "{err}");
        let err = caps
            .options_from_pairs([("max_publishes_per_second", "11")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_publishes_per_second (11)"), "{err}");
        // The tenant's defaults fit its caps, and options within them pass.
        let log_caps = TenantLimits {
            max_log_lines_per_second: Some(10),
            max_log_bytes_per_second: Some(ByteSize::kib(10)),
            ..TenantLimits::default()
        };
        let o = log_caps.options_from_pairs([]).unwrap();
        assert_eq!(o.max_log_lines_per_second, 10);
        assert_eq!(o.max_log_bytes_per_second, ByteSize::kib(10));
        let err = log_caps
            .options_from_pairs([("max_log_bytes_per_second", "1MiB")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_log_bytes_per_second"), "{err}");
        let o = caps.options_from_pairs([]).unwrap();
        assert_eq!(o.memory_limit, ByteSize::mib(32));
        assert_eq!(o.cpu_limit, Duration::from_millis(50));
        assert_eq!(o.max_publishes_per_second, 10);
        caps.options_from_pairs([("memory_limit", "16MiB")])
            .unwrap();
        // No caps: anything the node takes.
        TenantLimits::default()
            .check(&ModuleOptions {
                memory_limit: ByteSize::gib(1),
                ..ModuleOptions::default()
            })
            .unwrap();
    }

    #[test]
    fn a_message_size_cap_applies_to_modules_without_their_own() {
        let caps = TenantLimits {
            max_message_size: Some(ByteSize::kib(64)),
            ..TenantLimits::default()
        };
        assert_eq!(caps.defaults().max_message_size, Some(ByteSize::kib(64)));
        let err = caps
            .check(&ModuleOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_message_size is unset"), "{err}");
        let err = caps
            .options_from_pairs([("max_message_size", "1MiB")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("max_message_size"), "{err}");
    }

    #[test]
    fn a_tenant_names_only_directories_it_was_granted() {
        let root = std::env::temp_dir().join(format!("fief-sandbox-{}", std::process::id()));
        let granted = root.join("tenant");
        let inner = granted.join("inner");
        let other = root.join("other");
        std::fs::create_dir_all(&inner).unwrap();
        std::fs::create_dir_all(&other).unwrap();
        let grant = |p: &Path, mode: &str| -> DirGrant {
            format!("{}:{mode}", p.display()).parse().unwrap()
        };
        let caps = TenantLimits {
            allowed_dirs: vec![grant(&granted, "ro")],
            ..TenantLimits::default()
        };
        let with_dir = |d: DirGrant| ModuleOptions {
            dir: Some(d),
            ..ModuleOptions::default()
        };
        caps.check(&with_dir(grant(&inner, "ro"))).unwrap();
        let err = caps
            .check(&with_dir(grant(&inner, "rw")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not granted"), "more permission: {err}");
        let err = caps
            .check(&with_dir(grant(&other, "ro")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("not granted"), "{err}");
        // `..` does not climb out of the grant.
        let escape = granted.join("..").join("other");
        assert!(caps.check(&with_dir(grant(&escape, "ro"))).is_err());
        // A tenant without grants names none.
        let err = TenantLimits::default()
            .check(&with_dir(grant(&inner, "ro")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("allowed_dirs: none"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
