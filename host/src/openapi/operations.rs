//! The operations of the OpenAPI document ([`super`]), one entry per route
//! and method the router serves: parameters, bodies, success answers with
//! their links, and the names of the errors each can answer ([`super::errors`]).
//! Schemas are referenced by the types the handlers serialize. It must not
//! list a route the router does not serve (`tests/all/tidy.rs` checks both
//! ways).

use serde_json::{Value, json};
use utoipa::ToSchema;

use super::errors::ROUTED;

/// What refuses a message to a key (a call or a cast) before the key sees
/// it.
const MESSAGE_REFUSALS: &[&str] = &[
    "invalid_module_name",
    "unknown_module",
    "invalid_key",
    "message_too_large",
    "overloaded",
    "host_memory",
    "too_many_keys",
];

/// Who may call an operation.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
    /// Anyone, no token (the probes and the document).
    Public,
    /// Any valid token (or none on an open node); a tenant sees its own.
    Caller,
    /// An admin token (or none on an open node); a tenant gets `403`.
    Admin,
}

/// One operation of the document.
pub(super) struct Op {
    pub(super) method: &'static str,
    pub(super) path: &'static str,
    pub(super) id: &'static str,
    pub(super) tag: &'static str,
    pub(super) summary: &'static str,
    pub(super) access: Access,
    pub(super) parameters: Vec<Value>,
    pub(super) body: Option<Value>,
    /// Answers other than the errors: status → response object.
    pub(super) answers: Vec<(u16, Value)>,
    /// Error names ([`ERRORS`]) beyond the common ones.
    pub(super) errors: Vec<&'static str>,
}

fn module_param() -> Value {
    path_param(
        "module",
        "The module. A tenant names its own modules plainly (`counter`); the admin names a tenant's module in full, `acme%2Fcounter`.",
        json!({"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9_][A-Za-z0-9_.-]*$", "examples": ["counter"]}),
    )
}

fn key_param(what: &str) -> Value {
    path_param(
        "key",
        &format!("The {what}: any text of 1 to 1024 bytes (UTF-8), percent-encoded."),
        json!({"type": "string", "minLength": 1, "maxLength": 1024, "examples": ["alice"]}),
    )
}

fn path_param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "path", "required": true, "description": description, "schema": schema})
}

fn query_param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "query", "required": false, "description": description, "schema": schema})
}

fn header_param(name: &str, description: &str, schema: Value) -> Value {
    json!({"name": name, "in": "header", "required": false, "description": description, "schema": schema})
}

/// A JSON answer whose body is the schema `T`.
fn json_answer<T: ToSchema>(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema_ref::<T>()}}})
}

fn json_array_answer<T: ToSchema>(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {
        "schema": {"type": "array", "items": schema_ref::<T>()}}}})
}

fn schema_ref<T: ToSchema>() -> Value {
    json!({"$ref": format!("#/components/schemas/{}", T::name())})
}

fn raw_answer(description: &str, media_type: &str) -> Value {
    json!({"description": description, "content": {media_type: {"schema": {"type": "string"}}}})
}

