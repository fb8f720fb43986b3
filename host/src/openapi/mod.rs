//! The OpenAPI 3.1 document of the node's HTTP API, served at
//! `GET /v1/openapi.json` (`probes.rs`).
//!
//! This module owns the document: every route [`crate::http::router_with`]
//! serves, with its parameters, bodies, success answers, and every error it
//! can answer — each error status with the exact `code`s it carries, so a
//! client (or Schemathesis, `tests/all/schemathesis.rs`) can check an answer
//! against it. The response bodies' schemas are derived from the types the
//! handlers serialize (`#[derive(utoipa::ToSchema)]` beside each type), so
//! a field added to [`Status`](crate::Status) is in the document at once;
//! the operations themselves are declared in one table (`operations.rs`),
//! the error catalogue in another (`errors.rs`). [`ModuleOptions`]' schema is built from its own
//! serialized defaults and the option table
//! ([`crate::config::option_table::OPTIONS`]), so a new option appears too.
//!
//! It must not change what the API does: it only describes it. Two tests
//! hold it to the router: `tests/all/tidy.rs` fails naming a route the
//! router serves and the document lacks (or the reverse), and the unit
//! tests (`tests.rs`) check that every [`Error`](crate::Error) variant's
//! code and status is in the error catalogue ([`ERRORS`]) and that every
//! `$ref` resolves.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::{Map, Value, json};
use utoipa::ToSchema;

use crate::config::ModuleOptions;
pub use errors::ERRORS;
use errors::{COMMON, PUBLIC};
use operations::{Access, Op, operations_table};

mod errors;
mod operations;
#[cfg(test)]
mod tests;

/// The document, built once.
pub fn document() -> &'static Value {
    static DOCUMENT: OnceLock<Value> = OnceLock::new();
    DOCUMENT.get_or_init(build)
}

/// The document as JSON text, built once (what `GET /v1/openapi.json`
/// serves).
pub fn document_json() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| document().to_string())
}

/// Every operation of the document as `(METHOD, path)`, sorted.
pub fn operations() -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Some(paths) = document()["paths"].as_object() {
        for (path, item) in paths {
            for method in item.as_object().into_iter().flat_map(|m| m.keys()) {
                out.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    out.sort();
    out
}

impl utoipa::PartialSchema for ModuleOptions {
    /// Built from the options' serialized defaults (the type of each field
    /// as it is written) and the option table's descriptions.
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let defaults = serde_json::to_value(ModuleOptions::default()).unwrap_or_default();
        let mut properties = Map::new();
        for (name, default) in defaults.as_object().into_iter().flatten() {
            let meaning = crate::config::option_table::OPTIONS
                .iter()
                .find(|o| o.name == name)
                .map_or("", |o| o.meaning);
            let schema = match (name.as_str(), default) {
                ("on_fence", _) => {
                    json!({"type": "string", "enum": ["terminate", "continue", "callback"]})
                }
                (_, Value::Number(_)) => json!({"type": "integer", "minimum": 0}),
                (_, Value::Null) => json!({"type": ["string", "null"]}),
                _ => json!({"type": "string"}),
            };
            let mut schema = schema;
            schema["description"] = json!(meaning);
            properties.insert(name.clone(), schema);
        }
        let required: Vec<&String> = properties.keys().collect();
        from_json(json!({
            "type": "object",
            "description": "How a module's keys run: fence mode and resource limits (`docs/deploy.md`). Sizes are written like `64.0 MiB`, durations like `100ms`.",
            "required": required,
            "additionalProperties": false,
            "properties": properties,
        }))
    }
}

impl ToSchema for ModuleOptions {}

fn from_json(value: Value) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    serde_json::from_value(value).unwrap_or_else(|e| {
        utoipa::openapi::RefOr::T(utoipa::openapi::schema::Schema::Object(
            utoipa::openapi::schema::Object::builder()
                .description(Some(format!("(schema did not build: {e})")))
                .build(),
        ))
    })
}

/// The error body of `status` carrying one of `codes`.
fn error_schema(codes: &[&str]) -> Value {
    json!({"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["code", "message"], "properties": {
            "code": {"type": "string", "enum": codes},
            "message": {"type": "string"}}}}})
}

/// The statuses and codes of `names`, by status.
fn errors_by_status(names: &[&str]) -> BTreeMap<u16, Vec<(&'static str, &'static str)>> {
    let mut by_status: BTreeMap<u16, Vec<(&str, &str)>> = BTreeMap::new();
    for name in names {
        let Some(&(_, code, status, when)) = ERRORS.iter().find(|e| e.0 == *name) else {
            continue;
        };
        let list = by_status.entry(status).or_default();
        if !list.iter().any(|(c, _)| *c == code) {
            list.push((code, when));
        }
    }
    by_status
}

