//! The HTTP API of a node (axum): deploy modules, call and cast keys, the
//! coherent cache, status.
//!
//! | method and path | what |
//! |---|---|
//! | `PUT /v1/modules/{name}?option=value…` | deploy a component (raw body, streamed) to the cluster |
//! | `GET`, `DELETE /v1/modules/{name}`, `GET /v1/modules`, `POST /v1/modules/{name}/rollback` | list, undeploy, roll back ([`crate::http_modules`]) |
//! | `POST /v1/keys/{module}/{key}/call` | raw message in, raw reply out |
//! | `POST /v1/keys/{module}/{key}/cast` | raw message in, `202` |
//! | `DELETE /v1/keys/{module}/{key}` | kill a key's process |
//! | `GET /v1/keys` | live keys |
//! | `GET /v1/state/{module}/{key}?prefix=P&limit=N` | a key's committed durable state, read-only: `{"entries": [{"name", "value": {"utf8"|"hex": …}}]}` ([`StoredEntry`](crate::storage::StoredEntry)) |
//! | `GET /v1/alarms/{module}/{key}` | a key's committed durable alarms, read-only: `{"alarms": [{"name", "at_ms", "due_in_ms"}]}` ([`StoredAlarmView`](crate::StoredAlarmView)) |
//! | `GET /v1/status` | the node's [`Status`](crate::Status) |
//! | `POST /v1/leave` | leave the cluster gracefully, then stop |
//! | `GET /v1/limbo` | the survivors in limbo ([`LimboEntry`](crate::LimboEntry)) |
//! | `GET /v1/cache/{namespace}/{key}` | a cache entry: raw value, `ETag` = version; `404` if none |
//! | `PUT /v1/cache/{namespace}/{key}?ttl=10s` | write (raw body); `If-Match` / `If-None-Match: *` for compare-and-set (`412` on conflict) |
//! | `DELETE /v1/cache/{namespace}/{key}` | delete (`If-Match` honoured) |
//! | `GET /metrics` | Prometheus metrics (OpenMetrics text, see [`crate::metrics`]); admin |
//! | `GET /` | the live dashboard page (see [`crate::dashboard`]); no token needed (it asks for one) |
//! | `GET /v1/cluster` | the cluster as this node sees it ([`ClusterView`](crate::dashboard::ClusterView)); a tenant sees only its own modules |
//! | `GET /v1/cluster/events` | the same, as server-sent `snapshot` events every 500 ms; filtered the same way |
//! | `GET /v1/health`, `GET /v1/ready` | liveness and readiness probes (`probes.rs`); no token needed |
//! | `GET /v1/openapi.json` | the OpenAPI 3.1 document of all of the above ([`crate::openapi`]); no token needed |
//!
//! With tokens configured ([`crate::auth`]), every request but the probes,
//! the document and the dashboard's page and assets needs
//! `Authorization: Bearer TOKEN` (`401 unauthorized` otherwise); a tenant's
//! module, key and cache names are scoped to the tenant, another tenant's
//! module answers `404`, and `leave` needs an admin token (`403`). The
//! caller's [`Identity`] is in each request's extensions.
//!
//! Every error is JSON `{"error":{"code":"…","message":"…"}}` with the status
//! of [`Error::http_status`], the answers to heads over the limits (`414`,
//! `431`) and to a connection over the cap (`503`) included. Bodies are read with a limit (the node's
//! `max_message_size` for messages, [`MAX_MODULE_BYTES`](crate::module::MAX_MODULE_BYTES) for modules), so a
//! client cannot make the node buffer more than that. Connections are held to
//! [`crate::http_limits`] (a cap, timeouts, head sizes) by
//! `crate::listener`.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde_json::json;

use crate::auth::{Auth, Identity};
use crate::cache::{Expect, PutOptions};
use crate::config::ModuleOptions;
use crate::error::Error;
use crate::node::Instance;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = json!({"error": {"code": self.code(), "message": self.to_string()}});
        (status, axum::Json(body)).into_response()
    }
}

/// The API's routes over `instance`, open to every caller (no tokens).
pub fn router(instance: Arc<Instance>) -> Router {
    router_with(instance, Arc::new(Auth::open()))
}

