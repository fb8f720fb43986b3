//! The in-process cluster of the cluster ownership and failure tests
//! (`cluster_failures.rs`, and the other modules that use [`Cluster`]):
//! several nodes in one process sharing the embedded arbiter and one stepped
//! clock, talking over real loopback sockets (contract §5 rows 1–4;
//! guarantees 1–4; issue "Cluster ownership").
//!
//! Every node reports its key processes' lives to one recorder, and every
//! test ends with [`Cluster::check`]: the ownership checker
//! ([`ownership_checker`]) finds no two overlapping lives of one key anywhere,
//! and no two nodes report a live process for one key.
//!
//! Time: the nodes and the arbiter read one [`SteppedClock`]. The clock
//! starts at 0 and every node registers at 0, so leases are renewed on whole
//! seconds. [`Cluster::advance`] steps it 100 ms at a time and, after each
//! step, waits (in real time, bounded) until every node has reacted: a node
//! that can reach the arbiter has renewed when due, and a node that is not
//! current has killed its keys. So each test walks an exact timeline
//! (renewal at `s`, fence point `s + 4 s`, arbiter expiry `s + 5 s`) however
//! fast or slow the machine is; real time only bounds the polling.
//!
//! Ownership: `n0` starts first, leads, and takes every partition; as leader
//! it then hands partitions to the later nodes (graceful moves). So the tests
//! first let the cluster settle ([`Cluster::stabilize`]) and then look up
//! who owns what in the arbiter's table instead of assuming it. `n0` stays
//! the leader until its lease expires, so a fault injected on `n0` also hits
//! the leader.

#[path = "ownership_checker.rs"]
pub mod ownership_checker;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fief::arbiter::{Arbiter, ArbiterFuture, LeaseId, LocalArbiter, Member, Term};
use fief::core::{Clock, NodeId, OwnershipTable, PartitionCount, PartitionId};
use fief::{Error, Instance, LeaseState, ModuleOptions, NodeConfig, SteppedClock};
use fief_tests::guests;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::AbortHandle;

use ownership_checker::{Summary, assert_single_ownership};

/// Partitions per namespace in these tests.
pub const PARTITIONS: u32 = 16;
/// The namespace every node of a test cluster uses.
const NAMESPACE: &str = "default";
/// One clock step of [`Cluster::advance`].
pub(crate) const STEP: Duration = Duration::from_millis(100);
/// The lease timing the nodes run with: the defaults (contract §2).
pub(crate) const TTL: Duration = Duration::from_secs(5);
pub(crate) const RENEW: Duration = Duration::from_secs(1);
pub(crate) const MARGIN: Duration = Duration::from_secs(1);
/// Real time a node may take to react to one clock step, or a test to see
/// an outcome. Generous: only a broken node takes this long.
pub(crate) const REACT: Duration = Duration::from_secs(10);
/// Real time a call may take before it times out (a call to a cut-off owner
/// may wait this long).
const CALL_TIMEOUT: Duration = Duration::from_secs(3);

pub(crate) const COUNTER: (&str, &str) = ("counter", guests::COUNTER);

pub(crate) fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// `modules`, each with the default options.
fn with_defaults<'a>(modules: &[(&'a str, &'a str)]) -> Vec<(&'a str, &'a str, ModuleOptions)> {
    modules
        .iter()
        .map(|&(name, path)| (name, path, ModuleOptions::default()))
        .collect()
}

/// The configuration of node `n<id>`.
pub fn config(id: usize) -> NodeConfig {
    NodeConfig {
        node_id: format!("n{id}"),
        namespace: NAMESPACE.to_owned(),
        partitions: PARTITIONS,
        max_live_keys: 64,
        max_memory_per_key: fief::config::ByteSize::mib(64),
        call_timeout: CALL_TIMEOUT,
        lease_ttl: TTL,
        renew_interval: RENEW,
        fence_margin: MARGIN,
        ..NodeConfig::default()
    }
}

