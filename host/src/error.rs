//! The errors a caller of a Fief instance can see.
//!
//! One enum for the public boundary (library, HTTP and CLI). Every variant
//! says what is wrong and, where there is one, what to do about it; each has
//! a stable machine-readable [`Error::code`] and an HTTP status. Errors are
//! per request: none of them stops the node from serving other keys.
//!
//! A value below every other module of the crate: it imports nothing of it.
//! What a variant carries is a plain value ([`Refusal`], strings, numbers);
//! a part's own error becomes an [`Error`] in that part (the arbiter's
//! `ArbiterError` in `arbiter/`), never here.

use std::fmt;
use std::time::Duration;

use fief_core::PartitionId;

/// An error from a Fief instance.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// No module of that name is deployed.
    #[error("unknown module {0:?}: deploy it first (`fief deploy FILE.wasm --module {0}`)")]
    UnknownModule(String),
    /// The key is empty, too long, or otherwise unusable.
    #[error("invalid key: {0}")]
    InvalidKey(String),
    /// The module name is unusable.
    #[error("invalid module name {name:?}: {why}")]
    InvalidModuleName {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// A message is over the node's size limit.
    #[error(
        "message of {size} bytes is over the limit of {limit} bytes; send a smaller message or raise max_message_size"
    )]
    MessageTooLarge {
        /// The message's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A key's reply is over the node's size limit; the key is fine, the
    /// reply was dropped.
    #[error(
        "the key's reply of {size} bytes is over the limit of {limit} bytes (the module's max_reply_size, at most the node's max_message_size); the reply was dropped"
    )]
    ReplyTooLarge {
        /// The reply's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// A key's `handoff` state is over its module's limit: that key's state
    /// cannot travel with a move (the move goes on; the loss is reported).
    #[error(
        "the key's handoff state of {size} bytes is over the limit of {limit} bytes (the module's max_handoff_size, at most the node's max_message_size); it was not handed on"
    )]
    HandoffTooLarge {
        /// The state's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The uploaded bytes are not a usable key module.
    #[error("invalid module: {0}")]
    InvalidModule(String),
    /// A module option has a bad value or does not fit the node's limits.
    #[error("invalid module options: {0}")]
    InvalidOptions(String),
    /// This node cannot prove its lease is current and serves no key.
    #[error(
        "this node is fenced: it cannot prove its lease is current and serves no key; retry on another node or after it rejoins"
    )]
    Fenced,
    /// The node fenced while leaving: the keys it still held were stopped by
    /// the fence, not handed off. The leave was finished all the same.
    #[error(
        "the node fenced while leaving (it could not renew its lease in time): keys it still held were stopped by the fence, not handed off (their state is lost); the node has left the cluster all the same"
    )]
    FencedWhileLeaving,
    /// The key's partition has no owner at the moment.
    #[error("partition {0} has no owner right now (a move is under way); retry shortly")]
    Unowned(PartitionId),
    /// Another node owns the key and this node could not forward to it.
    #[error("key is owned by node {owner:?}, which could not be reached: {why}")]
    OwnerUnreachable {
        /// The owner per this node's table.
        owner: String,
        /// What went wrong.
        why: String,
    },
    /// A message was sent to the key's owner, and the connection closed
    /// before its answer came back: the owner may have processed it. It is
    /// not retried on another route (that could process it twice).
    #[error(
        "the message reached node {owner:?}, the key's owner, but the connection closed before its answer came back: it may or may not have been processed; retry only if processing it twice is harmless"
    )]
    AnswerLost {
        /// The owner the message was sent to.
        owner: String,
    },
    /// A second `leave` while one is under way on this node.
    #[error(
        "a leave is already under way on this node; wait for it (GET /v1/status shows the node leaving)"
    )]
    AlreadyLeaving,
    /// This node received a forwarded message for a key it does not own.
    #[error(
        "this node does not own the key (its table names {owner:?}); the sender's table is stale, retry shortly"
    )]
    NotOwner {
        /// The owner per this node's table, if any.
        owner: String,
    },
    /// An error the owner of a key answered with, passed through.
    #[error("{message}")]
    Remote {
        /// The owner's error code.
        code: String,
        /// The HTTP status for it.
        status: u16,
        /// The owner's message.
        message: String,
    },
    /// The key's mailbox is full.
    #[error(
        "key {key:?} of module {module:?} is overloaded: its mailbox of {depth} messages is full; retry later"
    )]
    Overloaded {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// The mailbox depth.
        depth: usize,
    },
    /// The key (or its tenant) holds as many bytes of host memory as it may:
    /// the message was not queued.
    #[error("key {key:?} of module {module:?} refused a message: {refusal}")]
    HostMemory {
        /// The module.
        module: String,
        /// The key.
        key: String,
        /// Which ledger was full, and its numbers.
        refusal: Refusal,
    },
    /// The tenant already has a deploy compiling on this node.
    #[error(
        "tenant {tenant:?} already has a deploy compiling on this node (one at a time per tenant); retry when it finishes"
    )]
    CompileBusy {
        /// The tenant.
        tenant: String,
    },
    /// The module already has its maximum number of live keys on this node,
    /// and none of them is idle (none could be evicted).
    #[error(
        "module {module:?} already has {limit} live keys on this node (max_live_keys) and every one is busy \
         (in a callback, with messages queued, or with a timer armed), so none could be evicted to make room; \
         retry later or raise the limit"
    )]
    TooManyKeys {
        /// The module.
        module: String,
        /// Its limit.
        limit: u32,
    },
    /// The node's instance pool has no free slot of some kind for a new
    /// key, and no idle key could be evicted for one: every live key is
    /// busy, or the module's components need more pool slots per key (core
    /// instances, memories, tables) than the pool sets aside per
    /// `max_live_keys`.
    #[error(
        "cannot start a key of module {module:?}: this node's instance pool is full ({detail}) and no idle \
         key could be evicted to make room: every live key is busy, or this module's keys need more than \
         the 4 core instances, 2 memories and 4 tables the pool sets aside per key of the node's \
         max_live_keys; retry later or raise the node's max_live_keys"
    )]
    PoolFull {
        /// The module.
        module: String,
        /// Which pool ran out, in wasmtime's words.
        detail: String,
    },
    /// The key's `init` refused to start.
    #[error("key refused to start: init returned: {0}")]
    InitRefused(String),
    /// The key's `handle-call` returned an error.
    #[error("key returned an error: {0}")]
    Rejected(String),
    /// The key process died while handling the message (trap, CPU or memory
    /// limit, kill). The next message starts a fresh process.
    #[error("key process died: {0}")]
    KeyDied(String),
    /// The call got no reply in time.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// The key would wait for itself.
    #[error("a key cannot call itself: the call would wait on its own mailbox forever")]
    Deadlock,
    /// The instance is shutting down.
    #[error("the node is shutting down")]
    ShuttingDown,
    /// A configuration value cannot work.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The HTTP endpoint exists but not with this method.
    #[error("{0}; GET /v1/openapi.json lists every route and its methods")]
    MethodNotAllowed(String),
    /// No such HTTP endpoint.
    #[error("no such endpoint: {0}; GET /v1/openapi.json lists every route")]
    NoSuchEndpoint(String),
    /// The request line (method, URI, version) is over the API's limit.
    #[error(
        "the request line is over the limit of {limit} bytes; send a shorter path and query (large data goes in the body)"
    )]
    UriTooLong {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The request's head (request line and headers) is over the API's
    /// limits.
    #[error(
        "the request's headers are over the limit of {limit} bytes or {fields} header fields; send fewer or smaller headers"
    )]
    HeadersTooLarge {
        /// The limit on the whole head, in bytes.
        limit: usize,
        /// The limit on header fields.
        fields: usize,
    },
    /// Every API connection the node allows is open and busy with a request.
    #[error(
        "this node has its maximum of {limit} API connections open, each busy with a request; retry shortly"
    )]
    TooManyConnections {
        /// The node's `http_max_connections`.
        limit: usize,
    },
    /// A WebSocket connect past the node's or the tenant's connection limit.
    #[error(
        "{scope} holds its maximum of {limit} WebSocket connections on this node; close some, connect to another node, or ask the operator to raise {option}"
    )]
    TooManySockets {
        /// Who is full: "this node" or "tenant <name>".
        scope: String,
        /// The limit.
        limit: usize,
        /// The option that sets it.
        option: &'static str,
    },
    /// A WebSocket connect to a module that takes no connections.
    #[error(
        "module {0} takes no WebSocket connections: it exports no fief:key/connection-handler (build it for the key-module-realtime world; with the Rust SDK, implement `Key::connection_opened` and the others)"
    )]
    NotConnectable(String),
    /// A request to the WebSocket endpoint that is not a WebSocket upgrade.
    #[error(
        "{0}: connect with a WebSocket client (GET with `Connection: upgrade`, `Upgrade: websocket`)"
    )]
    UpgradeRequired(String),
    /// A cache write's precondition (`If-Match` / `If-None-Match`) did not
    /// hold; nothing was written.
    #[error(
        "version conflict: the entry's current version is {}; read it again and retry the write",
        current.map_or_else(|| "none (there is no entry)".to_owned(), |v| v.to_string())
    )]
    VersionConflict {
        /// The entry's version now, if there is one.
        current: Option<u64>,
    },
    /// A cache entry bigger than the node's whole cache.
    #[error(
        "a cache entry of {size} bytes (value, names and bookkeeping) is over the cache's bound of {limit} bytes; store less or raise cache_max_bytes"
    )]
    CacheEntryTooLarge {
        /// The entry's charge.
        size: usize,
        /// The bound.
        limit: usize,
    },
    /// The cache has no room for an entry: the rest of its bound holds
    /// other tenants' entries, which a tenant's write never evicts.
    #[error(
        "the cache has no room for an entry of {size} bytes: its bound of {limit} bytes is held by other tenants' entries, which one tenant's writes never evict; store less, retry later, or raise cache_max_bytes"
    )]
    CacheFull {
        /// The entry's charge.
        size: usize,
        /// The store's bound.
        limit: usize,
    },
    /// The API request carries no valid token, and the node requires one
    /// ([`crate::auth`]).
    #[error("unauthorized: {0}")]
    Unauthorized(String),
    /// The caller's token does not allow this operation (a tenant asking
    /// for a cluster operation).
    #[error("forbidden: {0}")]
    Forbidden(String),
    /// The module has no such stored version (a rollback to a version that
    /// was never deployed or was removed).
    #[error(
        "module {module:?} has no version {version} (stored versions: {stored}); `fief modules` lists them"
    )]
    UnknownModuleVersion {
        /// The module.
        module: String,
        /// The version asked for.
        version: u64,
        /// The stored versions, comma-separated.
        stored: String,
    },
    /// The module store (in the arbiter) could not be read or written.
    #[error(
        "the module store is unavailable: {0}; nothing was changed, retry when the arbiter is reachable"
    )]
    ModuleStore(String),
    /// The arbiter refused a leave's first steps (`set_leaving`,
    /// `live_nodes`), or did not answer them until the leave's deadline.
    #[error(
        "the leave could not get through to the arbiter: {0}; the node still holds its lease and serves (it may be marked as leaving, and then its partitions move away); run the leave again when the arbiter is reachable"
    )]
    ArbiterUnavailable(String),
    /// A key's durable state could not be loaded or its commit did not
    /// succeed (the store is unreachable or failed, or the process's
    /// ownership ended): no reply was sent for writes that may not have
    /// landed.
    #[error("{0}; retry: the key's next process loads what was committed")]
    StorageUnavailable(String),
    /// Something that should not happen; a bug.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    /// A stable, machine-readable name for the error.
    pub fn code(&self) -> &str {
        match self {
            Error::Remote { code, .. } => code,
            Error::UnknownModule(_) => "unknown_module",
            Error::InvalidKey(_) => "invalid_key",
            Error::InvalidModuleName { .. } => "invalid_module_name",
            Error::MessageTooLarge { .. } => "message_too_large",
            Error::ReplyTooLarge { .. } => "reply_too_large",
            Error::HandoffTooLarge { .. } => "handoff_too_large",
            Error::InvalidModule(_) => "invalid_module",
            Error::InvalidOptions(_) => "invalid_options",
            Error::Fenced | Error::FencedWhileLeaving => "fenced",
            Error::Unowned(_) => "unowned",
            Error::OwnerUnreachable { .. } => "owner_unreachable",
            Error::AnswerLost { .. } => "answer_lost",
            Error::AlreadyLeaving => "already_leaving",
            Error::NotOwner { .. } => "not_owner",
            Error::Overloaded { .. } => "overloaded",
            Error::TooManySockets { .. } => "too_many_connections",
            Error::NotConnectable(_) => "not_connectable",
            Error::UpgradeRequired(_) => "upgrade_required",
            Error::HostMemory { .. } => "host_memory",
            Error::CompileBusy { .. } => "compile_busy",
            Error::TooManyKeys { .. } | Error::PoolFull { .. } => "too_many_keys",
            Error::InitRefused(_) => "init_refused",
            Error::Rejected(_) => "rejected",
            Error::KeyDied(_) => "key_died",
            Error::Timeout(_) => "timeout",
            Error::Deadlock => "deadlock",
            Error::ShuttingDown => "shutting_down",
            Error::Config(_) => "invalid_config",
            Error::NoSuchEndpoint(_) => "no_such_endpoint",
            Error::MethodNotAllowed(_) => "method_not_allowed",
            Error::UriTooLong { .. } => "uri_too_long",
            Error::HeadersTooLarge { .. } => "headers_too_large",
            Error::TooManyConnections { .. } => "too_many_connections",
            Error::VersionConflict { .. } => "version_conflict",
            Error::CacheEntryTooLarge { .. } => "cache_entry_too_large",
            Error::CacheFull { .. } => "cache_full",
            Error::Unauthorized(_) => "unauthorized",
            Error::Forbidden(_) => "forbidden",
            Error::UnknownModuleVersion { .. } => "unknown_module_version",
            Error::ModuleStore(_) => "module_store_unavailable",
            Error::ArbiterUnavailable(_) => "arbiter_unavailable",
            Error::StorageUnavailable(_) => "storage_unavailable",
            Error::Internal(_) => "internal",
        }
    }

    /// The HTTP status the API answers this error with.
    pub fn http_status(&self) -> u16 {
        match self {
            Error::UnknownModule(_)
            | Error::NoSuchEndpoint(_)
            | Error::UnknownModuleVersion { .. } => 404,
            Error::InvalidKey(_)
            | Error::InvalidModuleName { .. }
            | Error::InvalidOptions(_)
            | Error::Config(_) => 400,
            Error::MessageTooLarge { .. }
            | Error::CacheEntryTooLarge { .. }
            | Error::HandoffTooLarge { .. } => 413,
            Error::VersionConflict { .. } => 412,
            Error::InvalidModule(_) | Error::InitRefused(_) | Error::Rejected(_) => 422,
            Error::Deadlock | Error::AlreadyLeaving | Error::NotConnectable(_) => 409,
            Error::MethodNotAllowed(_) => 405,
            Error::UpgradeRequired(_) => 426,
            Error::Overloaded { .. }
            | Error::HostMemory { .. }
            | Error::TooManyKeys { .. }
            | Error::PoolFull { .. }
            | Error::CacheFull { .. }
            | Error::TooManySockets { .. }
            | Error::CompileBusy { .. } => 429,
            Error::UriTooLong { .. } => 414,
            Error::HeadersTooLarge { .. } => 431,
            Error::KeyDied(_) | Error::Internal(_) => 500,
            Error::OwnerUnreachable { .. }
            | Error::AnswerLost { .. }
            | Error::ReplyTooLarge { .. } => 502,
            Error::Fenced
            | Error::FencedWhileLeaving
            | Error::Unowned(_)
            | Error::ShuttingDown
            | Error::TooManyConnections { .. }
            | Error::NotOwner { .. }
            | Error::ModuleStore(_)
            | Error::ArbiterUnavailable(_)
            | Error::StorageUnavailable(_) => 503,
            Error::Remote { status, .. } => *status,
            Error::Timeout(_) => 504,
            Error::Unauthorized(_) => 401,
            Error::Forbidden(_) => 403,
        }
    }
}

/// Why a charge of host memory was refused: the ledger that was full and
/// its numbers (the ledgers are `host_bytes.rs`'s, which re-exports this).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// `key` or `tenant "acme"`.
    pub scope: String,
    /// Bytes already held.
    pub used: usize,
    /// The limit.
    pub limit: usize,
    /// The bytes asked for.
    pub asked: usize,
    /// The option that sets the limit.
    pub option: &'static str,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the {} already holds {} bytes of host memory (queued messages, timer tags, \
             subscriptions, handoff states) and {} more would pass its limit of {} bytes \
             ({}); retry once it has drained its mailbox, or raise {}",
            self.scope, self.used, self.asked, self.limit, self.option, self.option
        )
    }
}

/// Shorthand for results with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
