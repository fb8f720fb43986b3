//! The live dashboard every node serves at `/`, and the cluster view behind
//! it.
//!
//! The page (`dashboard/index.html`, `.js`, `.css`, embedded in the binary
//! with `include_str!`, no CDN) opens an `EventSource` on
//! `GET /v1/cluster/events`, a server-sent-event stream of [`ClusterView`]
//! snapshots, one at once and then one every [`SNAPSHOT_EVERY`]. A snapshot
//! is what the serving node knows: the owner of every partition from its
//! table, the live members with their lease time left as the arbiter last
//! judged it, its own lease and fence state, its limbo, and per-module live
//! keys and calls served. The page colours the partition grid by owner,
//! draws each node's lease countdown, and marks a node it saw before but the
//! arbiter no longer lists as *gone* (its lease expired or it left); a node
//! fenced but still running shows as fenced on its own page. Call rates are
//! the page's differences between snapshots. `GET /v1/cluster` serves one
//! snapshot as JSON (for scripts and `fief status`).
//!
//! With API tokens configured, the snapshot and the stream need an admin
//! token (they name every tenant's modules); a browser's `EventSource`
//! cannot send one, so such a cluster's dashboard is for an authenticating
//! proxy in front of the node.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{Extension, State};
use axum::http::header;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use serde::Serialize;

use crate::auth::Identity;
use crate::error::Error;
use crate::limbo::LimboEntry;
use crate::node::{Instance, LeaseState, NodeStatus};

/// How often the event stream sends a snapshot.
pub const SNAPSHOT_EVERY: Duration = Duration::from_millis(500);

/// One snapshot of the cluster as one node sees it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ClusterView {
    /// The node serving the snapshot.
    pub node_id: String,
    /// The namespace.
    pub namespace: String,
    /// When the snapshot was taken, in Unix milliseconds.
    pub at_ms: u64,
    /// The serving node's lease state.
    pub lease: LeaseState,
    /// Time left before the serving node's fence point, in milliseconds.
    pub lease_remaining_ms: u128,
    /// The lease time-to-live, in milliseconds.
    pub lease_ttl_ms: u128,
    /// How often the serving node has fenced.
    pub fences: u64,
    /// The leader's term, if the serving node leads.
    pub leader_term: Option<u64>,
    /// The epoch of the serving node's table.
    pub epoch: u64,
    /// The live members, as the serving node last heard from the arbiter.
    pub nodes: Vec<NodeStatus>,
    /// The owner of each partition, by index: the node's id, or `None` if
    /// the partition is unassigned (or the serving node, fenced, knows no
    /// table).
    pub owners: Vec<Option<String>>,
    /// Survivors in the serving node's limbo.
    pub limbo: Vec<LimboEntry>,
    /// Modules on the serving node.
    pub modules: Vec<ModuleView>,
}

/// A module's figures on the serving node.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ModuleView {
    /// Its name.
    pub name: String,
    /// The version new activations use.
    pub version: u64,
    /// Live keys on the serving node.
    pub live_keys: usize,
    /// Calls served on the serving node so far (the page derives rates).
    pub calls_served: u64,
}

impl Instance {
    /// A snapshot of the cluster as this node sees it (what the dashboard
    /// shows and `GET /v1/cluster` serves).
    pub async fn cluster_view(&self) -> ClusterView {
        let status = self.status();
        let owners = {
            let table = self.shared().table();
            table
                .iter()
                .map(|(_, owner)| owner.map(|a| a.node.to_string()))
                .collect()
        };
        let served = self.shared().metrics.served();
        let modules = status
            .modules
            .iter()
            .map(|m| ModuleView {
                name: m.name.clone(),
                version: m.version,
                live_keys: m.live_keys,
                calls_served: served.get(&m.name).copied().unwrap_or(0),
            })
            .collect();
        ClusterView {
            node_id: status.node_id,
            namespace: status.namespace,
            at_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            lease: status.lease,
            lease_remaining_ms: status.lease_remaining_ms,
            lease_ttl_ms: status.lease_ttl_ms,
            fences: status.fences,
            leader_term: status.leader_term,
            epoch: status.epoch,
            nodes: status.nodes,
            owners,
            limbo: self.limbo().await,
            modules,
        }
    }
}

/// The dashboard's routes: the page, its assets, the snapshot and the
/// event stream.
pub(crate) fn routes() -> Router<Arc<Instance>> {
    Router::new()
        .route("/", get(page))
        .route("/dashboard.js", get(script))
        .route("/dashboard.css", get(style))
        .route("/v1/cluster", get(snapshot))
        .route("/v1/cluster/events", get(events))
}

async fn page() -> Html<&'static str> {
    Html(include_str!("dashboard/index.html"))
}

async fn script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("dashboard/dashboard.js"),
    )
}

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("dashboard/dashboard.css"),
    )
}

async fn snapshot(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> Result<impl IntoResponse, Error> {
    who.require_admin("reading the cluster view")?;
    Ok(axum::Json(instance.cluster_view().await))
}

/// A snapshot now, then one every [`SNAPSHOT_EVERY`], as `snapshot` events.
async fn events(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> Result<Sse<impl futures_util::stream::Stream<Item = Result<Event, Infallible>>>, Error> {
    who.require_admin("reading the cluster view")?;
    let stream = futures_util::stream::unfold((instance, true), |(instance, first)| async move {
        if !first {
            // The stream ends when the node is asked to stop, so an open
            // page never holds up a graceful shutdown.
            tokio::select! {
                () = tokio::time::sleep(SNAPSHOT_EVERY) => {}
                () = instance.stop_requested() => return None,
            }
        }
        let view = instance.cluster_view().await;
        let event = Event::default()
            .event("snapshot")
            .json_data(&view)
            .unwrap_or_else(|e| Event::default().event("error").data(e.to_string()));
        Some((Ok(event), (instance, false)))
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}