/// The cluster's arbiter: the shared [`LocalArbiter`] (which judges expiry
/// on the cluster's stepped clock), plus three test-only powers: list a
/// node's peer address as that of a proxy in front of it, hold a node's
/// `campaign` calls (the arbiter is slow to answer that node), and refuse a
/// node's next `transfer` without committing it.
pub struct TestArbiter {
    local: LocalArbiter,
    peer_addrs: HashMap<NodeId, String>,
    held: watch::Sender<HashSet<NodeId>>,
    refuse_transfer: Mutex<HashSet<NodeId>>,
}

impl Arbiter for TestArbiter {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        let peer_addr = self.peer_addrs.get(node).map(String::as_str).or(peer_addr);
        self.local.register(namespace, node, ttl, peer_addr)
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, u64> {
        self.local.renew(namespace, node, lease)
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        self.local.release(namespace, node, lease)
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        self.local.set_leaving(namespace, node, lease)
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        self.local.live_nodes(namespace)
    }

    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>> {
        Box::pin(async move {
            let mut held = self.held.subscribe();
            let _ = held.wait_for(|held| !held.contains(node)).await;
            self.local.campaign(namespace, node, lease).await
        })
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        self.local.table(namespace)
    }

    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        if self.refuse_transfer.lock().unwrap().remove(from) {
            let refused =
                fief::arbiter::ArbiterError::Unreachable("refused by the test".to_owned());
            return Box::pin(std::future::ready(Err(refused)));
        }
        self.local.transfer(namespace, from, lease, moves)
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        self.local.write_table(namespace, term, changes)
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: fief::arbiter::NewModuleVersion,
    ) -> ArbiterFuture<'a, fief::arbiter::ModuleVersionRecord> {
        self.local.put_module(namespace, module)
    }

    fn modules<'a>(
        &'a self,
        namespace: &'a str,
    ) -> ArbiterFuture<'a, Vec<fief::arbiter::StoredModule>> {
        self.local.modules(namespace)
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<fief::arbiter::Bytes>> {
        self.local.module_bytes(namespace, name, version)
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, fief::arbiter::StoredModule> {
        self.local.set_current_module(namespace, name, version)
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        self.local.remove_module(namespace, name)
    }
}

/// A TCP proxy in front of a node's peer listener: the node's peers reach
/// it only through the proxy, so cutting the proxy partitions the node from
/// every peer at the network level while the arbiter still reaches it.
struct PeerProxy {
    addr: SocketAddr,
    up: Arc<Mutex<bool>>,
    /// Set: the next link to carry bytes back from the node drops them and
    /// closes (the node processed a request, its answer is lost).
    lose_answer: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
}

impl PeerProxy {
    async fn start(target: SocketAddr) -> PeerProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(Mutex::new(true));
        let lose_answer = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accept = tokio::spawn({
            let (up, links, lose_answer) = (up.clone(), links.clone(), lose_answer.clone());
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let mut links = links.lock().unwrap();
                    if !*up.lock().unwrap() {
                        // Cut: the connection is accepted and dropped at once.
                        drop(inbound);
                        continue;
                    }
                    let lose_answer = lose_answer.clone();
                    let link = tokio::spawn(async move {
                        if let Ok(outbound) = TcpStream::connect(target).await {
                            let _ = inbound.set_nodelay(true);
                            let _ = outbound.set_nodelay(true);
                            relay(inbound, outbound, &lose_answer).await;
                        }
                    });
                    links.push(link.abort_handle());
                }
            }
        })
        .abort_handle();
        PeerProxy {
            addr,
            up,
            lose_answer,
            links,
            accept,
        }
    }

    /// Cut (drop every open connection, refuse new ones) or restore.
    fn set_up(&self, up: bool) {
        let mut links = self.links.lock().unwrap();
        *self.up.lock().unwrap() = up;
        if !up {
            for link in links.drain(..) {
                link.abort();
            }
        }
    }
}

