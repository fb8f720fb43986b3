//! The `outage` rows of the arbiters bench (the module header of
//! `arbiters.rs` says what they measure): one node renewing every 400 ms
//! while its arbiter's server goes away (etcd's raft leader killed, the
//! PostgreSQL server restarted), the node's lease calls watched through
//! [`Watched`], its fences through its event observer.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fief::arbiter::{
    Arbiter, ArbiterError, ArbiterFuture, Bytes, LeaseId, Member, ModuleVersionRecord,
    NewModuleVersion, PostgresArbiter, StoredModule, Term,
};
use fief::core::{NodeId, OwnershipTable, PartitionId};
use fief::event_log::{NodeEvent, NodeEventKind};
use fief::{Instance, LeaseState};
use fief_tests::etcd::EtcdCluster;
use fief_tests::scratch_postgres::ScratchPostgres;

use crate::common::{self, Mode, fmt_duration};
use crate::{
    FENCE_MARGIN, Fences, GIVE_UP, Kind, RENEW_INTERVAL, Row, Servers, TTL, fenced_of, log_fences,
    node_config, partitions, range,
};

/// One lease call (a grant or a renewal) the node made, as it ended.
struct LeaseCall {
    sent: Instant,
    done: Instant,
    /// The arbiter answered (granted, renewed, or refused): it was reachable.
    answered: bool,
    /// It granted or renewed.
    ok: bool,
    /// What it answered, in a few words.
    answer: String,
}

/// An arbiter whose lease calls (grants, renewals) are logged as they end,
/// so an outage's end is seen as the node sees it.
struct Watched {
    inner: Arc<dyn Arbiter>,
    calls: Mutex<Vec<LeaseCall>>,
    ended: tokio::sync::Notify,
}

impl Watched {
    fn new(inner: Arc<dyn Arbiter>) -> Arc<Watched> {
        Arc::new(Watched {
            inner,
            calls: Mutex::new(Vec::new()),
            ended: tokio::sync::Notify::new(),
        })
    }

    fn log<T>(&self, what: &str, sent: Instant, outcome: &Result<T, ArbiterError>) {
        let answered = !matches!(outcome, Err(ArbiterError::Unreachable(_)));
        let answer = match outcome {
            Ok(_) => format!("{what}: ok"),
            Err(e) => format!(
                "{what}: {}",
                e.to_string().chars().take(100).collect::<String>()
            ),
        };
        self.calls.lock().unwrap().push(LeaseCall {
            sent,
            done: Instant::now(),
            answered,
            ok: outcome.is_ok(),
            answer,
        });
        self.ended.notify_waiters();
    }

    /// When the first lease call sent after `after` that `counts` ended;
    /// `None` after `limit`.
    async fn first_after(
        &self,
        after: Instant,
        limit: Duration,
        counts: impl Fn(&LeaseCall) -> bool,
    ) -> Option<(Instant, String)> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            let found = self
                .calls
                .lock()
                .unwrap()
                .iter()
                .filter(|c| c.sent > after && counts(c))
                .min_by_key(|c| c.done)
                .map(|c| (c.done, c.answer.clone()));
            if found.is_some() {
                return found;
            }
            if tokio::time::timeout_at(deadline, ended).await.is_err() {
                return None;
            }
        }
    }
}

