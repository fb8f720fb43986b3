//! The module endpoints of the HTTP API (routed by [`crate::http`]): the
//! streamed upload of a deploy, and listing, rollback and undeploy.
//!
//! | method and path | what |
//! |---|---|
//! | `GET /v1/modules` | every module: versions, the current one, which version each node has loaded ([`ModuleListing`]) |
//! | `GET /v1/modules/{name}` | one module, the same way (`404` if it is not deployed) |
//! | `POST /v1/modules/{name}/rollback?version=N` | make stored version `N` current again |
//! | `DELETE /v1/modules/{name}` | undeploy: stop its keys on every node and remove it |
//!
//! An upload is read as a stream into one buffer: a `Content-Length` over
//! [`MAX_MODULE_BYTES`] is refused before any byte is read, a body that
//! grows past it is refused as soon as it does, and the first bytes are
//! checked to be a component before the rest is read.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Extension, Path, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::IntoResponse;
use bytes::BytesMut;
use futures_util::StreamExt;

use crate::auth::Identity;
use crate::error::Error;
use crate::module::{MAX_MODULE_BYTES, check_header};
use crate::node::Instance;
use crate::node::ModuleListing;

fn too_large(size: impl std::fmt::Display) -> Error {
    Error::InvalidModule(format!(
        "the component is {size} bytes, over the limit of {MAX_MODULE_BYTES} bytes"
    ))
}

/// Read an uploaded component as a stream, at most [`MAX_MODULE_BYTES`].
///
/// # Errors
///
/// [`Error::InvalidModule`] when it is too large, not a component, or the
/// upload broke off.
pub(crate) async fn read_module_body(headers: &HeaderMap, body: Body) -> Result<Bytes, Error> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared
        && len > MAX_MODULE_BYTES as u64
    {
        return Err(too_large(len));
    }
    let capacity = declared.map_or(64 * 1024, |len| len as usize);
    let mut buffer = BytesMut::with_capacity(capacity);
    let mut checked = false;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            Error::InvalidModule(format!(
                "the upload broke off after {} bytes: {e}",
                buffer.len()
            ))
        })?;
        if buffer.len() + chunk.len() > MAX_MODULE_BYTES {
            return Err(too_large(format!("over {}", buffer.len() + chunk.len())));
        }
        buffer.extend_from_slice(&chunk);
        if !checked && buffer.len() >= 8 {
            check_header(&buffer)?;
            checked = true;
        }
    }
    if !checked {
        check_header(&buffer)?;
    }
    Ok(buffer.freeze())
}

fn module_name(name: Result<Path<String>, PathRejection>) -> Result<String, Error> {
    name.map(|Path(name)| name)
        .map_err(|e| Error::InvalidModuleName {
            name: String::new(),
            why: format!("the module name in the path must be valid percent-encoded UTF-8: {e}"),
        })
}

/// `GET /v1/modules`: a tenant sees only its own, under the names it uses.
pub(crate) async fn list(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> Result<axum::Json<Vec<ModuleListing>>, Error> {
    let mut modules = instance.modules().await?;
    modules.retain_mut(|m| {
        who.visible_module(&m.name)
            .map(|name| m.name = name)
            .is_some()
    });
    Ok(axum::Json(modules))
}

/// `GET /v1/modules/{name}`.
pub(crate) async fn get_one(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    name: Result<Path<String>, PathRejection>,
) -> Result<axum::Json<ModuleListing>, Error> {
    let shown = module_name(name)?;
    let name = who.module(&shown)?;
    let mut listing = instance
        .modules()
        .await?
        .into_iter()
        .find(|m| m.name == name)
        .ok_or(Error::UnknownModule(shown.clone()))?;
    listing.name = shown;
    Ok(axum::Json(listing))
}

/// The query of a rollback.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RollbackQuery {
    /// The stored version to make current.
    version: u64,
}

/// `POST /v1/modules/{name}/rollback?version=N`.
pub(crate) async fn rollback(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    name: Result<Path<String>, PathRejection>,
    query: Result<Query<RollbackQuery>, QueryRejection>,
) -> Result<impl IntoResponse, Error> {
    let name = who.module(&module_name(name)?)?;
    let Query(query) = query.map_err(|e| {
        Error::InvalidOptions(format!(
            "a rollback needs the version to go back to, e.g. ?version=2: {e}"
        ))
    })?;
    Ok(axum::Json(instance.rollback(&name, query.version).await?))
}

/// `DELETE /v1/modules/{name}`.
pub(crate) async fn undeploy(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
    name: Result<Path<String>, PathRejection>,
) -> Result<impl IntoResponse, Error> {
    let shown = module_name(name)?;
    let name = who.module(&shown)?;
    instance.undeploy(&name).await?;
    Ok(axum::Json(Undeployed { undeployed: shown }))
}

/// The answer of `DELETE /v1/modules/{name}`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct Undeployed {
    /// The module undeployed, as the caller named it.
    pub undeployed: String,
}