/// Carry bytes both ways between a peer (`inbound`) and the node
/// (`outbound`) until either side closes; if `lose_answer` is set when the
/// node sends something back, drop it, clear the flag and close both.
async fn relay(mut inbound: TcpStream, mut outbound: TcpStream, lose_answer: &AtomicBool) {
    let (mut from_peer, mut to_peer) = inbound.split();
    let (mut from_node, mut to_node) = outbound.split();
    let requests = tokio::io::copy(&mut from_peer, &mut to_node);
    let answers = async {
        let mut buf = vec![0; 64 * 1024];
        loop {
            let n = match from_node.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if lose_answer.swap(false, Ordering::SeqCst) {
                return;
            }
            if to_peer.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = requests => {}
        () = answers => {}
    }
}

impl Drop for PeerProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.set_up(false);
    }
}

/// Since when (clock time) each node can reach the arbiter, so
/// [`Cluster::advance`] knows which nodes must have renewed.
struct Reach {
    arbiter_up_since: Option<Duration>,
    node_since: Vec<Option<Duration>>,
    held: HashSet<usize>,
}

/// A cluster of nodes sharing one arbiter and one stepped clock, with every
/// key life recorded.
pub struct Cluster {
    /// The clock every node and the arbiter read.
    pub clock: SteppedClock,
    /// The shared arbiter (cut nodes off it, take it down).
    pub arbiter: LocalArbiter,
    test_arbiter: Arc<TestArbiter>,
    /// `nodes[i]` is `n<i>`; `None` once crashed.
    pub nodes: Vec<Option<Arc<Instance>>>,
    /// Every key life on every node.
    pub lives: ownership_checker::LifeRecorder,
    proxies: Vec<PeerProxy>,
    reach: Mutex<Reach>,
}

impl Cluster {
    /// Start `n` nodes, `n0` first (so it leads and takes every partition),
    /// each with `modules` deployed before it joins.
    pub async fn start(n: usize, modules: &[(&str, &str)]) -> Cluster {
        Cluster::launch(n, &with_defaults(modules), false, None).await
    }

    /// As [`Cluster::start`], each module deployed with its own options.
    pub async fn start_with_options(n: usize, modules: &[(&str, &str, ModuleOptions)]) -> Cluster {
        Cluster::launch(n, modules, false, None).await
    }

    /// As [`Cluster::start`], node `i` using `stores[i]` for durable state
    /// (by default every node shares one in-memory store).
    pub async fn start_with_storage(
        modules: &[(&str, &str)],
        stores: Vec<Arc<dyn fief::storage::Backend>>,
    ) -> Cluster {
        Cluster::launch(stores.len(), &with_defaults(modules), false, Some(stores)).await
    }

    /// As [`Cluster::start`], with every node's peers reaching it through a
    /// [`PeerProxy`] that [`Cluster::set_peer_reachable`] can cut.
    pub async fn start_proxied(n: usize, modules: &[(&str, &str)]) -> Cluster {
        Cluster::launch(n, &with_defaults(modules), true, None).await
    }

