//! Durable per-key state: the backends that keep it and the contract they
//! keep, fenced by the ownership token.
//!
//! A key process's stored state is a sorted map of names to values, scoped
//! to its module (whose stored name carries its tenant) and its key. The
//! node reaches a backend only through [`Backend::round`]: one transaction
//! that applies a batch of commits and then serves a batch of loads
//! (group commit). Every commit and load names its partition and the
//! ownership token its process was started under, and the backend holds one
//! *fence token* per partition:
//!
//! - a **load** raises the partition's fence token to its own token (or
//!   refuses, [`Outcome::Stale`], when the stored token is already higher),
//!   then reads the key's state: once a new owner has loaded a key, no
//!   commit of an older owner can land;
//! - a **commit** lands only if the partition's fence token still equals
//!   its own token; otherwise it is refused as [`Outcome::Stale`] and none
//!   of its writes is applied.
//!
//! Inside one round, commits are applied before loads are read, so a load
//! sees every commit that was in the same round or earlier. A round is
//! atomic: it lands whole (each commit landing or refused as stale) or not
//! at all ([`BackendError`]).
//!
//! A key's state also holds its durable alarms (`docs/alarms.md`): a commit
//! sets and cancels them with [`Write::SetAlarm`] and [`Write::CancelAlarm`],
//! applied with its other writes under the same fence check (a stale commit
//! applies none), and a key's load returns them ([`Loaded::alarms`]). The
//! alarm rows are kept by partition, so a round can also load a whole
//! partition's alarms for its new owner ([`Round::partition_alarms`]): such
//! a load raises the partition's fence token exactly as a key load does.
//!
//! This module owns the contract and its types. It must not know about key
//! processes, the output gate or routing (`crate::storage::gate` and the
//! key layer do), and a backend must not decide anything but the fence
//! check written above.

use std::future::Future;
use std::pin::Pin;

pub use fief_core::alarm::{AlarmId, StoredAlarm};

#[cfg(test)]
mod contract_tests;
mod embedded;
mod landed;
mod plan;
mod postgres;
pub(crate) mod state;
mod unsettled;
pub(crate) mod writer;

pub use embedded::EmbeddedBackend;
pub use postgres::PostgresBackend;
pub use state::MAX_NAME_BYTES;

/// A future a backend returns (the trait is used as `Arc<dyn Backend>`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Entries of one key, `(name, value)`, sorted by name.
pub type Entries = Vec<(String, Vec<u8>)>;

/// Whose state: one key of one module (the module's stored name, which
/// carries its tenant: `acme/counter`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct KeyScope {
    /// The module's stored name.
    pub module: String,
    /// The key.
    pub key: String,
}

impl KeyScope {
    /// The tenant owning this state (`""` for a module of no tenant); quota
    /// is counted per tenant.
    pub fn tenant(&self) -> &str {
        crate::auth::tenant_of(&self.module).unwrap_or("")
    }
}

/// Where a process stands: its key's partition and the ownership token its
/// process was started under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    /// The key's partition.
    pub partition: u32,
    /// The partition's ownership token on the node that runs the process.
    pub token: u64,
}

/// One write of a commit, applied in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    /// Set `name` to `value`.
    Put {
        /// The entry's name.
        name: String,
        /// Its new value.
        value: Vec<u8>,
    },
    /// Remove `name` (no-op if absent).
    Delete {
        /// The entry's name.
        name: String,
    },
    /// Remove every entry whose name is `>= start` and, with an `end`,
    /// `< end` (byte order).
    DeleteRange {
        /// The first name removed.
        start: String,
        /// The first name kept, if any.
        end: Option<String>,
    },
    /// Set the key's alarm `name` to fire at `at_ms` (milliseconds since the
    /// Unix epoch), replacing an alarm of that name. Alarm names are apart
    /// from entry names: no entry write touches an alarm.
    SetAlarm {
        /// The alarm's name.
        name: String,
        /// When it is due.
        at_ms: u64,
    },
    /// Cancel the key's alarm `name` (none: nothing happens).
    CancelAlarm {
        /// The alarm's name.
        name: String,
    },
}

/// The writes of one callback of one key process, to land atomically.
#[derive(Clone, Debug)]
pub struct Commit {
    /// Whose state.
    pub scope: KeyScope,
    /// The process's partition and token: checked against the partition's
    /// fence token in the round's transaction.
    pub fence: Fence,
    /// The writes, in the order the guest made them.
    pub writes: Vec<Write>,
    /// How many bytes (names plus values) the key's state grows by when the
    /// commit lands (negative: shrinks), as the process computed it from its
    /// own copy; added to the tenant's usage.
    pub bytes_delta: i64,
}

/// A request to read one key's whole state, raising its partition's fence
/// token first.
#[derive(Clone, Debug)]
pub struct Load {
    /// Whose state.
    pub scope: KeyScope,
    /// The loading process's partition and token.
    pub fence: Fence,
}

