//! Failure tests with real processes (contract §5): several `fief node`
//! children share one namespace in PostgreSQL (the production arbiter, whose
//! clock judges every lease), and the tests kill them with SIGKILL, cut
//! them off from PostgreSQL with a TCP proxy that stops forwarding, pause
//! them (SIGSTOP, SIGCONT), or make them leave (`fief leave`, SIGTERM).
//!
//! Timings are short but valid (`FAST_TIMINGS`): TTL 2 s, renewal every
//! 400 ms, fence margin 500 ms, so a node fences 1.5 s after sending the last
//! renewal that succeeded, and the arbiter expires it 2 s after committing
//! that renewal.
//!
//! Time judgments are made on the database's clock, in the same SQL
//! statement that reads the table: a statement's snapshot is taken before
//! its `clock_timestamp()` is evaluated, so one row saying both "the
//! partition has moved" and "the old owner's lease is current" proves a move
//! before expiry.
//!
//! The tests run one at a time (they start up to three nodes each, and a
//! starved node misses renewals), and each uses its own namespace, so runs
//! may overlap. PostgreSQL must run on 127.0.0.1:5432 (user `postgres`, trust
//! auth); without it the tests fail, they do not skip. Node logs are under
//! `target/test-logs/process-logs/`; a failing test prints their paths and
//! tails. Calls that set a test up retry the refusals the API documents as
//! "retry" (`ClusterNode::call_settled`); the calls under test do not.
//!
//! This module holds the harness the process tests share (`SERIAL`,
//! [`start_nodes`], [`wait_settled`], the arbiter readings) and the
//! baseline, crash and leader tests; the fence tests (a node cut off from
//! PostgreSQL, a paused node) are in `processes_fence.rs`, the graceful
//! leave and the rolling restart in `processes_leave.rs`.

use std::time::{Duration, Instant};

use fief_tests::guests;
use fief_tests::multiprocess::{
    CallError, ClusterNode, FAST_TIMINGS, NodeSpec, PG_ADDR, PgProxy, arbiter_url, drop_namespace,
    test_database, unique_namespace,
};

/// The partition of key `alice` (FNV-1a-64 % 1024: the test vector in
/// `host/core/src/partition.rs`).
const ALICE_PARTITION: i32 = 263;
/// Partitions per namespace (the default).
const PARTITIONS: u64 = 1024;
/// The lease TTL of `FAST_TIMINGS`.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(2);
/// How long a node may take to start (the binary's build aside).
pub(crate) const START_LIMIT: Duration = Duration::from_secs(30);
/// How long a single call in a polling loop may take: a call either answers
/// at once or is a failure.
pub(crate) const POLL_CALL: Duration = Duration::from_secs(2);

/// One process test at a time (`chaos.rs` takes it too).
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

pub(crate) fn spec(namespace: &str, node_id: &str, arbiter: String) -> NodeSpec {
    NodeSpec {
        node_id: node_id.to_owned(),
        namespace: namespace.to_owned(),
        arbiter,
        deploy: vec![("counter".to_owned(), guests::COUNTER.to_owned())],
        extra_args: FAST_TIMINGS.iter().map(|s| (*s).to_owned()).collect(),
    }
}

/// Start one node per arbiter URL, one after the other (the first leads and
/// takes every partition; later ones get theirs by rebalancing), and wait
/// until they agree on the table.
pub(crate) async fn start_cluster(namespace: &str, arbiters: &[String]) -> Vec<ClusterNode> {
    let mut nodes = Vec::new();
    for (i, arbiter) in arbiters.iter().enumerate() {
        let mut node =
            ClusterNode::spawn(&spec(namespace, &format!("n{}", i + 1), arbiter.clone())).await;
        node.wait_current(START_LIMIT).await;
        nodes.push(node);
    }
    wait_settled(&nodes).await;
    nodes
}

