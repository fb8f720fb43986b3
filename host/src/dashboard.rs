//! The live dashboard every node serves at `/`, and the cluster view behind
//! it.
//!
//! The page (`dashboard/index.html`, `.js`, `.css`, embedded in the binary
//! with `include_str!`, no CDN) polls `GET /v1/cluster` once a second for a
//! [`ClusterView`] snapshot (`GET /v1/cluster/events` serves the same
//! snapshots as a server-sent-event stream, one at once and then one every
//! [`SNAPSHOT_EVERY`], for scripts). A snapshot is what the serving node
//! knows: the owner of every partition from its table, the live members
//! with their lease time left as the arbiter last judged it, its own lease
//! and fence state, its limbo, per-module live keys and calls served, and
//! each live node's last five minutes of calls, p99 latency, live keys and
//! fences (`dashboard_history.rs`; a peer asked over the peer link that
//! does not answer within [`PEER_HISTORY_TIMEOUT`] is *no data*). The page
//! colours the partition grid by owner, draws each node's lease countdown
//! and four line plots (one line per node, in its colour, drawn as inline
//! SVG), and marks a node it saw before but the arbiter no longer lists as
//! *gone*; a node fenced but still running shows as fenced on its own page.
//!
//! The page and its assets need no token (they hold no data). The snapshot
//! and the stream take the caller's token like any API route, and show
//! what the caller may see ([`ClusterView::for_identity`]): the admin (or
//! anyone, on an open node) sees everything; a tenant sees only its own
//! modules and their limbo entries, under the names it uses, plus the
//! partition grid and the nodes' leases (which name no tenant's data), but
//! no node-wide history (it sums every tenant's calls and keys) and no peer
//! addresses. With tokens configured the page asks for one (kept in the
//! tab's `sessionStorage`, sent as `Authorization: Bearer`).

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
use crate::dashboard_history::{NodeHistory, Sample};
use crate::error::Error;
use crate::limbo::LimboEntry;
use crate::node::{Instance, LeaseState, NodeStatus};
use crate::sync::lock;
use crate::wire::{FEATURE_HISTORY, PeerRequest, WireHistory};

/// How often the event stream sends a snapshot.
pub const SNAPSHOT_EVERY: Duration = Duration::from_millis(500);

/// How long a snapshot waits for a peer's history before showing it as
/// *no data*.
pub const PEER_HISTORY_TIMEOUT: Duration = Duration::from_millis(400);

/// One snapshot of the cluster as one node sees it.
#[derive(Clone, Debug, Serialize, utoipa::ToSchema)]
pub struct ClusterView {
    /// Who the view is for: `admin`, `anonymous` (an open node) or
    /// `tenant:NAME` (see [`ClusterView::for_identity`]).
    pub viewer: String,
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
    /// Each live node's last minutes of figures, by node id (empty in a
    /// tenant's view: the figures are node-wide).
    pub history: Vec<NodeHistory>,
}

impl ClusterView {
    /// The view as `who` may see it: the admin (or anyone, on an open
    /// node) sees it whole; a tenant sees only its own modules and their
    /// limbo entries, named as it names them, the partition grid and the
    /// nodes' leases, but no history and no peer addresses.
    #[must_use]
    pub fn for_identity(mut self, who: &Identity) -> ClusterView {
        self.viewer = who.label();
        if who.tenant().is_none() {
            return self;
        }
        self.modules = self
            .modules
            .into_iter()
            .filter_map(|mut m| {
                m.name = who.visible_module(&m.name)?;
                Some(m)
            })
            .collect();
        self.limbo = self
            .limbo
            .into_iter()
            .filter_map(|mut e| {
                e.module = who.visible_module(&e.module)?;
                Some(e)
            })
            .collect();
        self.history.clear();
        for node in &mut self.nodes {
            node.peer_addr = None;
        }
        self
    }
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
    /// A snapshot of the cluster as this node sees it, whole (what the
    /// dashboard shows the admin; [`ClusterView::for_identity`] filters it
    /// for a tenant).
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
            viewer: Identity::Admin.label(),
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
            history: self.histories().await,
        }
    }

    /// This node's history and each live peer's, asked at once, each peer
    /// given [`PEER_HISTORY_TIMEOUT`].
    async fn histories(&self) -> Vec<NodeHistory> {
        let shared = self.shared();
        let mine = NodeHistory {
            node: shared.node_id.to_string(),
            samples: Some(
                lock(&shared.history)
                    .samples()
                    .into_iter()
                    .map(Sample::from)
                    .collect(),
            ),
        };
        let peers: Vec<(String, Option<String>)> = shared
            .members
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .filter(|m| m.node != shared.node_id)
            .map(|m| (m.node.to_string(), m.peer_addr.clone()))
            .collect();
        let asks = peers.iter().map(|(node, addr)| async move {
            let addr = addr.as_deref()?;
            if !shared.peers.speaks(node, FEATURE_HISTORY) {
                return None;
            }
            let bytes = shared
                .peers
                .request(addr, PeerRequest::History, PEER_HISTORY_TIMEOUT)
                .await
                .ok()?;
            let WireHistory(samples) = postcard::from_bytes(&bytes).ok()?;
            Some(
                samples
                    .into_iter()
                    .take(crate::dashboard_history::HISTORY_SAMPLES)
                    .map(Sample::from)
                    .collect(),
            )
        });
        let answers = futures_util::future::join_all(asks).await;
        let mut all = vec![mine];
        all.extend(
            peers
                .into_iter()
                .zip(answers)
                .map(|((node, _), samples)| NodeHistory { node, samples }),
        );
        all.sort_by(|a, b| a.node.cmp(&b.node));
        all
    }
}

