//! The error catalogue of the OpenAPI document ([`super`]): every error
//! code the API answers, with its status and when; and the sets of errors
//! that many operations share. Checked against [`crate::Error`]'s `code()`
//! and `http_status()` by `super::tests`. It must not decide a status: those
//! are [`crate::Error::http_status`]'s.

/// The error catalogue: `(name, code, status, when)`. The name is the code,
/// except for a code answered with two statuses (`too_many_sockets` is
/// `too_many_connections` with 429). `not_found` is the cache's miss, the
/// only error body that is not an [`Error`](crate::Error).
#[rustfmt::skip]
pub const ERRORS: &[(&str, &str, u16, &str)] = &[
    ("invalid_key", "invalid_key", 400, "a key, cache namespace, header or query is malformed"),
    ("invalid_module_name", "invalid_module_name", 400, "the module name is malformed"),
    ("invalid_options", "invalid_options", 400, "a module option or the query is malformed or over a ceiling"),
    ("invalid_config", "invalid_config", 400, "a configuration value cannot work"),
    ("unauthorized", "unauthorized", 401, "the node has tokens and the request has no valid `Authorization: Bearer TOKEN`"),
    ("forbidden", "forbidden", 403, "a tenant's token asked for a cluster operation"),
    ("unknown_module", "unknown_module", 404, "no such module (or it is another tenant's)"),
    ("unknown_module_version", "unknown_module_version", 404, "the module has no such stored version"),
    ("no_such_endpoint", "no_such_endpoint", 404, "no such route"),
    ("not_found", "not_found", 404, "no cache entry under that key"),
    ("method_not_allowed", "method_not_allowed", 405, "the route does not take this method"),
    ("deadlock", "deadlock", 409, "a key would wait for itself"),
    ("already_leaving", "already_leaving", 409, "a leave is already under way"),
    ("not_connectable", "not_connectable", 409, "the module takes no WebSocket connections"),
    ("version_conflict", "version_conflict", 412, "the cache write's `If-Match` / `If-None-Match` did not hold"),
    ("message_too_large", "message_too_large", 413, "the body is over the node's `max_message_size`"),
    ("cache_entry_too_large", "cache_entry_too_large", 413, "the entry is bigger than the whole cache"),
    ("handoff_too_large", "handoff_too_large", 413, "a key's handoff state is over its limit"),
    ("uri_too_long", "uri_too_long", 414, "the request line is over the limit"),
    ("invalid_module", "invalid_module", 422, "the body is not a usable key module"),
    ("init_refused", "init_refused", 422, "the key's `init` refused to start"),
    ("rejected", "rejected", 422, "the key's `handle-call` returned an error (the key's own answer)"),
    ("upgrade_required", "upgrade_required", 426, "the request is not a WebSocket upgrade"),
    ("overloaded", "overloaded", 429, "the key's mailbox is full"),
    ("host_memory", "host_memory", 429, "the key or its tenant holds all the host memory it may"),
    ("too_many_keys", "too_many_keys", 429, "no room for another live key, and none idle to evict"),
    ("cache_full", "cache_full", 429, "the cache's bound is held by other tenants' entries"),
    ("too_many_sockets", "too_many_connections", 429, "the node's or tenant's WebSocket connection limit is reached"),
    ("compile_busy", "compile_busy", 429, "the tenant has a deploy compiling already"),
    ("headers_too_large", "headers_too_large", 431, "the request's headers are over the limits"),
    ("key_died", "key_died", 500, "the key process died handling the message (trap, CPU or memory limit, kill)"),
    ("internal", "internal", 500, "a bug"),
    ("owner_unreachable", "owner_unreachable", 502, "the key's owner could not be reached"),
    ("answer_lost", "answer_lost", 502, "the owner may have processed the message, but its answer was lost"),
    ("reply_too_large", "reply_too_large", 502, "the key's reply is over its limit"),
    ("fenced", "fenced", 503, "this node is fenced (or fenced while leaving)"),
    ("unowned", "unowned", 503, "the key's partition has no owner right now (a move is under way)"),
    ("shutting_down", "shutting_down", 503, "the node is shutting down"),
    ("too_many_connections", "too_many_connections", 503, "every API connection the node allows is open and busy"),
    ("not_owner", "not_owner", 503, "a forwarded message reached a node that does not own the key"),
    ("module_store_unavailable", "module_store_unavailable", 503, "the module store (in the arbiter) could not be read or written"),
    ("arbiter_unavailable", "arbiter_unavailable", 503, "the leave could not get through to the arbiter"),
    ("storage_unavailable", "storage_unavailable", 503, "the key's durable state could not be read or committed"),
    ("timeout", "timeout", 504, "no answer in time"),
];

/// Errors any authenticated operation can answer: a missing token, and
/// the connection loop's refusals (`crate::listener`).
pub(super) const COMMON: &[&str] = &[
    "unauthorized",
    "uri_too_long",
    "headers_too_large",
    "too_many_connections",
];

/// The connection loop's refusals only, for the operations that need no
/// token.
pub(super) const PUBLIC: &[&str] = &["uri_too_long", "headers_too_large", "too_many_connections"];

/// Routing to a key's owner.
pub(super) const ROUTED: &[&str] = &[
    "fenced",
    "unowned",
    "not_owner",
    "owner_unreachable",
    "answer_lost",
    "shutting_down",
    "timeout",
];