    async fn launch(
        n: usize,
        modules: &[(&str, &str, ModuleOptions)],
        proxied: bool,
        stores: Option<Vec<Arc<dyn fief::storage::Backend>>>,
    ) -> Cluster {
        let clock = SteppedClock::default();
        let arbiter = LocalArbiter::new(
            Arc::new(clock.clone()),
            PartitionCount::new(PARTITIONS).unwrap(),
        );
        let mut listeners = Vec::new();
        let mut proxies = Vec::new();
        let mut peer_addrs = HashMap::new();
        for i in 0..n {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            if proxied {
                let proxy = PeerProxy::start(listener.local_addr().unwrap()).await;
                peer_addrs.insert(NodeId::new(format!("n{i}")), proxy.addr.to_string());
                proxies.push(proxy);
            }
            listeners.push(listener);
        }
        let test_arbiter = Arc::new(TestArbiter {
            local: arbiter.clone(),
            peer_addrs,
            held: watch::channel(HashSet::new()).0,
            refuse_transfer: Mutex::default(),
        });
        let lives = ownership_checker::LifeRecorder::default();
        // One store for every node, as one PostgreSQL database would be:
        // durable state follows its key from node to node.
        let shared: Arc<dyn fief::storage::Backend> =
            Arc::new(fief::storage::EmbeddedBackend::in_memory().expect("an in-memory store"));
        let stores = stores.unwrap_or_else(|| vec![shared; n]);
        let mut nodes = Vec::new();
        for (i, listener) in listeners.into_iter().enumerate() {
            let mut builder = Instance::builder(config(i))
                .arbiter(test_arbiter.clone())
                .storage(stores[i].clone())
                .clock(Arc::new(clock.clone()))
                .peer_listener(listener)
                .observer(lives.observer());
            for (name, path, options) in modules {
                builder = builder.module(name, guests::bytes(path), options.clone());
            }
            let node = builder.start().await.unwrap();
            assert_eq!(node.status().lease, LeaseState::Current, "n{i} joined");
            nodes.push(Some(Arc::new(node)));
        }
        Cluster {
            clock,
            arbiter,
            test_arbiter,
            nodes,
            lives,
            proxies,
            reach: Mutex::new(Reach {
                arbiter_up_since: Some(Duration::ZERO),
                node_since: vec![Some(Duration::ZERO); n],
                held: HashSet::new(),
            }),
        }
    }

    /// Node `n<i>`.
    pub fn node(&self, i: usize) -> &Instance {
        self.nodes[i].as_ref().expect("the node is running")
    }

