//! The probes a load balancer or an orchestrator asks a node, and the API's
//! own description: `GET /v1/health`, `GET /v1/ready` and
//! `GET /v1/openapi.json`.
//!
//! | method and path | what |
//! |---|---|
//! | `GET /v1/health` | liveness: `200 {"status":"up"}` whenever the process serves HTTP |
//! | `GET /v1/ready` | readiness: `200` while the lease is current and the node serves, `503` while it is joining, fenced, leaving or stopping; the body is a [`Readiness`] saying which |
//! | `GET /v1/openapi.json` | the OpenAPI 3.1 document of the whole API ([`crate::openapi`]) |
//!
//! These three need **no token**, even on a node with tokens ([`crate::auth`]):
//! probes carry none, and they say nothing a caller could not learn from the
//! fact that the node answers (the readiness names no module, key, tenant or
//! peer; the document is the same for every node). They are routed outside
//! the authentication layer by [`crate::http::router_with`]; everything else
//! is inside it.
//!
//! Health is deliberately shallow: it reports that the process is alive and
//! its HTTP loop answers, never the lease, so an orchestrator restarts a hung
//! process but not a fenced one (a fenced node rejoins by itself once the
//! arbiter answers). Readiness is what a balancer uses to send requests only
//! to nodes that serve — a fenced node refuses every key with `503 fenced`,
//! even keys that healthy nodes own.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::node::{Instance, Readiness};

/// The answer of `GET /v1/health`.
#[derive(Clone, Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Health {
    /// Always `up`: the process is alive and serves HTTP.
    pub status: HealthStatus,
}

/// The only health a node reports (one that is down does not answer).
#[derive(Clone, Copy, Debug, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum HealthStatus {
    /// The process answers.
    Up,
}

/// The probe routes and the OpenAPI document, served without
/// authentication.
pub(crate) fn routes() -> Router<Arc<Instance>> {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/ready", get(ready))
        .route("/v1/openapi.json", get(openapi))
}

async fn health() -> axum::Json<Health> {
    axum::Json(Health {
        status: HealthStatus::Up,
    })
}

async fn ready(State(instance): State<Arc<Instance>>) -> impl IntoResponse {
    let readiness: Readiness = instance.readiness();
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(readiness))
}

async fn openapi() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::document_json(),
    )
}