fn operation_json(op: &Op) -> Value {
    let mut names: Vec<&str> = match op.access {
        Access::Public => PUBLIC.to_vec(),
        Access::Caller => COMMON.to_vec(),
        Access::Admin => [COMMON, &["forbidden"]].concat(),
    };
    names.extend(&op.errors);
    let mut responses = Map::new();
    for (status, answer) in &op.answers {
        responses.insert(status.to_string(), answer.clone());
    }
    for (status, codes) in errors_by_status(&names) {
        let listed: Vec<&str> = codes.iter().map(|(c, _)| *c).collect();
        let description = codes
            .iter()
            .map(|(code, when)| format!("`{code}`: {when}"))
            .collect::<Vec<_>>()
            .join("; ");
        let schema = error_schema(&listed);
        let key = status.to_string();
        match responses.get_mut(&key) {
            // A status that is also an answer (the readiness's 503): either
            // body.
            Some(answer) => {
                let media = &mut answer["content"]["application/json"]["schema"];
                *media = json!({"oneOf": [media.clone(), schema]});
                answer["description"] = json!(format!(
                    "{} Or an error: {description}.",
                    answer["description"].as_str().unwrap_or("")
                ));
            }
            None => {
                responses.insert(
                    key,
                    json!({"description": format!("{description}."),
                           "content": {"application/json": {"schema": schema}}}),
                );
            }
        }
    }
    let mut operation = json!({
        "operationId": op.id,
        "tags": [op.tag],
        "summary": op.summary,
        "responses": responses,
    });
    if !op.parameters.is_empty() {
        operation["parameters"] = Value::Array(op.parameters.clone());
    }
    if let Some(body) = &op.body {
        operation["requestBody"] = body.clone();
    }
    operation["security"] = match op.access {
        Access::Public => json!([{}]),
        // An open node needs no token; a node with tokens needs one.
        Access::Caller | Access::Admin => json!([{"bearer": []}, {}]),
    };
    operation
}

fn schemas() -> Map<String, Value> {
    fn add<T: ToSchema>(schemas: &mut Map<String, Value>) {
        let schema = serde_json::to_value(T::schema()).unwrap_or_default();
        schemas.insert(T::name().into_owned(), schema);
    }
    let mut s = Map::new();
    add::<crate::Status>(&mut s);
    add::<crate::LeaseState>(&mut s);
    add::<crate::ModuleInfo>(&mut s);
    add::<crate::NodeStatus>(&mut s);
    add::<crate::TenantHostBytes>(&mut s);
    add::<crate::TenantCpuReport>(&mut s);
    add::<crate::CacheStats>(&mut s);
    add::<ModuleOptions>(&mut s);
    add::<crate::ModuleListing>(&mut s);
    add::<crate::arbiter::ModuleVersionRecord>(&mut s);
    add::<crate::LiveKey>(&mut s);
    add::<crate::LimboEntry>(&mut s);
    add::<crate::storage::StoredEntry>(&mut s);
    add::<crate::storage::StoredValue>(&mut s);
    add::<crate::StoredAlarmView>(&mut s);
    add::<crate::ClusterView>(&mut s);
    add::<crate::ModuleView>(&mut s);
    add::<crate::NodeHistory>(&mut s);
    add::<crate::Sample>(&mut s);
    add::<crate::LostState>(&mut s);
    add::<crate::Readiness>(&mut s);
    add::<crate::ReadyState>(&mut s);
    add::<crate::probes::Health>(&mut s);
    add::<crate::probes::HealthStatus>(&mut s);
    add::<crate::http::Queued>(&mut s);
    add::<crate::http::Killed>(&mut s);
    add::<crate::http::StateEntries>(&mut s);
    add::<crate::http::AlarmList>(&mut s);
    add::<crate::http::CacheVersion>(&mut s);
    add::<crate::http::Deleted>(&mut s);
    add::<crate::http_modules::Undeployed>(&mut s);
    add::<crate::http::LeaveAnswer>(&mut s);
    let every: Vec<&str> = ERRORS.iter().map(|e| e.1).collect();
    let mut every: Vec<&str> = every.clone();
    every.sort_unstable();
    every.dedup();
    s.insert("Error".to_owned(), error_schema(&every));
    s
}

fn build() -> Value {
    let mut paths = Map::new();
    for op in operations_table() {
        let item = paths.entry(op.path.to_owned()).or_insert_with(|| json!({}));
        item[op.method] = operation_json(&op);
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "Fief node API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "The HTTP API of a Fief node: deploy WebAssembly key modules, call and cast their keys, \
                the coherent cache, status and probes. Every error is `{\"error\": {\"code\", \"message\"}}`; each \
                operation lists the codes each status carries. With tokens configured, every operation but the \
                probes and this document needs `Authorization: Bearer TOKEN`.",
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"}
        },
        "tags": [
            {"name": "probes", "description": "Health, readiness and this document; no token needed."},
            {"name": "modules", "description": "Deploy, list, roll back and undeploy modules."},
            {"name": "keys", "description": "Call, cast, connect to and inspect keys."},
            {"name": "node", "description": "The node: status, leave, limbo, metrics."},
            {"name": "dashboard", "description": "The live dashboard and the cluster view (a tenant sees only its own modules)."},
            {"name": "cache", "description": "The coherent cache."}
        ],
        "paths": paths,
        "components": {
            "schemas": schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                "description": "An API token from the node's tokens file (admin or tenant)."}}
        }
    })
}