/// The dashboard's page and assets, served without a token (they hold no
/// data; the page asks for one when the snapshot needs it).
pub(crate) fn page_routes() -> Router<Arc<Instance>> {
    Router::new()
        .route("/", get(page))
        .route("/dashboard.js", get(script))
        .route("/dashboard.css", get(style))
}

/// The snapshot and the event stream, each filtered by the caller's
/// identity.
pub(crate) fn routes() -> Router<Arc<Instance>> {
    Router::new()
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
    Ok(axum::Json(instance.cluster_view().await.for_identity(&who)))
}

/// A snapshot now, then one every [`SNAPSHOT_EVERY`], as `snapshot` events.
async fn events(
    State(instance): State<Arc<Instance>>,
    Extension(who): Extension<Identity>,
) -> Result<Sse<impl futures_util::stream::Stream<Item = Result<Event, Infallible>>>, Error> {
    let stream = futures_util::stream::unfold((instance, true), move |(instance, first)| {
        let who = who.clone();
        async move {
            if !first {
                // The stream ends when the node is asked to stop, so an open
                // page never holds up a graceful shutdown.
                tokio::select! {
                    () = tokio::time::sleep(SNAPSHOT_EVERY) => {}
                    () = instance.stop_requested() => return None,
                }
            }
            let view = instance.cluster_view().await.for_identity(&who);
            let event = Event::default()
                .event("snapshot")
                .json_data(&view)
                .unwrap_or_else(|e| Event::default().event("error").data(e.to_string()));
            Some((Ok(event), (instance, false)))
        }
    });
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> ClusterView {
        let module = |name: &str| ModuleView {
            name: name.to_owned(),
            version: 1,
            live_keys: 2,
            calls_served: 3,
        };
        let limbo = |module: &str| LimboEntry {
            module: module.to_owned(),
            key: "k".to_owned(),
            partition: 0,
            since: SystemTime::UNIX_EPOCH,
            mode: "continue".to_owned(),
        };
        ClusterView {
            viewer: "admin".to_owned(),
            node_id: "n1".to_owned(),
            namespace: "ns".to_owned(),
            at_ms: 0,
            lease: LeaseState::Current,
            lease_remaining_ms: 1,
            lease_ttl_ms: 2,
            fences: 0,
            leader_term: None,
            epoch: 1,
            nodes: vec![NodeStatus {
                id: "n1".to_owned(),
                peer_addr: Some("10.0.0.1:7000".to_owned()),
                leader: true,
                leaving: false,
                lease_remaining_ms: 1,
                partitions: 4,
            }],
            owners: vec![Some("n1".to_owned()); 4],
            limbo: vec![limbo("acme/chat"), limbo("globex/ledger"), limbo("plain")],
            modules: vec![
                module("acme/counter"),
                module("globex/secret"),
                module("plain"),
            ],
            history: vec![NodeHistory {
                node: "n1".to_owned(),
                samples: Some(Vec::new()),
            }],
        }
    }

    #[test]
    fn a_tenant_sees_only_its_own_modules_and_limbo_and_no_history() {
        let seen = view().for_identity(&Identity::Tenant("acme".into()));
        assert_eq!(seen.viewer, "tenant:acme");
        let names: Vec<&str> = seen.modules.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(names, ["counter"]);
        let limbo: Vec<&str> = seen.limbo.iter().map(|e| e.module.as_str()).collect();
        assert_eq!(limbo, ["chat"]);
        assert!(
            seen.history.is_empty(),
            "node-wide figures are not a tenant's"
        );
        assert_eq!(seen.nodes[0].peer_addr, None);
        assert_eq!(seen.owners.len(), 4, "the grid names no tenant's data");
        let json = serde_json::to_string(&seen).unwrap();
        assert!(
            !json.contains("globex") && !json.contains("plain") && !json.contains("10.0.0.1"),
            "{json}"
        );
    }

    #[test]
    fn the_admin_and_an_open_node_see_everything() {
        for who in [Identity::Admin, Identity::Open] {
            let seen = view().for_identity(&who);
            assert_eq!(seen.modules.len(), 3);
            assert_eq!(seen.limbo.len(), 3);
            assert_eq!(seen.history.len(), 1);
            assert!(seen.nodes[0].peer_addr.is_some());
            assert_eq!(seen.viewer, who.label());
        }
    }
}