/// How the API is served: who may call it, and over TLS or not.
#[derive(Clone, Debug, Default)]
pub struct ApiOptions {
    /// The accepted tokens ([`Auth::open`]: none needed).
    pub auth: Arc<Auth>,
    /// Serve HTTPS with this configuration ([`crate::tls::server_config`]);
    /// `None`: plain HTTP.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// The API's routes over `instance`, each request authenticated by `auth`.
pub fn router_with(instance: Arc<Instance>, auth: Arc<Auth>) -> Router {
    Router::new()
        .route("/v1/modules", get(crate::http_modules::list))
        .route(
            "/v1/modules/{name}",
            put(deploy)
                .get(crate::http_modules::get_one)
                .delete(crate::http_modules::undeploy),
        )
        .route(
            "/v1/modules/{name}/rollback",
            post(crate::http_modules::rollback),
        )
        .route("/v1/keys/{module}/{key}/call", post(call))
        .route("/v1/keys/{module}/{key}/cast", post(cast))
        .route("/v1/keys/{module}/{key}/connect", get(connect))
        .route("/v1/keys/{module}/{key}", axum::routing::delete(kill))
        .route("/v1/keys", get(keys))
        .route("/v1/state/{module}/{key}", get(state))
        .route("/v1/alarms/{module}/{key}", get(alarms))
        .route("/v1/status", get(status))
        .route("/v1/leave", post(leave))
        .route("/v1/limbo", get(limbo))
        .route("/metrics", get(metrics))
        .merge(crate::dashboard::routes())
        .route(
            "/v1/cache/{namespace}/{key}",
            get(cache_get).put(cache_put).delete(cache_delete),
        )
        .method_not_allowed_fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                Error::MethodNotAllowed(format!("{method} is not allowed on {}", uri.path()))
            },
        )
        .fallback(
            |uri: axum::http::Uri| async move { Error::NoSuchEndpoint(uri.path().to_owned()) },
        )
        // One layer, not one per concern: axum wraps every route once more
        // for each `layer`, a clone and a boxed future per request each.
        .layer(axum::middleware::from_fn_with_state(auth, edge))
        // Added after the authentication layer, so outside it: probes
        // carry no token.
        .merge(crate::probes::routes())
        // The dashboard's page and assets hold no data: no token either.
        .merge(crate::dashboard::page_routes())
        .with_state(instance)
}

/// What every API request but the probes and the dashboard's page passes
/// through, in one middleware: trace context, then authentication.
///
/// Trace context (`crate::trace`, issue 22 item 4): the request is served
/// in the caller's `traceparent` trace, or a new one if it sent none or one
/// that does not parse (never refused for it), in a span of this node's own
/// that the response's `traceparent` names. A request that authentication
/// refuses (`crate::auth::authenticate`) is traced too.
async fn edge(
    auth: State<Arc<Auth>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let caller = request
        .headers()
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::trace::TraceContext::parse);
    let trace = caller.map_or_else(crate::trace::TraceContext::new_root, |t| t.child());
    let served = crate::auth::authenticate(auth, request, next);
    let mut response = crate::trace::scope(Some(trace), served).await;
    if let Ok(value) = axum::http::HeaderValue::from_bytes(&trace.traceparent()) {
        response.headers_mut().insert(TRACEPARENT, value);
    }
    response
}

/// The W3C trace context header.
const TRACEPARENT: &str = "traceparent";

/// Serve the API on `listener` until `shutdown` resolves.
///
/// # Errors
///
/// An I/O error from the listener.
pub async fn serve(
    instance: Arc<Instance>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(instance, listener, ApiOptions::default(), shutdown).await
}

/// Serve the API on `listener` with `options` (tokens, TLS) until
/// `shutdown` resolves, within the connection limits of the node's
/// configuration ([`crate::http_limits`]): a cap on open connections, the
/// header-read and idle timeouts, and limits on a request's head.
///
/// # Errors
///
/// [`std::io::ErrorKind::InvalidInput`] if the connection cap does not fit
/// the open-file limit (the message names both); an I/O error from the
/// listener.
pub async fn serve_with(
    instance: Arc<Instance>,
    listener: tokio::net::TcpListener,
    options: ApiOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = crate::http_limits::HttpLimits::for_node(instance.config())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
    let app = router_with(instance.clone(), options.auth);
    crate::listener::serve(listener, app, options.tls, limits, instance, shutdown).await
}