impl Arbiter for Watched {
    fn register<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        ttl: Duration,
        peer_addr: Option<&'a str>,
    ) -> ArbiterFuture<'a, LeaseId> {
        Box::pin(async move {
            let sent = Instant::now();
            let outcome = self.inner.register(namespace, node, ttl, peer_addr).await;
            self.log("register", sent, &outcome);
            outcome
        })
    }

    fn renew<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, u64> {
        Box::pin(async move {
            let sent = Instant::now();
            let outcome = self.inner.renew(namespace, node, lease).await;
            self.log("renew", sent, &outcome);
            outcome
        })
    }

    fn release<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        self.inner.release(namespace, node, lease)
    }

    fn set_leaving<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, ()> {
        self.inner.set_leaving(namespace, node, lease)
    }

    fn live_nodes<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<Member>> {
        self.inner.live_nodes(namespace)
    }

    fn campaign<'a>(
        &'a self,
        namespace: &'a str,
        node: &'a NodeId,
        lease: LeaseId,
    ) -> ArbiterFuture<'a, Option<Term>> {
        self.inner.campaign(namespace, node, lease)
    }

    fn table<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, OwnershipTable> {
        self.inner.table(namespace)
    }

    fn transfer<'a>(
        &'a self,
        namespace: &'a str,
        from: &'a NodeId,
        lease: LeaseId,
        moves: Vec<(PartitionId, NodeId)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        self.inner.transfer(namespace, from, lease, moves)
    }

    fn write_table<'a>(
        &'a self,
        namespace: &'a str,
        term: Term,
        changes: Vec<(PartitionId, Option<NodeId>)>,
    ) -> ArbiterFuture<'a, OwnershipTable> {
        self.inner.write_table(namespace, term, changes)
    }

    fn put_module<'a>(
        &'a self,
        namespace: &'a str,
        module: NewModuleVersion,
    ) -> ArbiterFuture<'a, ModuleVersionRecord> {
        self.inner.put_module(namespace, module)
    }

    fn modules<'a>(&'a self, namespace: &'a str) -> ArbiterFuture<'a, Vec<StoredModule>> {
        self.inner.modules(namespace)
    }

    fn module_bytes<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, Option<Bytes>> {
        self.inner.module_bytes(namespace, name, version)
    }

    fn set_current_module<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
        version: u64,
    ) -> ArbiterFuture<'a, StoredModule> {
        self.inner.set_current_module(namespace, name, version)
    }

    fn remove_module<'a>(&'a self, namespace: &'a str, name: &'a str) -> ArbiterFuture<'a, bool> {
        self.inner.remove_module(namespace, name)
    }
}

/// What the node of the outages reported: its fences, and when it was
/// granted a lease (from its event observer).
#[derive(Default)]
struct NodeLog {
    fences: Fences,
    grants: Arc<Mutex<Vec<Instant>>>,
}

/// One node on `arbiter`, its fences and lease grants logged.
async fn watched_node(arbiter: Arc<Watched>, ns: &str) -> (Instance, NodeLog) {
    let log = NodeLog::default();
    let fences = log_fences(&log.fences, 0);
    let grants = log.grants.clone();
    let node = Instance::builder(node_config(ns, 0))
        .arbiter(arbiter)
        .events(Arc::new(move |event: NodeEvent| {
            if let NodeEventKind::LeaseGranted { .. } = event.kind {
                grants.lock().unwrap().push(event.at);
            }
            fences(event);
        }))
        .start()
        .await
        .expect("starting the node");
    (node, log)
}