    pub(crate) fn running(&self) -> impl Iterator<Item = (usize, &Instance)> {
        self.nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, &**n)))
    }

    /// The stepped clock's reading, as time since the cluster started.
    pub fn now(&self) -> Duration {
        self.clock.now().since_origin()
    }

    /// Step the clock by `total`, [`STEP`] at a time, letting every node
    /// react after each step (see the module docs).
    pub async fn advance(&self, total: Duration) {
        let mut left = total;
        while !left.is_zero() {
            let by = left.min(STEP);
            self.clock.advance(by);
            left -= by;
            self.settle().await;
        }
    }

    /// Step the clock until it reads `at` (since the cluster started).
    pub async fn advance_to(&self, at: Duration) {
        let now = self.now();
        assert!(at >= now, "the clock is at {now:?}, past {at:?}");
        self.advance(at - now).await;
    }

    /// Wait until every node has reacted to the clock's current reading.
    async fn settle(&self) {
        let deadline = tokio::time::Instant::now() + REACT;
        tokio::time::sleep(Duration::from_millis(2)).await;
        while let Some(lag) = self.lagging() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "at clock {:?}, a node did not react within {REACT:?}: {lag}",
                self.now()
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// A node that has not yet reacted to the current clock reading, if any.
    fn lagging(&self) -> Option<String> {
        let now = self.now();
        for (i, node) in self.running() {
            let status = node.status();
            if status.lease != LeaseState::Current {
                if !node.keys().is_empty() {
                    return Some(format!(
                        "n{i} is {:?} but still has live keys: {:?}",
                        status.lease,
                        node.keys()
                    ));
                }
            } else if self.reachable_for(i, now) >= RENEW && status.lease_remaining_ms <= 3000 {
                return Some(format!(
                    "n{i} reaches the arbiter but did not renew when due ({} ms left to its fence point)",
                    status.lease_remaining_ms
                ));
            }
        }
        None
    }

    /// For how long (clock time) node `i` has been able to reach the
    /// arbiter; zero if it cannot, or if its arbiter calls are held.
    fn reachable_for(&self, i: usize, now: Duration) -> Duration {
        let reach = self.reach.lock().unwrap();
        if reach.held.contains(&i) {
            return Duration::ZERO;
        }
        match (reach.arbiter_up_since, reach.node_since[i]) {
            (Some(a), Some(n)) => now.saturating_sub(a.max(n)),
            _ => Duration::ZERO,
        }
    }

    /// Let the cluster settle: step the clock a renewal round at a time
    /// until the arbiter's table has not changed for a whole round and every
    /// current node knows it (the leader's graceful moves run in real time
    /// between rounds). Leaves the clock on a whole second, just after every
    /// reachable node renewed.
    pub async fn stabilize(&self) {
        let mut last = None;
        for _ in 0..30 {
            self.advance(RENEW).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let epoch = self.arbiter_table().await.epoch();
            let known = self.running().all(|(_, node)| {
                let status = node.status();
                status.lease != LeaseState::Current || status.epoch == epoch
            });
            if known && last == Some(epoch) {
                return;
            }
            last = Some(epoch);
        }
        panic!("the partition table did not settle within 30 renewal rounds");
    }

    /// Cut node `i` off the arbiter, or reconnect it (contract §5 row 2).
    pub fn set_arbiter_reachable(&self, i: usize, reachable: bool) {
        let now = self.now();
        self.reach.lock().unwrap().node_since[i] = reachable.then_some(now);
        self.arbiter
            .set_reachable(&NodeId::new(format!("n{i}")), reachable);
    }

    /// Take the arbiter down for everyone, or bring it back (row 4).
    pub fn set_arbiter_down(&self, down: bool) {
        let now = self.now();
        self.reach.lock().unwrap().arbiter_up_since = (!down).then_some(now);
        self.arbiter.set_down(down);
    }

    /// Cut every peer off node `i` at the network level, or restore its
    /// links (row 3). Only in a [`Cluster::start_proxied`] cluster.
    pub fn set_peer_reachable(&self, i: usize, reachable: bool) {
        self.proxies[i].set_up(reachable);
    }

    /// Lose the next answer node `i` sends to a peer: the proxy drops it and
    /// closes that connection, after the node processed the request. Only in
    /// a [`Cluster::start_proxied`] cluster.
    pub fn lose_next_answer_from(&self, i: usize) {
        self.proxies[i].lose_answer.store(true, Ordering::SeqCst);
    }

    /// Make the arbiter hold (or release) node `i`'s `campaign` calls: the
    /// node's table sync stalls there, as behind a slow arbiter. Do not
    /// advance the clock while a node is held.
    pub fn hold_campaign(&self, i: usize, hold: bool) {
        let node = NodeId::new(format!("n{i}"));
        let mut reach = self.reach.lock().unwrap();
        self.test_arbiter.held.send_modify(|held| {
            if hold {
                held.insert(node);
                reach.held.insert(i);
            } else {
                held.remove(&node);
                reach.held.remove(&i);
            }
        });
    }

    /// Refuse node `i`'s next `transfer` at the arbiter without committing
    /// it (as if it never arrived): its move fails after the handoff.
    pub fn refuse_next_transfer(&self, i: usize) {
        let node = NodeId::new(format!("n{i}"));
        self.test_arbiter
            .refuse_transfer
            .lock()
            .unwrap()
            .insert(node);
    }

    /// Whether the refusal [`Cluster::refuse_next_transfer`] armed for node
    /// `i` was used.
    pub fn transfer_refused(&self, i: usize) -> bool {
        let node = NodeId::new(format!("n{i}"));
        !self
            .test_arbiter
            .refuse_transfer
            .lock()
            .unwrap()
            .contains(&node)
    }

    /// Crash node `i` (its process dies: no key stops gracefully, its lease
    /// is not released).
    pub async fn crash(&mut self, i: usize) {
        let node = self.nodes[i].take().expect("the node is running");
        Arc::into_inner(node)
            .expect("nothing else holds a node that crashes (no HTTP server of it)")
            .crash()
            .await;
    }

    /// Serve node `i`'s HTTP API (WebSocket connections included) on a
    /// loopback port, until the server is dropped.
    pub async fn serve_http(&self, i: usize) -> fief_tests::HttpServer {
        let node = self.nodes[i].clone().expect("the node is running");
        fief_tests::HttpServer::start(node).await
    }

    /// When the arbiter will judge node `i`'s lease expired, assuming its
    /// last renewal committed at the instant it was sent (true here: the
    /// local arbiter commits at once, on the same clock).
    pub fn arbiter_expiry(&self, i: usize) -> Duration {
        let status = self.node(i).status();
        assert_eq!(status.lease, LeaseState::Current, "n{i} holds a lease");
        self.now() + Duration::from_millis(status.lease_remaining_ms as u64) + MARGIN
    }

    /// The arbiter's partition table.
    pub async fn arbiter_table(&self) -> OwnershipTable {
        self.arbiter
            .table(NAMESPACE)
            .await
            .expect("the arbiter is up")
    }

    /// The arbiter's table: partitions owned per node.
    pub async fn arbiter_owners(&self) -> BTreeMap<String, usize> {
        let mut owners = BTreeMap::new();
        for (_, owner) in self.arbiter_table().await.iter() {
            if let Some(owner) = owner {
                *owners.entry(owner.node.to_string()).or_default() += 1;
            }
        }
        owners
    }

    /// A key whose partition node `n<i>` owns, per the arbiter.
    pub async fn key_owned_by(&self, i: usize) -> String {
        self.key_owned_by_except(i, &[]).await
    }

    /// A key whose partition node `n<i>` owns, per the arbiter, other than
    /// those in `except`.
    pub async fn key_owned_by_except(&self, i: usize, except: &[&str]) -> String {
        let partitions = PartitionCount::new(PARTITIONS).unwrap();
        let table = self.arbiter_table().await;
        let owner = NodeId::new(format!("n{i}"));
        (0..1000)
            .map(|k| format!("key-{k}"))
            .find(|key| {
                !except.contains(&key.as_str())
                    && table
                        .owner(partitions.of(key))
                        .is_some_and(|a| a.node == owner)
            })
            .unwrap_or_else(|| panic!("n{i} owns no partition"))
    }

    /// The nodes whose leases the arbiter judges current.
    pub async fn arbiter_live(&self) -> Vec<String> {
        let members = self
            .arbiter
            .live_nodes(NAMESPACE)
            .await
            .expect("the arbiter is up");
        members.into_iter().map(|m| m.node.to_string()).collect()
    }

    /// Partitions owned per running node, per each node's own table.
    pub fn owned(&self) -> Vec<usize> {
        self.running()
            .map(|(_, node)| node.status().partitions_owned)
            .collect()
    }

    /// Call `key` of the counter module via node `i`.
    pub async fn call(&self, i: usize, key: &str, message: &str) -> Result<String, Error> {
        self.node(i)
            .call("counter", key, message.as_bytes().to_vec())
            .await
            .map(|reply| String::from_utf8(reply).expect("a UTF-8 reply"))
    }

    /// The running nodes with a live process for `key` of the counter.
    pub fn live_on(&self, key: &str) -> Vec<usize> {
        self.running()
            .filter(|(_, node)| fief_tests::is_live(node, "counter", key))
            .map(|(i, _)| i)
            .collect()
    }

    /// The single-ownership checks, run at the end of every test: at most
    /// one node reports a live process per key right now, and no two
    /// recorded lives of one key ever overlapped (guarantees 1 and 2).
    pub fn check(&self) -> Summary {
        let mut live: BTreeMap<(String, String), Vec<usize>> = BTreeMap::new();
        for (i, node) in self.running() {
            for key in node.keys() {
                live.entry((key.module, key.key)).or_default().push(i);
            }
        }
        for ((module, key), nodes) in &live {
            assert!(
                nodes.len() <= 1,
                "{module}/{key} is live on several nodes at once: {nodes:?}"
            );
        }
        assert_single_ownership(&self.lives.events())
    }
}