/// Read a body of at most `limit` bytes.
async fn read_body(body: Body, limit: usize) -> Result<Bytes, Error> {
    axum::body::to_bytes(body, limit.saturating_add(1))
        .await
        .map_err(|_| Error::MessageTooLarge {
            size: limit.saturating_add(1),
            limit,
        })
        .and_then(|bytes| {
            if bytes.len() > limit {
                Err(Error::MessageTooLarge {
                    size: bytes.len(),
                    limit,
                })
            } else {
                Ok(bytes)
            }
        })
}

/// A key route's module (scoped to the caller's tenant) and key, both
/// checked: every key route refuses a malformed key with `400` before
/// anything else (a kill or a state read of a key no call could reach
/// answered `200`, found by Schemathesis).
fn key_path(
    who: &Identity,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, String), Error> {
    let (module, key) = path_pair(path, "module and key")?;
    let module = who.module(&module)?;
    crate::config::validate_key(&key)?;
    Ok((module, key))
}

fn cache_path(
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, String), Error> {
    path_pair(path, "cache namespace and key")
}

/// The two path segments of a route, or an error naming `what` they are.
fn path_pair(
    path: Result<Path<(String, String)>, PathRejection>,
    what: &str,
) -> Result<(String, String), Error> {
    path.map(|Path(p)| p).map_err(|e| {
        Error::InvalidKey(format!(
            "the {what} in the path must be valid percent-encoded UTF-8: {e}"
        ))
    })
}