/// Wait until `node` has held a current lease for a while (after a fence,
/// it rejoins).
async fn settle(node: &Instance) {
    let deadline = Instant::now() + GIVE_UP;
    let mut current_since = None;
    loop {
        if node.status().lease == LeaseState::Current {
            let since = *current_since.get_or_insert_with(Instant::now);
            if since.elapsed() >= TTL {
                return;
            }
        } else {
            current_since = None;
        }
        assert!(Instant::now() < deadline, "the node never settled");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the outages of one arbiter gave, each from the outage's start.
#[derive(Default)]
struct Outages {
    /// → the first lease call sent after it answered (renewed, granted or
    /// refused): the arbiter serves the node again.
    answered: Vec<Duration>,
    /// → the first lease call sent after it that renewed or granted: the
    /// node's lease current again (after a fence, a new lease).
    current: Vec<Duration>,
    /// → the server back (etcd: a new leader reported; PostgreSQL: the
    /// server accepting connections again).
    back: Vec<Duration>,
    /// Why the node fenced, once per outage it fenced in.
    fenced: Vec<String>,
    /// Outages after which the node's lease was not current within
    /// [`GIVE_UP`].
    lost: usize,
}

impl Outages {
    /// Wait for the node to be served again after an outage that began at
    /// `t0`, counting only lease calls sent after `sent_after` (one in
    /// flight at the outage's start may have been answered before it), and
    /// record it. Returns a description.
    async fn record(
        &mut self,
        arbiter: &Watched,
        log: &NodeLog,
        fences_before: usize,
        t0: Instant,
        sent_after: Instant,
    ) -> String {
        let answered = arbiter
            .first_after(sent_after, GIVE_UP, |c| c.answered)
            .await;
        let renewed = arbiter.first_after(sent_after, GIVE_UP, |c| c.ok).await;
        // The node fences at its fence point, within TTL − margin of the
        // outage's start: by TTL after it, it has if it will.
        tokio::time::sleep((t0 + TTL).saturating_duration_since(Instant::now())).await;
        let fenced = log.fences.lock().unwrap()[fences_before..]
            .first()
            .map(|(_, cause)| cause.clone());
        // A fenced node is current again only with a new lease (a late
        // renewal of the old one does not count).
        let current = match &fenced {
            None => renewed,
            Some(_) => {
                let deadline = t0 + GIVE_UP;
                loop {
                    let granted = log
                        .grants
                        .lock()
                        .unwrap()
                        .iter()
                        .find(|at| **at > t0)
                        .copied();
                    if let Some(at) = granted {
                        break Some((at, "a new lease granted".to_owned()));
                    }
                    if Instant::now() > deadline {
                        break None;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        };
        self.answered
            .extend(answered.as_ref().map(|(at, _)| *at - t0));
        match &current {
            Some((at, _)) => self.current.push(*at - t0),
            None => self.lost += 1,
        }
        self.fenced.extend(fenced.clone());
        let fenced = fenced.unwrap_or_else(|| "no".to_owned());
        let show = |call: &Option<(Instant, String)>| match call {
            Some((at, answer)) => format!("{} ({answer})", fmt_duration(*at - t0)),
            None => "never".to_owned(),
        };
        format!(
            "answered again after {}, lease current after {}, fenced: {fenced}",
            show(&answered),
            show(&current)
        )
    }

    /// Cells of the four rows: answered, current, back, fenced.
    fn cells(mut self, n: usize) -> [String; 4] {
        let mut current = range(&mut self.current);
        if self.lost > 0 {
            current += &format!(" (**{} never within {GIVE_UP:?}**)", self.lost);
        }
        [
            range(&mut self.answered),
            current,
            range(&mut self.back),
            fenced_of(&self.fenced, n),
        ]
    }
}

/// Member `endpoint`'s id and the raft leader's id as it knows it ("0":
/// none), asked with a short timeout and a fresh connection (so a poll
/// never waits behind a slow one).
async fn member_status(endpoint: &str) -> Option<(String, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(endpoint).await.ok()?;
        let request = format!(
            "POST /v3/maintenance/status HTTP/1.1\r\nHost: {endpoint}\r\n\
             Content-Type: application/json\r\nContent-Length: 2\r\n\
             Connection: close\r\n\r\n{{}}"
        );
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.ok()?;
        let field = |name: &str| {
            let rest = answer.split(&format!("\"{name}\":\"")).nth(1)?;
            Some(rest.split('"').next()?.to_owned())
        };
        Some((
            field("member_id")?,
            field("leader").unwrap_or_else(|| "0".to_owned()),
        ))
    };
    tokio::time::timeout(Duration::from_millis(200), ask)
        .await
        .ok()
        .flatten()
}

/// Poll the members other than `killed` (every 10 ms) until one reports a
/// leader other than `killed_id`; the time since `t0`.
async fn new_leader(
    cluster: &EtcdCluster,
    killed: usize,
    killed_id: &str,
    t0: Instant,
) -> Option<Duration> {
    let others: Vec<String> = (0..cluster.len())
        .filter(|i| *i != killed)
        .map(|i| cluster.endpoint(i))
        .collect();
    while t0.elapsed() < GIVE_UP {
        for endpoint in &others {
            if let Some((_, leader)) = member_status(endpoint).await
                && leader != "0"
                && leader != killed_id
            {
                return Some(t0.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Kill etcd's raft leader `kills` times (restarting it between) while a
/// node renews.
async fn etcd_kills(servers: &mut Servers, kills: usize) -> Outages {
    let ns = servers.namespace("kill");
    let local = servers.local();
    let arbiter = Watched::new(servers.connect(Kind::Etcd, &ns, &local).await);
    let (node, log) = watched_node(arbiter.clone(), &ns).await;
    let cluster = servers.etcd.as_mut().expect("etcd is there");
    let mut out = Outages::default();
    for k in 0..kills {
        settle(&node).await;
        // Each kill at another point of the renewal cycle.
        tokio::time::sleep(RENEW_INTERVAL * k as u32 / kills as u32).await;
        let leader = cluster.leader().await.expect("a leader");
        let (leader_id, _) = member_status(&cluster.endpoint(leader))
            .await
            .expect("the leader's status");
        let fences_before = log.fences.lock().unwrap().len();
        let t0 = Instant::now();
        cluster.kill(leader);
        let (elected, what) = tokio::join!(
            new_leader(cluster, leader, &leader_id, t0),
            out.record(&arbiter, &log, fences_before, t0, t0)
        );
        out.back.extend(elected);
        println!(
            "    kill {k} (m{leader}): new leader after {}, {what}",
            elected.map_or("never".to_owned(), fmt_duration),
        );
        cluster.restart(leader).await;
    }
    node.shutdown().await;
    out
}

/// Restart a throwaway PostgreSQL server `restarts` times while a node
/// renews against it.
async fn postgres_restarts(servers: &Servers, restarts: usize) -> Result<Outages, String> {
    let pg = tokio::task::spawn_blocking(ScratchPostgres::start)
        .await
        .map_err(|e| format!("no throwaway PostgreSQL server: {e}"))?;
    let pg = Arc::new(pg);
    let url = ScratchPostgres::url_via(&pg.addr());
    let ns = servers.namespace("restart");
    let arbiter = PostgresArbiter::connect(&url, &ns, partitions())
        .await
        .map_err(|e| format!("connecting to the throwaway server: {e}"))?;
    let arbiter = Watched::new(Arc::new(arbiter));
    let (node, log) = watched_node(arbiter.clone(), &ns).await;
    let mut out = Outages::default();
    for k in 0..restarts {
        settle(&node).await;
        // Each restart at another point of the renewal cycle.
        tokio::time::sleep(RENEW_INTERVAL * k as u32 / restarts as u32).await;
        let fences_before = log.fences.lock().unwrap().len();
        let t0 = Instant::now();
        let (stop, start) = (pg.clone(), pg.clone());
        tokio::task::spawn_blocking(move || stop.stop())
            .await
            .expect("stopping the server");
        let stopped = Instant::now();
        let started = tokio::task::spawn_blocking(move || start.start_again());
        // `pg_ctl start -w` polls, and returns a while after the server
        // accepts connections: poll for that ourselves.
        let back = loop {
            if common::pg_connect(&url).await.is_ok() {
                break t0.elapsed();
            }
            assert!(t0.elapsed() < GIVE_UP, "the server never came back");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        started.await.expect("starting the server");
        out.back.push(back);
        // A renewal sent before the server was down may have committed.
        let what = out.record(&arbiter, &log, fences_before, t0, stopped).await;
        println!(
            "    restart {k}: accepting again after {} (the stop took {}), {what}",
            fmt_duration(back),
            fmt_duration(stopped - t0),
        );
    }
    node.shutdown().await;
    drop(arbiter);
    tokio::task::spawn_blocking(move || drop(pg))
        .await
        .expect("removing the server");
    Ok(out)
}

pub(crate) async fn outage(mode: Mode, servers: &mut Servers, rows: &mut Vec<Row>) {
    let n = mode.pick(6, 2, 1);
    let skipped = |why: &str| [(); 4].map(|()| format!("skipped: {why}"));
    let postgres = match postgres_restarts(servers, n).await {
        Ok(out) => out.cells(n),
        Err(why) => skipped(&why),
    };
    let etcd = match servers.missing(Kind::Etcd) {
        Some(why) => skipped(&why),
        None => etcd_kills(servers, n).await.cells(n),
    };
    let figures = [
        format!(
            "arbiter outage (PostgreSQL: the server restarted; etcd: its raft leader SIGKILLed) → the node's lease calls answered again, min / median / max of {n}"
        ),
        "… → the node's lease current again (renewed, or after a fence a new lease granted)"
            .to_owned(),
        "… → the server back: PostgreSQL accepting connections (polled every 5 ms); etcd: a surviving member reports a new leader (polled every 10 ms)"
            .to_owned(),
        "… the node fenced".to_owned(),
    ];
    let bounds = [
        format!(
            "the node fences {} ms after its last renewal went out",
            (TTL - FENCE_MARGIN).as_millis()
        ),
        "a fenced node rejoins once the arbiter has expired its old lease".to_owned(),
        "etcd's election timeout: 1 s (default; randomized to 1–2 s)".to_owned(),
        "—".to_owned(),
    ];
    let none = "n/a: in-process, no server or leader to lose";
    for (i, (figure, bound)) in figures.into_iter().zip(bounds).enumerate() {
        rows.push(Row {
            figure,
            cells: [
                if i == 0 {
                    none.to_owned()
                } else {
                    "—".to_owned()
                },
                postgres[i].clone(),
                etcd[i].clone(),
            ],
            bound,
        });
    }
}