fn raw_body(description: &str) -> Value {
    json!({"description": description, "required": false, "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}})
}

/// Links from an answer of an operation on `{module}/{key}` to the others
/// on the same key (Schemathesis follows them in its stateful phase).
fn key_links() -> Value {
    let same = json!({"module": "$request.path.module", "key": "$request.path.key"});
    json!({
        "call": {"operationId": "callKey", "parameters": same},
        "cast": {"operationId": "castKey", "parameters": same},
        "kill": {"operationId": "killKey", "parameters": same},
        "state": {"operationId": "readState", "parameters": same},
        "alarms": {"operationId": "readAlarms", "parameters": same},
    })
}

fn cache_links() -> Value {
    let same = json!({"namespace": "$request.path.namespace", "key": "$request.path.key"});
    json!({
        "read": {"operationId": "cacheGet", "parameters": same},
        "delete": {"operationId": "cacheDelete", "parameters": same},
        "write": {"operationId": "cachePut", "parameters": same},
    })
}

fn with_links(mut answer: Value, links: Value) -> Value {
    answer["links"] = links;
    answer
}

/// Every operation the router serves.
pub(super) fn operations_table() -> Vec<Op> {
    use crate::http::{AlarmList, CacheVersion, Deleted, Killed, Queued, StateEntries};
    let op = |method, path, id, tag, summary, access| Op {
        method,
        path,
        id,
        tag,
        summary,
        access,
        parameters: Vec::new(),
        body: None,
        answers: Vec::new(),
        errors: Vec::new(),
    };
    let key_params = || vec![module_param(), key_param("key")];
    let module_name_param = || {
        let mut p = module_param();
        p["name"] = json!("name");
        p
    };
    let cache_params = || {
        vec![
            path_param(
                "namespace",
                "The cache namespace: 1 to 128 ASCII letters, digits, '-', '_' and '.'. A tenant's are its own.",
                json!({"type": "string", "minLength": 1, "maxLength": 128, "pattern": "^[A-Za-z0-9_.-]+$"}),
            ),
            key_param("cache key"),
        ]
    };
    let if_match = || {
        header_param(
            "If-Match",
            "Write or delete only if the entry's version is this one (the `ETag` a read or write returned, e.g. `\"42\"`).",
            json!({"type": "string", "pattern": "^(W/)?\"?[0-9]{1,19}\"?$"}),
        )
    };
    let mut ops = Vec::new();

    // ---- probes and the document ----
    let mut o = op(
        "get",
        "/v1/health",
        "health",
        "probes",
        "Liveness: the process is up",
        Access::Public,
    );
    o.answers.push((
        200,
        json_answer::<crate::probes::Health>("The process answers."),
    ));
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/ready",
        "ready",
        "probes",
        "Readiness: whether this node serves",
        Access::Public,
    );
    o.answers.push((
        200,
        json_answer::<crate::Readiness>("The lease is current and the node serves."),
    ));
    o.answers.push((503, json_answer::<crate::Readiness>("The node does not serve: it is joining, fenced, leaving or stopping (`state` says which).")));
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/openapi.json",
        "openapi",
        "probes",
        "This document",
        Access::Public,
    );
    o.answers.push((
        200,
        json!({"description": "The OpenAPI 3.1 document of the API.",
        "content": {"application/json": {"schema": {"type": "object"}}}}),
    ));
    ops.push(o);

    // ---- modules ----
    let mut o = op(
        "get",
        "/v1/modules",
        "listModules",
        "modules",
        "Every module: versions, the current one, where each is loaded",
        Access::Caller,
    );
    o.answers.push((200, with_links(
        json_array_answer::<crate::ModuleListing>("The modules (a tenant's own, as it names them)."),
        json!({"module": {"operationId": "getModule", "parameters": {"name": "$response.body#/0/name"}}}),
    )));
    o.errors = vec!["module_store_unavailable"];
    ops.push(o);
    let mut o = op(
        "put",
        "/v1/modules/{name}",
        "deployModule",
        "modules",
        "Deploy a component to the cluster",
        Access::Caller,
    );
    o.parameters.push(module_name_param());
    for option in crate::config::option_table::OPTIONS {
        o.parameters.push(query_param(
            option.name,
            option.meaning,
            json!({"type": "string"}),
        ));
    }
    o.body = Some(
        json!({"description": "The component (`.wasm`), at most 64 MiB.", "required": true,
        "content": {"application/wasm": {"schema": {"type": "string", "format": "binary"}},
                    "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}),
    );
    o.answers.push((
        200,
        json_answer::<crate::ModuleInfo>("Stored and loaded here; the other nodes follow."),
    ));
    o.errors = vec![
        "invalid_module_name",
        "invalid_options",
        "invalid_module",
        "unknown_module",
        "compile_busy",
        "module_store_unavailable",
        "shutting_down",
    ];
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/modules/{name}",
        "getModule",
        "modules",
        "One module",
        Access::Caller,
    );
    o.parameters.push(module_name_param());
    o.answers.push((200, with_links(
        json_answer::<crate::ModuleListing>("The module."),
        json!({"rollback": {"operationId": "rollbackModule", "parameters": {"name": "$request.path.name", "version": "$response.body#/current"}}}),
    )));
    o.errors = vec![
        "invalid_module_name",
        "unknown_module",
        "module_store_unavailable",
    ];
    ops.push(o);
    let mut o = op(
        "delete",
        "/v1/modules/{name}",
        "undeployModule",
        "modules",
        "Undeploy: stop its keys on every node and remove it",
        Access::Caller,
    );
    o.parameters.push(module_name_param());
    o.answers.push((
        200,
        json_answer::<crate::http_modules::Undeployed>("Undeployed."),
    ));
    o.errors = vec![
        "invalid_module_name",
        "unknown_module",
        "module_store_unavailable",
        "shutting_down",
    ];
    ops.push(o);
    let mut o = op(
        "post",
        "/v1/modules/{name}/rollback",
        "rollbackModule",
        "modules",
        "Make a stored version current again",
        Access::Caller,
    );
    o.parameters.push(module_name_param());
    let mut version = query_param(
        "version",
        "The stored version to make current.",
        json!({"type": "integer", "minimum": 0, "maximum": u64::MAX}),
    );
    version["required"] = json!(true);
    o.parameters.push(version);
    o.answers.push((
        200,
        json_answer::<crate::ModuleInfo>("That version is current; this node loaded it."),
    ));
    o.errors = vec![
        "invalid_module_name",
        "invalid_options",
        "unknown_module",
        "unknown_module_version",
        "invalid_module",
        "module_store_unavailable",
        "shutting_down",
    ];
    ops.push(o);

    // ---- keys ----
    let mut o = op(
        "post",
        "/v1/keys/{module}/{key}/call",
        "callKey",
        "keys",
        "Call a key: raw message in, raw reply out",
        Access::Caller,
    );
    o.parameters = key_params();
    let mut body = raw_body(
        "The message, at most the node's `max_message_size`; what it means is the module's (the example `counter` takes `incr` and `get`, and answers anything else with `422 rejected`).",
    );
    body["content"]["application/octet-stream"]["example"] = json!("incr");
    o.body = Some(body);
    o.answers.push((
        200,
        with_links(
            raw_answer("The key's reply.", "application/octet-stream"),
            key_links(),
        ),
    ));
    o.errors = [
        MESSAGE_REFUSALS,
        &[
            "init_refused",
            "rejected",
            "key_died",
            "reply_too_large",
            "storage_unavailable",
        ][..],
        ROUTED,
    ]
    .concat();
    ops.push(o);
    let mut o = op(
        "post",
        "/v1/keys/{module}/{key}/cast",
        "castKey",
        "keys",
        "Cast to a key: the message is queued, no reply",
        Access::Caller,
    );
    o.parameters = key_params();
    o.body = Some(raw_body(
        "The message, at most the node's `max_message_size`.",
    ));
    o.answers.push((
        202,
        with_links(
            json_answer::<Queued>("Queued (it may still be lost)."),
            key_links(),
        ),
    ));
    o.errors = [MESSAGE_REFUSALS, ROUTED].concat();
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/keys/{module}/{key}/connect",
        "connectKey",
        "keys",
        "Open a WebSocket connection to a key (an upgrade; `docs/realtime.md`)",
        Access::Caller,
    );
    o.parameters = key_params();
    o.answers.push((101, json!({"description": "Switching protocols: the connection is a WebSocket attached to the key."})));
    o.errors = [
        &[
            "invalid_module_name",
            "unknown_module",
            "invalid_key",
            "upgrade_required",
            "not_connectable",
            "too_many_sockets",
            "overloaded",
            "host_memory",
            "too_many_keys",
            "init_refused",
            "storage_unavailable",
        ][..],
        ROUTED,
    ]
    .concat();
    ops.push(o);
    let mut o = op(
        "delete",
        "/v1/keys/{module}/{key}",
        "killKey",
        "keys",
        "Kill a key's process on this node",
        Access::Caller,
    );
    o.parameters = key_params();
    o.answers.push((
        200,
        json_answer::<Killed>("Killed if it was live; the next message starts a fresh process."),
    ));
    o.errors = vec!["invalid_module_name", "unknown_module", "invalid_key"];
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/keys",
        "listKeys",
        "keys",
        "The live keys on this node",
        Access::Caller,
    );
    o.answers.push((200, with_links(
        json_array_answer::<crate::LiveKey>("The live keys (a tenant's own)."),
        json!({"kill": {"operationId": "killKey", "parameters": {"module": "$response.body#/0/module", "key": "$response.body#/0/key"}}}),
    )));
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/state/{module}/{key}",
        "readState",
        "keys",
        "A key's committed durable state (read-only)",
        Access::Caller,
    );
    o.parameters = key_params();
    o.parameters.push(query_param(
        "prefix",
        "Only names starting with this (at most 2048 bytes).",
        json!({"type": "string", "maxLength": 2048}),
    ));
    o.parameters.push(query_param(
        "limit",
        "At most this many entries (default 100).",
        json!({"type": "integer", "minimum": 1, "maximum": crate::storage::MAX_STATE_READ}),
    ));
    o.answers
        .push((200, json_answer::<StateEntries>("The committed entries.")));
    o.errors = vec![
        "invalid_module_name",
        "unknown_module",
        "invalid_key",
        "storage_unavailable",
    ];
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/alarms/{module}/{key}",
        "readAlarms",
        "keys",
        "A key's committed durable alarms (read-only)",
        Access::Caller,
    );
    o.parameters = key_params();
    o.answers
        .push((200, json_answer::<AlarmList>("The committed alarms.")));
    o.errors = vec![
        "invalid_module_name",
        "unknown_module",
        "invalid_key",
        "storage_unavailable",
    ];
    ops.push(o);

    // ---- the node and the cluster ----
    let mut o = op(
        "get",
        "/v1/status",
        "status",
        "node",
        "This node's status",
        Access::Caller,
    );
    o.answers.push((
        200,
        json_answer::<crate::Status>("The status (a tenant sees only its own modules)."),
    ));
    ops.push(o);
    let mut o = op(
        "post",
        "/v1/leave",
        "leave",
        "node",
        "Leave the cluster gracefully, then stop",
        Access::Admin,
    );
    o.answers.push((200, json!({"description": "Left; the process stops.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/LeaveAnswer"}}}})));
    o.errors = vec![
        "already_leaving",
        "fenced",
        "arbiter_unavailable",
        "shutting_down",
        "timeout",
    ];
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/limbo",
        "limbo",
        "node",
        "The survivors in limbo on this node",
        Access::Caller,
    );
    o.answers.push((
        200,
        json_array_answer::<crate::LimboEntry>("The survivors (a tenant's own)."),
    ));
    ops.push(o);
    let mut o = op(
        "get",
        "/metrics",
        "metrics",
        "node",
        "Prometheus metrics",
        Access::Admin,
    );
    o.answers.push((
        200,
        raw_answer("OpenMetrics text.", crate::metrics::CONTENT_TYPE),
    ));
    ops.push(o);
    let mut o = op(
        "get",
        "/",
        "dashboard",
        "dashboard",
        "The live dashboard page",
        Access::Public,
    );
    o.answers
        .push((200, raw_answer("The page.", "text/html; charset=utf-8")));
    ops.push(o);
    let mut o = op(
        "get",
        "/dashboard.js",
        "dashboardScript",
        "dashboard",
        "The dashboard's script",
        Access::Public,
    );
    o.answers.push((
        200,
        raw_answer("The script.", "text/javascript; charset=utf-8"),
    ));
    ops.push(o);
    let mut o = op(
        "get",
        "/dashboard.css",
        "dashboardStyle",
        "dashboard",
        "The dashboard's style sheet",
        Access::Public,
    );
    o.answers.push((
        200,
        raw_answer("The style sheet.", "text/css; charset=utf-8"),
    ));
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/cluster",
        "cluster",
        "dashboard",
        "The cluster as this node sees it (a tenant: only its own modules, no history)",
        Access::Caller,
    );
    o.answers
        .push((200, json_answer::<crate::ClusterView>("One snapshot.")));
    ops.push(o);
    let mut o = op(
        "get",
        "/v1/cluster/events",
        "clusterEvents",
        "dashboard",
        "The cluster view as server-sent `snapshot` events, one every 500 ms (an endless stream)",
        Access::Caller,
    );
    // Before OpenAPI 3.2's `itemSchema`, a stream's `schema` describes one
    // event (what Schemathesis checks each event against).
    o.answers.push((
        200,
        json!({"description": "A stream of `snapshot` events, each a ClusterView as JSON.",
        "content": {"text/event-stream": {"schema": {
            "type": "object", "required": ["event", "data"], "properties": {
                "event": {"type": "string", "enum": ["snapshot"]},
                "data": {"type": "string", "contentMediaType": "application/json",
                         "contentSchema": schema_ref::<crate::ClusterView>()}}}}}}),
    ));
    ops.push(o);

    // ---- the cache ----
    let mut o = op(
        "get",
        "/v1/cache/{namespace}/{key}",
        "cacheGet",
        "cache",
        "Read a cache entry",
        Access::Caller,
    );
    o.parameters = cache_params();
    o.answers.push((200, json!({"description": "The raw value.",
        "headers": {
            "ETag": {"description": "The entry's version, quoted.", "required": true, "schema": {"type": "string"}},
            "x-fief-expires-in-ms": {"description": "Milliseconds left of its time-to-live, if it has one.", "schema": {"type": "string", "pattern": "^[0-9]+$"}}},
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        "links": {"write_if_match": {"operationId": "cachePut", "parameters": {
            "namespace": "$request.path.namespace", "key": "$request.path.key", "If-Match": "$response.header.ETag"}}}})));
    o.errors = [&["invalid_key", "not_found"][..], ROUTED].concat();
    ops.push(o);
    let mut o = op(
        "put",
        "/v1/cache/{namespace}/{key}",
        "cachePut",
        "cache",
        "Write a cache entry (compare-and-set with If-Match / If-None-Match)",
        Access::Caller,
    );
    o.parameters = cache_params();
    o.parameters.push(query_param(
        "ttl",
        "Time-to-live, e.g. `10s`, `500ms`, `1h 30m` (humantime: other unit spellings such as `1hour` are taken too).",
        json!({"type": "string", "pattern": "^(0|[0-9]{1,6}(ns|us|ms|s|m|h|d)( ?[0-9]{1,6}(ns|us|ms|s|m|h|d))*)$"}),
    ));
    o.parameters.push(if_match());
    o.parameters.push(header_param(
        "If-None-Match",
        "`*`: write only if there is no entry.",
        json!({"type": "string", "enum": ["*"]}),
    ));
    o.body = Some(raw_body(
        "The value, at most the node's `max_message_size`.",
    ));
    o.answers.push((200, with_links(json!({"description": "Written.",
        "headers": {"ETag": {"description": "The new version, quoted.", "required": true, "schema": {"type": "string"}}},
        "content": {"application/json": {"schema": schema_ref::<CacheVersion>()}}}), cache_links())));
    o.errors = [
        &[
            "invalid_key",
            "message_too_large",
            "version_conflict",
            "cache_entry_too_large",
            "cache_full",
        ][..],
        ROUTED,
    ]
    .concat();
    ops.push(o);
    let mut o = op(
        "delete",
        "/v1/cache/{namespace}/{key}",
        "cacheDelete",
        "cache",
        "Delete a cache entry (If-Match honoured)",
        Access::Caller,
    );
    o.parameters = cache_params();
    o.parameters.push(if_match());
    o.answers.push((
        200,
        json_answer::<Deleted>("Deleted if there was an entry."),
    ));
    o.errors = [&["invalid_key", "version_conflict"][..], ROUTED].concat();
    ops.push(o);
    ops
}