async fn deploy(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    Extension(caps): Extension<crate::auth::DeployCaps>,
    name: Result<Path<String>, PathRejection>,
    options: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, Error> {
    let Query(options) = options
        .map_err(|e| Error::InvalidOptions(format!("the query string is malformed: {e}")))?;
    let Path(name) = name.map_err(|e| Error::InvalidModuleName {
        name: String::new(),
        why: format!("the module name in the path must be valid percent-encoded UTF-8: {e}"),
    })?;
    let name = who.module(&name)?;
    let pairs = options.iter().map(|(k, v)| (k.as_str(), v.as_str()));
    // A tenant's deploy is held to the tenant's caps (its defaults lowered
    // to them); the admin's and an open node's only to the node's limits.
    let options = match &caps.0 {
        Some(limits) => limits.options_from_pairs(pairs)?,
        None => ModuleOptions::from_pairs(pairs)?,
    };
    let wasm = crate::http_modules::read_module_body(&headers, body).await?;
    let info = instance
        .deploy_as(&name, wasm, options, &who.label())
        .await?;
    Ok(axum::Json(info))
}

async fn call(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Body,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(&who, path)?;
    // The tenant's turn (`crate::request_turns`): the API's workers shared
    // fairly between tenants' requests.
    let turn = instance.request_turn(&module).await;
    turn.serve(async {
        let limit = instance.config().max_message_size.as_u64() as usize;
        let message = read_body(body, limit).await?;
        let reply = instance.call(&module, &key, message.to_vec()).await?;
        Ok(([(header::CONTENT_TYPE, "application/octet-stream")], reply))
    })
    .await
}

async fn cast(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Body,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(&who, path)?;
    let turn = instance.request_turn(&module).await;
    turn.serve(async {
        let limit = instance.config().max_message_size.as_u64() as usize;
        let message = read_body(body, limit).await?;
        instance.cast(&module, &key, message.to_vec())?;
        Ok((StatusCode::ACCEPTED, axum::Json(Queued { queued: true })))
    })
    .await
}

/// `GET /v1/keys/{module}/{key}/connect`: a WebSocket connection to the
/// key, held by this node (`docs/realtime.md`).
async fn connect(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
    upgrade: Result<
        axum::extract::ws::WebSocketUpgrade,
        axum::extract::ws::rejection::WebSocketUpgradeRejection,
    >,
) -> Result<axum::response::Response, Error> {
    let (module, key) = key_path(&who, path)?;
    let upgrade = upgrade.map_err(|e| Error::UpgradeRequired(e.to_string()))?;
    instance.accept_socket(&module, &key, upgrade)
}

async fn kill(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(&who, path)?;
    let killed = instance.kill_key_and_wait(&module, &key).await;
    Ok(axum::Json(Killed { killed }))
}

/// `GET /v1/state/{module}/{key}?prefix=P&limit=N`: the key's committed
/// entries (read-only; a tenant reads only its own modules).
async fn state(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<StateQuery>, QueryRejection>,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(&who, path)?;
    let Query(query) = query.map_err(|e| Error::InvalidKey(format!("state query: {e}")))?;
    let entries = instance
        .stored_state(
            &module,
            &key,
            query.prefix.as_deref().unwrap_or(""),
            query.limit.unwrap_or(100),
        )
        .await?;
    Ok(axum::Json(StateEntries { entries }))
}

/// `GET /v1/alarms/{module}/{key}`: the key's committed alarms (read-only;
/// a tenant reads only its own modules).
async fn alarms(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(&who, path)?;
    let alarms = instance.stored_alarms(&module, &key).await?;
    Ok(axum::Json(AlarmList { alarms }))
}

/// The query of [`state`].
#[derive(serde::Deserialize)]
struct StateQuery {
    prefix: Option<String>,
    limit: Option<u32>,
}

async fn keys(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> impl IntoResponse {
    let mut keys = instance.keys();
    only_visible(&who, &mut keys, |k| &mut k.module);
    axum::Json(keys)
}

async fn leave(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> Result<impl IntoResponse, Error> {
    who.require_admin("leaving the cluster")?;
    let left = instance.leave(LEAVE_TIMEOUT).await;
    // A leave a fence cut short has still left: the process stops either way.
    if matches!(left, Ok(_) | Err(Error::FencedWhileLeaving)) {
        instance.request_stop();
    }
    let report = left?;
    Ok(axum::Json(LeaveAnswer {
        left: true,
        lost_states: report.lost_states,
        no_other_node: report.no_other_node,
        released: report.released,
    }))
}

/// The answer of `POST /v1/leave`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct LeaveAnswer {
    /// Always `true`: the node left the cluster and is stopping.
    pub left: bool,
    /// Keys whose handoff state could not travel, with why.
    pub lost_states: Vec<crate::LostState>,
    /// There was no other live node to hand to: the keys stopped here.
    pub no_other_node: bool,
    /// The arbiter confirmed the lease's release (else the lease, fenced
    /// here, lapses at its TTL).
    pub released: bool,
}

/// How long `POST /v1/leave` waits for every partition to move.
const LEAVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

async fn limbo(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> impl IntoResponse {
    let mut entries = instance.limbo().await;
    only_visible(&who, &mut entries, |e| &mut e.module);
    axum::Json(entries)
}

/// Keep the items whose module `who` may see, renamed as `who` names them
/// (a tenant's own modules without the tenant).
fn only_visible<T>(who: &Identity, items: &mut Vec<T>, module: impl Fn(&mut T) -> &mut String) {
    items.retain_mut(|item| {
        let module = module(item);
        who.visible_module(module)
            .map(|name| *module = name)
            .is_some()
    });
}

/// The node's metrics; they name every module, so not for a tenant.
async fn metrics(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> Result<impl IntoResponse, Error> {
    who.require_admin("reading the metrics")?;
    Ok((
        [(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)],
        instance.metrics_text().await,
    ))
}

/// The node's status; a tenant sees only its own modules in it.
async fn status(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> impl IntoResponse {
    let mut status = instance.status();
    status.modules.retain_mut(|m| {
        who.visible_module(&m.name)
            .map(|name| m.name = name)
            .is_some()
    });
    axum::Json(status)
}

/// A version as an entity tag: the number in quotes.
fn etag(version: u64) -> String {
    format!("\"{version}\"")
}

/// The write precondition the request's `If-Match` / `If-None-Match: *`
/// headers ask for; `None` when it sends both, which no entry can meet (one
/// needs an entry of a version, the other no entry: RFC 9110 evaluates
/// both, so the answer is `412`). Found by Schemathesis: the write went
/// ahead, `If-Match` ignored.
fn expectation(headers: &HeaderMap) -> Result<Option<Expect>, Error> {
    let text = |name: header::HeaderName| {
        headers
            .get(&name)
            .map(|v| {
                v.to_str()
                    .map(str::trim)
                    .map_err(|_| Error::InvalidKey(format!("the {name} header must be ASCII")))
            })
            .transpose()
    };
    let absent = match text(header::IF_NONE_MATCH)? {
        None => false,
        Some("*") => true,
        Some(value) => {
            return Err(Error::InvalidKey(format!(
                "If-None-Match {value:?} is not supported: use `*` (write only if there is no entry)"
            )));
        }
    };
    let version = match text(header::IF_MATCH)? {
        None => None,
        Some(value) => Some(
            value
                .trim_start_matches("W/")
                .trim_matches('"')
                .parse()
                .map_err(|_| {
                    Error::InvalidKey(format!(
                        "If-Match {value:?} is not a cache version: send the ETag a read returned, e.g. If-Match: \"42\""
                    ))
                })?,
        ),
    };
    Ok(match (absent, version) {
        (true, Some(_)) => None,
        (true, None) => Some(Expect::Absent),
        (false, Some(version)) => Some(Expect::Version(version)),
        (false, None) => Some(Expect::Any),
    })
}

/// The `412` for a precondition no entry can meet, naming the entry's
/// version now (or the error reading it).
async fn unmeetable(instance: &Instance, namespace: &str, key: &str) -> Error {
    match instance.cache().get(namespace, key).await {
        Ok(entry) => Error::VersionConflict {
            current: entry.map(|e| e.version),
        },
        Err(e) => e,
    }
}

/// Cache query parameters.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheQuery {
    /// Time-to-live, e.g. `10s`.
    ttl: Option<String>,
}

async fn cache_get(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, Error> {
    let (shown, key) = cache_path(path)?;
    let namespace = who.cache_namespace(&shown)?;
    Ok(match instance.cache().get(&namespace, &key).await? {
        Some(entry) => {
            let mut response = (
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
                    (header::ETAG, etag(entry.version)),
                ],
                entry.value,
            )
                .into_response();
            if let Some(left) = entry.expires_in
                && let Ok(value) = left.as_millis().to_string().parse()
            {
                response.headers_mut().insert("x-fief-expires-in-ms", value);
            }
            response
        }
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(json!({"error": {
                "code": "not_found",
                "message": format!("no entry for key {key:?} in cache namespace {shown:?}"),
            }})),
        )
            .into_response(),
    })
}

async fn cache_put(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<CacheQuery>, axum::extract::rejection::QueryRejection>,
    headers: HeaderMap,
    body: Body,
) -> Result<impl IntoResponse, Error> {
    let (namespace, key) = cache_path(path)?;
    let namespace = who.cache_namespace(&namespace)?;
    let Query(query) = query.map_err(|e| {
        Error::InvalidKey(format!(
            "the query string is malformed: {e} (the only parameter is ttl, e.g. ?ttl=10s)"
        ))
    })?;
    let ttl = query
        .ttl
        .map(|text| {
            humantime::parse_duration(&text).map_err(|e| {
                Error::InvalidKey(format!(
                    "ttl {text:?} is not a duration such as 10s or 500ms: {e}"
                ))
            })
        })
        .transpose()?;
    let expect = expectation(&headers)?;
    let limit = instance.config().max_message_size.as_u64() as usize;
    let value = read_body(body, limit).await?;
    let Some(expect) = expect else {
        return Err(unmeetable(&instance, &namespace, &key).await);
    };
    let options = PutOptions { ttl, expect };
    let version = instance
        .cache()
        .put(&namespace, &key, value.to_vec(), options)
        .await?;
    Ok((
        [(header::ETAG, etag(version))],
        axum::Json(CacheVersion { version }),
    ))
}

async fn cache_delete(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    path: Result<Path<(String, String)>, PathRejection>,
    headers: HeaderMap,
) -> Result<impl IntoResponse, Error> {
    let (namespace, key) = cache_path(path)?;
    let namespace = who.cache_namespace(&namespace)?;
    let Some(expect) = expectation(&headers)? else {
        return Err(unmeetable(&instance, &namespace, &key).await);
    };
    let deleted = instance.cache().delete(&namespace, &key, expect).await?;
    Ok(axum::Json(Deleted { deleted }))
}

// ---- Response bodies (their schemas are in the OpenAPI document) ----

/// The answer of a cast: the message is queued (it may still be lost).
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Queued {
    /// Always `true`.
    pub queued: bool,
}

/// The answer of `DELETE /v1/keys/{module}/{key}`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Killed {
    /// Whether the key had a live process here (now killed).
    pub killed: bool,
}

/// The answer of `GET /v1/state/{module}/{key}`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct StateEntries {
    /// The committed entries, sorted by name.
    pub entries: Vec<crate::storage::StoredEntry>,
}

/// The answer of `GET /v1/alarms/{module}/{key}`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct AlarmList {
    /// The committed alarms, sorted by name.
    pub alarms: Vec<crate::StoredAlarmView>,
}

/// The answer of a cache write: the entry's new version (also its `ETag`).
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct CacheVersion {
    /// The new version.
    pub version: u64,
}

/// The answer of a cache delete.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Deleted {
    /// Whether there was an entry (now deleted).
    pub deleted: bool,
}