/// What one round asks: commits first, then loads, then partitions' alarm
/// loads.
#[derive(Clone, Debug, Default)]
pub struct Round {
    /// Applied first, each checked against its partition's fence token.
    pub commits: Vec<Commit>,
    /// Read after the commits, each raising its partition's fence token.
    pub loads: Vec<Load>,
    /// Every alarm of a partition, for the node that starts serving it
    /// under the token in the fence: read after the key loads, each raising
    /// its partition's fence token as a key load does (and refused, stale,
    /// when it is higher).
    pub partition_alarms: Vec<Fence>,
}

impl Round {
    /// Whether it asks nothing (a backend answers it without a transaction).
    pub fn is_empty(&self) -> bool {
        self.commits.is_empty() && self.loads.is_empty() && self.partition_alarms.is_empty()
    }
}

/// A key's state as loaded: entries and alarms sorted by name, and its
/// tenant's usage.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// Every entry of the key, sorted by name (byte order).
    pub entries: Vec<(String, Vec<u8>)>,
    /// Every alarm of the key, `(name, at_ms)`, sorted by name (byte order).
    pub alarms: Vec<(String, u64)>,
    /// The bytes stored for the key's tenant (every key of every module of
    /// the tenant), after this round's commits.
    pub tenant_bytes: u64,
}

/// What became of one commit or one load of a round that landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome<T> {
    /// Applied (a commit) or read (a load).
    Done(T),
    /// The partition's fence token is `current`, which is not this
    /// process's token: a newer owner has loaded the partition (or, for a
    /// commit, this process never loaded under its token). Nothing was
    /// written.
    Stale {
        /// The partition's fence token in the store.
        current: u64,
    },
}

/// What a round that landed answers: one outcome per commit and per load,
/// in the order asked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundResult {
    /// One per commit; `Done` carries the tenant's stored bytes after it.
    pub commits: Vec<Outcome<u64>>,
    /// One per load.
    pub loads: Vec<Outcome<Loaded>>,
    /// One per partition's alarm load: its alarms, sorted by
    /// (module, key, name).
    pub partition_alarms: Vec<Outcome<Vec<StoredAlarm>>>,
}

/// Why a round did not land: none of it was applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BackendError {
    /// The store cannot be reached or failed (disk full, connection lost,
    /// server error); retrying later may work.
    #[error("storage unavailable: {0}")]
    Unavailable(String),
}

/// A store of durable key state. Implementations: the embedded one
/// (`redb`, a file in the node's data directory, or memory) and PostgreSQL.
pub trait Backend: Send + Sync + 'static {
    /// A line for `fief status`: the kind and where (`embedded
    /// /var/lib/fief/state.redb`, `postgres 127.0.0.1:5432/fief`), no secret.
    fn describe(&self) -> String;

    /// Apply `round` in one transaction, as the module header says.
    fn round(&self, round: Round) -> BoxFuture<'_, Result<RoundResult, BackendError>>;

    /// Answer `load` at once, on the caller's thread, from a read of what
    /// has landed, when it needs no write: the partition's stored fence
    /// token already is the load's (a `Done` read) or is higher (`Stale`).
    /// `None` sends it through a round: the load raises the token, or the
    /// backend does not read this way (the default). Its answer must be what
    /// a round holding only this load would answer.
    ///
    /// A backend may answer only if its rounds land one after another: a
    /// round abandoned by its caller (timed out) has landed or failed before
    /// the next round returns. The writer reads beside its rounds only for a
    /// key with no commit in flight and no abandoned round since the last
    /// answered one (`writer.rs`, `storage/unsettled.rs`).
    fn read_load(&self, load: &Load) -> Option<Result<Outcome<Loaded>, BackendError>> {
        let _ = load;
        None
    }

    /// Read up to `limit` entries of a key whose names start with `prefix`,
    /// sorted, for operators (`fief state`, `GET /v1/state`): no fence token
    /// is raised, so it sees what has been committed, not a live owner's
    /// uncommitted writes.
    fn read(
        &self,
        scope: KeyScope,
        prefix: String,
        limit: u32,
    ) -> BoxFuture<'_, Result<Entries, BackendError>>;

    /// A key's alarms, `(name, at_ms)` sorted by name, as committed (its
    /// `partition` locates the rows), for operators (`fief alarms`): no
    /// fence token is raised.
    fn read_alarms(
        &self,
        scope: KeyScope,
        partition: u32,
    ) -> BoxFuture<'_, Result<Vec<(String, u64)>, BackendError>>;

    /// The highest fence token stored for any partition (0 for a new
    /// store). An arbiter that starts afresh on an existing store (the
    /// embedded one, at every node start) numbers its tables above it, so
    /// the ownership tokens it grants are never below a token the store has
    /// seen: otherwise every load would be refused as stale and the keys
    /// could never run again.
    fn highest_fence_token(&self) -> BoxFuture<'_, Result<u64, BackendError>>;
}