/// Wait until every node's lease is current and all report the same table
/// epoch, together owning every partition, unchanged for three renewal
/// intervals (so no table change is in flight).
pub(crate) async fn wait_settled(nodes: &[ClusterNode]) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut stable: Option<(u64, Instant)> = None;
    loop {
        let mut statuses = Vec::new();
        for node in nodes {
            statuses.push(node.status().await.unwrap_or_default());
        }
        let epochs: Vec<u64> = statuses
            .iter()
            .map(|s| s["epoch"].as_u64().unwrap_or(0))
            .collect();
        let owned: u64 = statuses
            .iter()
            .map(|s| s["partitions_owned"].as_u64().unwrap_or(0))
            .sum();
        // No partition is held back by a move in progress: the table alone
        // does not show a move that has begun draining.
        let agreed = statuses
            .iter()
            .all(|s| s["lease"] == "current" && s["partitions_moving"] == 0)
            && epochs[0] > 0
            && epochs.iter().all(|e| *e == epochs[0])
            && owned == PARTITIONS;
        match stable {
            Some((epoch, since)) if agreed && epoch == epochs[0] => {
                if since.elapsed() >= Duration::from_millis(1200) {
                    return;
                }
            }
            _ if agreed => stable = Some((epochs[0], Instant::now())),
            _ => stable = None,
        }
        assert!(
            Instant::now() < deadline,
            "the cluster did not settle on one table within 20 s: {statuses:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One reading of the arbiter, in one statement, on the database's clock.
#[derive(Debug)]
pub(crate) struct Observation {
    /// The database's clock, ms since the Unix epoch.
    pub(crate) db_now_ms: i64,
    /// The owner of `alice`'s partition.
    pub(crate) owner: Option<String>,
    /// When the watched node's lease expires, ms since the Unix epoch.
    pub(crate) expires_at_ms: i64,
    /// Whether the watched node's lease is current on the database's clock
    /// (evaluated after the statement's snapshot, so after `owner` was read).
    pub(crate) lease_current: bool,
}

/// Read the owner of `alice`'s partition and `node`'s lease.
pub(crate) async fn observe(
    db: &tokio_postgres::Client,
    namespace: &str,
    node: &str,
) -> Observation {
    let row = db
        .query_one(
            "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint,
                    (SELECT p.node_id FROM fief_partitions p
                      WHERE p.namespace = $1 AND p.partition = $3),
                    (extract(epoch FROM l.expires_at) * 1000)::bigint,
                    l.expires_at > clock_timestamp()
               FROM fief_leases l WHERE l.namespace = $1 AND l.node_id = $2",
            &[&namespace, &node, &ALICE_PARTITION],
        )
        .await
        .unwrap_or_else(|e| panic!("reading the arbiter's tables for {namespace}/{node}: {e:?}"));
    Observation {
        db_now_ms: row.get(0),
        owner: row.get(1),
        expires_at_ms: row.get(2),
        lease_current: row.get(3),
    }
}

/// The owner of `alice`'s partition per the arbiter.
pub(crate) async fn alice_owner(db: &tokio_postgres::Client, namespace: &str) -> String {
    db.query_one(
        "SELECT node_id FROM fief_partitions WHERE namespace = $1 AND partition = $2",
        &[&namespace, &ALICE_PARTITION],
    )
    .await
    .expect("reading fief_partitions")
    .get::<_, Option<String>>(0)
    .expect("alice's partition has an owner")
}

/// The table may show `alice`'s partition away from `old` only once `old`'s
/// lease has expired on the arbiter's clock (guarantee 3).
pub(crate) fn assert_no_move_before_expiry(seen: &Observation, old: &str) {
    if seen.owner.as_deref() != Some(old) {
        assert!(
            !seen.lease_current,
            "partition {ALICE_PARTITION} moved from {old} to {:?} while {old}'s lease was still \
             current on the database's clock (now {} ms, expires {} ms)",
            seen.owner, seen.db_now_ms, seen.expires_at_ms
        );
    }
}

/// Call `alice` with `incr` through `via` (round-robin) until a call
/// succeeds, at most `limit` after `since`. Every reading of the arbiter
/// along the way must show no move of `alice`'s partition away from `old`
/// before `old`'s lease expired, and a success must come after that expiry.
/// Returns the reply and the failures seen while `old`'s lease was current.
pub(crate) async fn incr_until_taken_over(
    db: &tokio_postgres::Client,
    namespace: &str,
    old: &str,
    via: &[&ClusterNode],
    since: Instant,
    limit: Duration,
) -> (String, Vec<CallError>) {
    let mut failures_before_expiry = Vec::new();
    let mut attempt = 0;
    loop {
        assert!(
            since.elapsed() < limit,
            "no other node served alice within {limit:?} of losing {old}; {} calls failed before \
             expiry; last reading {:?}",
            failures_before_expiry.len(),
            observe(db, namespace, old).await
        );
        let node = via[attempt % via.len()];
        attempt += 1;
        let before = observe(db, namespace, old).await;
        assert_no_move_before_expiry(&before, old);
        let result = node
            .call_within("counter", "alice", "incr", POLL_CALL)
            .await;
        let after = observe(db, namespace, old).await;
        assert_no_move_before_expiry(&after, old);
        match result {
            Ok(reply) => {
                // The reply was complete before `after` was read: had the
                // lease still been current then, alice was served before the
                // arbiter let anyone take over.
                assert!(
                    !after.lease_current,
                    "a call via {} for alice succeeded ({reply:?}) before {old}'s lease expired \
                     on the database's clock (now {} ms, expires {} ms)",
                    node.node_id, after.db_now_ms, after.expires_at_ms
                );
                return (reply, failures_before_expiry);
            }
            Err(e) if before.lease_current => failures_before_expiry.push(e),
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Call `alice` with `incr` through `via` until it succeeds (at most 10 s;
/// brief errors are allowed while tables propagate) and return the reply.
pub(crate) async fn incr_eventually(via: &ClusterNode) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match via.call_within("counter", "alice", "incr", POLL_CALL).await {
            Ok(reply) => return reply,
            Err(e) => assert!(
                Instant::now() < deadline,
                "calls via {} kept failing for 10 s: {e:?}",
                via.node_id
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub(crate) async fn live_keys(node: &ClusterNode) -> u64 {
    node.status()
        .await
        .unwrap_or_else(|| panic!("{} does not answer GET /v1/status", node.node_id))["live_keys"]
        .as_u64()
        .expect("live_keys is a number")
}

/// Guarantee 2 (routing single ownership), the baseline of §5 rows 1–3: a
/// key is served by one owner whichever node a call enters through, so 30
/// `incr` calls round-robin over 3 nodes see one counter counting 1..30, and
/// only the owner holds the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_through_every_node_reach_one_owner() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("reach-one-owner");
    let nodes = start_cluster(&namespace, &vec![arbiter_url(PG_ADDR); 3]).await;

    for i in 1..=30 {
        let node = &nodes[(i - 1) % nodes.len()];
        let reply = node
            .call_settled("counter", "alice", "incr")
            .await
            .unwrap_or_else(|e| panic!("incr #{i} via {} failed: {e:?}", node.node_id));
        assert_eq!(reply, i.to_string(), "incr #{i} via {}", node.node_id);
    }

    let owner = alice_owner(&db, &namespace).await;
    for node in &nodes {
        assert_eq!(
            live_keys(node).await,
            u64::from(node.node_id == owner),
            "live keys on {} (alice's owner is {owner})",
            node.node_id
        );
    }
    drop(nodes);
    drop_namespace(&db, &namespace).await;
}

/// §5 row 1 (node crash): after `kill -9` of the owner, its partitions move
/// only after the arbiter judges its lease expired, on the database's clock;
/// until then every call for its keys fails; then the key comes back on
/// another node (a fresh process: the counter restarts at 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_owner_keys_move_only_after_expiry() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("kill-9-owner");
    let mut nodes = start_cluster(&namespace, &vec![arbiter_url(PG_ADDR); 3]).await;

    // Refusals (a late move of alice's partition on a loaded machine) are
    // retried; a refused incr was never delivered, so the count is exact.
    for expected in ["1", "2", "3"] {
        assert_eq!(incr_eventually(&nodes[1]).await, expected);
    }
    let owner_id = alice_owner(&db, &namespace).await;
    let victim = nodes
        .iter()
        .position(|n| n.node_id == owner_id)
        .expect("the owner is one of ours");
    nodes[victim].kill9();
    let killed_at = Instant::now();
    let first = observe(&db, &namespace, &owner_id).await;
    assert!(
        first.lease_current,
        "{owner_id}'s lease had expired before it was killed: {first:?}"
    );
    assert_eq!(first.owner.as_deref(), Some(owner_id.as_str()), "{first:?}");

    let survivors: Vec<&ClusterNode> = nodes.iter().filter(|n| n.node_id != owner_id).collect();
    let (reply, failures) = incr_until_taken_over(
        &db,
        &namespace,
        &owner_id,
        &survivors,
        killed_at,
        Duration::from_secs(10),
    )
    .await;
    assert!(
        !failures.is_empty(),
        "no call was tried before the lease expired: the test proved nothing"
    );
    assert_eq!(
        reply, "1",
        "alice restarts as a fresh process on its new owner"
    );
    let new_owner = alice_owner(&db, &namespace).await;
    assert!(
        survivors.iter().any(|n| n.node_id == new_owner),
        "alice's partition went to {new_owner}, not a survivor"
    );
    // One process, whichever survivor a call enters through.
    assert_eq!(incr_eventually(survivors[0]).await, "2");
    assert_eq!(incr_eventually(survivors[1]).await, "3");
    eprintln!(
        "kill -9 {owner_id}: alice back on {new_owner} {:?} after the kill; {} calls failed \
         before expiry",
        killed_at.elapsed(),
        failures.len()
    );
    drop(nodes);
    drop_namespace(&db, &namespace).await;
}

/// Contract §3 (the leader gives orphaned partitions to live nodes) with
/// the default timings (TTL 5 s, renewal every 1 s) and PostgreSQL a couple
/// of milliseconds of round trip away (the proxy holds each chunk 1 ms, or
/// a little more at tokio's timer resolution, each way; as across
/// availability zones): a lone node must come to own every partition and
/// serve its keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_milliseconds_from_postgres_assigns_every_partition() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("latency-assign");
    let proxy = PgProxy::start().await;
    proxy.set_delay(Duration::from_millis(1));
    let mut node = ClusterNode::spawn(&NodeSpec {
        extra_args: Vec::new(),
        ..spec(&namespace, "n1", proxy.arbiter_url())
    })
    .await;
    node.wait_current(START_LIMIT).await;
    let started = Instant::now();
    loop {
        let status = node.status().await.expect("the node answers");
        if status["partitions_owned"] == PARTITIONS {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the node owns {} of {PARTITIONS} partitions 10 s after joining: {status}",
            status["partitions_owned"]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(incr_eventually(&node).await, "1");
    drop(node);
    drop(proxy);
    drop_namespace(&db, &namespace).await;
}

/// Start one node per spec, one after the other, and wait until they agree
/// on the table (as [`start_cluster`]).
pub(crate) async fn start_nodes(specs: &[NodeSpec]) -> Vec<ClusterNode> {
    let mut nodes = Vec::new();
    for spec in specs {
        let mut node = ClusterNode::spawn(spec).await;
        node.wait_current(START_LIMIT).await;
        nodes.push(node);
    }
    wait_settled(&nodes).await;
    nodes
}
