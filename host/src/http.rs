//! The HTTP API of a node (axum): deploy modules, call and cast keys, status.
//!
//! | method and path | what |
//! |---|---|
//! | `PUT /v1/modules/{name}?option=value…` | deploy a component (raw body) |
//! | `POST /v1/keys/{module}/{key}/call` | raw message in, raw reply out |
//! | `POST /v1/keys/{module}/{key}/cast` | raw message in, `202` |
//! | `DELETE /v1/keys/{module}/{key}` | kill a key's process |
//! | `GET /v1/keys` | live keys |
//! | `GET /v1/status` | the node's [`Status`](crate::Status) |
//! | `POST /v1/leave` | leave the cluster gracefully, then stop |
//! | `GET /v1/limbo` | the survivors in limbo ([`LimboEntry`](crate::LimboEntry)) |
//!
//! Every error is JSON `{"error":{"code":"…","message":"…"}}` with the status
//! of [`Error::http_status`]. Bodies are read with a limit (the node's
//! `max_message_size` for messages, [`MAX_MODULE_BYTES`] for modules), so a
//! client cannot make the node buffer more than that.

use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::PathRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde_json::json;

use crate::config::ModuleOptions;
use crate::error::Error;
use crate::module::MAX_MODULE_BYTES;
use crate::node::Instance;

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = json!({"error": {"code": self.code(), "message": self.to_string()}});
        (status, axum::Json(body)).into_response()
    }
}

/// The API's routes over `instance`.
pub fn router(instance: Arc<Instance>) -> Router {
    Router::new()
        .route("/v1/modules/{name}", put(deploy))
        .route("/v1/keys/{module}/{key}/call", post(call))
        .route("/v1/keys/{module}/{key}/cast", post(cast))
        .route("/v1/keys/{module}/{key}", axum::routing::delete(kill))
        .route("/v1/keys", get(keys))
        .route("/v1/status", get(status))
        .route("/v1/leave", post(leave))
        .route("/v1/limbo", get(limbo))
        .method_not_allowed_fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                Error::MethodNotAllowed(format!("{method} is not allowed on {}", uri.path()))
            },
        )
        .fallback(
            |uri: axum::http::Uri| async move { Error::NoSuchEndpoint(uri.path().to_owned()) },
        )
        .layer(DefaultBodyLimit::disable())
        .with_state(instance)
}

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
    axum::serve(listener, router(instance))
        .with_graceful_shutdown(shutdown)
        .await
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

fn key_path(
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<(String, String), Error> {
    path.map(|Path(p)| p).map_err(|e| {
        Error::InvalidKey(format!(
            "the module and key in the path must be valid percent-encoded UTF-8: {e}"
        ))
    })
}

async fn deploy(
    State(instance): State<Arc<Instance>>,
    name: Result<Path<String>, PathRejection>,
    options: Result<Query<Vec<(String, String)>>, axum::extract::rejection::QueryRejection>,
    body: Body,
) -> Result<impl IntoResponse, Error> {
    let Query(options) = options
        .map_err(|e| Error::InvalidOptions(format!("the query string is malformed: {e}")))?;
    let Path(name) = name.map_err(|e| Error::InvalidModuleName {
        name: String::new(),
        why: format!("the module name in the path must be valid percent-encoded UTF-8: {e}"),
    })?;
    let options = ModuleOptions::from_pairs(options.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
    let wasm = read_body(body, MAX_MODULE_BYTES).await.map_err(|_| {
        Error::InvalidModule(format!(
            "the component is over the limit of {MAX_MODULE_BYTES} bytes"
        ))
    })?;
    let info = instance.deploy(&name, &wasm, options).await?;
    Ok(axum::Json(info))
}

async fn call(
    State(instance): State<Arc<Instance>>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Body,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(path)?;
    let limit = instance.config().max_message_size.as_u64() as usize;
    let message = read_body(body, limit).await?;
    let reply = instance.call(&module, &key, message.to_vec()).await?;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], reply))
}

async fn cast(
    State(instance): State<Arc<Instance>>,
    path: Result<Path<(String, String)>, PathRejection>,
    body: Body,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(path)?;
    let limit = instance.config().max_message_size.as_u64() as usize;
    let message = read_body(body, limit).await?;
    instance.cast(&module, &key, message.to_vec())?;
    Ok((StatusCode::ACCEPTED, axum::Json(json!({"queued": true}))))
}

async fn kill(
    State(instance): State<Arc<Instance>>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<impl IntoResponse, Error> {
    let (module, key) = key_path(path)?;
    let killed = instance.kill_key(&module, &key);
    Ok(axum::Json(json!({"killed": killed})))
}

async fn keys(State(instance): State<Arc<Instance>>) -> impl IntoResponse {
    axum::Json(instance.keys())
}

async fn leave(State(instance): State<Arc<Instance>>) -> Result<impl IntoResponse, Error> {
    instance.leave(LEAVE_TIMEOUT).await?;
    instance.request_stop();
    Ok(axum::Json(json!({"left": true})))
}

/// How long `POST /v1/leave` waits for every partition to move.
const LEAVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

async fn limbo(State(instance): State<Arc<Instance>>) -> impl IntoResponse {
    axum::Json(instance.limbo().await)
}

async fn status(State(instance): State<Arc<Instance>>) -> impl IntoResponse {
    axum::Json(instance.status())
}