/// The backend a node's configuration names (`storage`, `data_dir`; see
/// [`NodeConfig::storage`](crate::NodeConfig::storage)).
///
/// # Errors
///
/// [`Error::Config`](crate::Error::Config) when the store cannot be opened,
/// saying which and why.
pub(crate) async fn open(config: &crate::NodeConfig) -> crate::Result<std::sync::Arc<dyn Backend>> {
    let postgres_arbiter = config.arbiter.starts_with("postgres");
    let chosen = match config.storage.as_deref() {
        Some(named) => named,
        None if postgres_arbiter => config.arbiter.as_str(),
        None => "embedded",
    };
    let opened: Result<std::sync::Arc<dyn Backend>, BackendError> = match chosen {
        "embedded" | "memory" => match (chosen, &config.data_dir) {
            ("embedded", Some(dir)) => EmbeddedBackend::open(&dir.join("state.redb")),
            _ => EmbeddedBackend::in_memory(),
        }
        .map(|b| std::sync::Arc::new(b) as _),
        url if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            PostgresBackend::connect(url, &config.namespace)
                .await
                .map(|b| std::sync::Arc::new(b) as _)
        }
        other => {
            return Err(crate::Error::Config(format!(
                "storage {other:?}: name `embedded`, `memory` or a postgres:// URL"
            )));
        }
    };
    opened.map_err(|e| {
        crate::Error::Config(format!(
            "storage {chosen:?} cannot be opened: {e}; check that it is reachable and not held by another node"
        ))
    })
}

/// Most entries one operator's read returns.
pub const MAX_STATE_READ: u32 = 1000;

/// One stored entry, as operators read it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct StoredEntry {
    /// The entry's name.
    pub name: String,
    /// Its value, as stored: `{"utf8": "…"}` when it is UTF-8 text,
    /// `{"hex": "…"}` otherwise.
    #[serde(with = "value_text")]
    #[schema(value_type = StoredValue)]
    pub value: Vec<u8>,
}

/// The JSON form of a [`StoredEntry`]'s value, for the API's OpenAPI
/// document: only its schema is used (`value_text` serializes).
pub struct StoredValue;

impl utoipa::PartialSchema for StoredValue {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let schema = serde_json::json!({
            "description": "`{\"utf8\": text}` when the value is UTF-8, `{\"hex\": lowercase hex}` otherwise",
            "oneOf": [
                {"type": "object", "required": ["utf8"], "additionalProperties": false,
                 "properties": {"utf8": {"type": "string"}}},
                {"type": "object", "required": ["hex"], "additionalProperties": false,
                 "properties": {"hex": {"type": "string", "pattern": "^([0-9a-f]{2})*$"}}}
            ]
        });
        serde_json::from_value(schema)
            .unwrap_or_else(|_| utoipa::openapi::schema::Object::new().into())
    }
}

impl utoipa::ToSchema for StoredValue {}

/// Values travel in JSON as `{"utf8": "..."}` when they are UTF-8 and as
/// `{"hex": "..."}` otherwise.
mod value_text {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    enum Text {
        Utf8(String),
        Hex(String),
    }

    pub fn serialize<S: Serializer>(value: &[u8], s: S) -> Result<S::Ok, S::Error> {
        match std::str::from_utf8(value) {
            Ok(text) => Text::Utf8(text.to_owned()),
            Err(_) => Text::Hex(value.iter().map(|b| format!("{b:02x}")).collect()),
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        match Text::deserialize(d)? {
            Text::Utf8(text) => Ok(text.into_bytes()),
            Text::Hex(hex) => (0..hex.len())
                .step_by(2)
                .map(|i| {
                    hex.get(i..i + 2)
                        .and_then(|pair| u8::from_str_radix(pair, 16).ok())
                        .ok_or_else(|| {
                            serde::de::Error::custom("a hex value is pairs of hex digits")
                        })
                })
                .collect(),
        }
    }
}

/// An operator's read of `key` of `module` (see [`crate::Instance::stored_state`]).
pub(crate) async fn read_for_operator(
    backend: &std::sync::Arc<dyn Backend>,
    module: &str,
    key: &str,
    prefix: &str,
    limit: u32,
) -> crate::Result<Vec<StoredEntry>> {
    crate::config::validate_key(key)?;
    if prefix.len() > MAX_NAME_BYTES {
        return Err(crate::Error::InvalidKey(format!(
            "a state read's prefix is at most {MAX_NAME_BYTES} bytes"
        )));
    }
    if limit == 0 || limit > MAX_STATE_READ {
        return Err(crate::Error::InvalidKey(format!(
            "limit {limit}: a state read returns 1 to {MAX_STATE_READ} entries"
        )));
    }
    let scope = KeyScope {
        module: module.to_owned(),
        key: key.to_owned(),
    };
    let entries = backend
        .read(scope, prefix.to_owned(), limit)
        .await
        .map_err(|e| crate::Error::StorageUnavailable(e.to_string()))?;
    Ok(entries
        .into_iter()
        .map(|(name, value)| StoredEntry { name, value })
        .collect())
}
