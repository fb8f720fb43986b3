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

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fief_tests::guests;
use fief_tests::multiprocess::{
    CallError, ClusterNode, FAST_TIMINGS, NodeSpec, PG_ADDR, PgProxy, arbiter_url, call_url,
    drop_namespace, test_database, unique_namespace,
};

/// The partition of key `alice` (FNV-1a-64 % 1024: the test vector in
/// `host/core/src/partition.rs`).
const ALICE_PARTITION: i32 = 263;
/// Partitions per namespace (the default).
const PARTITIONS: u64 = 1024;
/// The lease TTL of `FAST_TIMINGS`.
const LEASE_TTL: Duration = Duration::from_secs(2);
/// How long a node may take to start (the binary's build aside).
const START_LIMIT: Duration = Duration::from_secs(30);
/// How long a single call in a polling loop may take: a call either answers
/// at once or is a failure.
const POLL_CALL: Duration = Duration::from_secs(2);

/// One process test at a time (`chaos.rs` takes it too).
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn spec(namespace: &str, node_id: &str, arbiter: String) -> NodeSpec {
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
async fn start_cluster(namespace: &str, arbiters: &[String]) -> Vec<ClusterNode> {
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

/// Start a cluster of `n` nodes, each reaching PostgreSQL through its own
/// proxy (so whichever node ends up owning `alice` can be cut off).
async fn start_proxied_cluster(namespace: &str, n: usize) -> (Vec<ClusterNode>, Vec<PgProxy>) {
    let mut proxies = Vec::new();
    for _ in 0..n {
        proxies.push(PgProxy::start().await);
    }
    let urls: Vec<String> = proxies.iter().map(PgProxy::arbiter_url).collect();
    let nodes = start_cluster(namespace, &urls).await;
    (nodes, proxies)
}

/// One reading of the arbiter, in one statement, on the database's clock.
#[derive(Debug)]
struct Observation {
    /// The database's clock, ms since the Unix epoch.
    db_now_ms: i64,
    /// The owner of `alice`'s partition.
    owner: Option<String>,
    /// When the watched node's lease expires, ms since the Unix epoch.
    expires_at_ms: i64,
    /// Whether the watched node's lease is current on the database's clock
    /// (evaluated after the statement's snapshot, so after `owner` was read).
    lease_current: bool,
}

/// Read the owner of `alice`'s partition and `node`'s lease.
async fn observe(db: &tokio_postgres::Client, namespace: &str, node: &str) -> Observation {
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
async fn alice_owner(db: &tokio_postgres::Client, namespace: &str) -> String {
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
fn assert_no_move_before_expiry(seen: &Observation, old: &str) {
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
async fn incr_until_taken_over(
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
async fn incr_eventually(via: &ClusterNode) -> String {
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

async fn live_keys(node: &ClusterNode) -> u64 {
    node.status()
        .await
        .unwrap_or_else(|| panic!("{} does not answer GET /v1/status", node.node_id))["live_keys"]
        .as_u64()
        .expect("live_keys is a number")
}

fn unix_ms(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// Poll `node` until its lease is no longer current (it fenced; a node that
/// has noticed its fence rejoins, so it may already report `pending`), at
/// most `limit`.
async fn wait_not_current(node: &ClusterNode, limit: Duration) -> serde_json::Value {
    let deadline = Instant::now() + limit;
    loop {
        let status = node
            .status()
            .await
            .unwrap_or_else(|| panic!("{} does not answer GET /v1/status", node.node_id));
        if status["lease"] != "current" {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "{} did not fence within {limit:?} of losing PostgreSQL: {status}",
            node.node_id
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
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

/// §5 row 2 (node ↔ arbiter partition): a node cut off from PostgreSQL
/// fences at TTL − margin, while the arbiter still counts its lease current
/// and still lists it as the owner (fence before takeover, guarantee 3); the
/// fenced node refuses calls (503 `fenced`); only after the arbiter's expiry
/// does another node serve its keys (fresh: the counter restarts at 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_cut_from_postgres_fences_before_takeover() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("cut-from-postgres");
    let (nodes, proxies) = start_proxied_cluster(&namespace, 3).await;

    let owner_id = alice_owner(&db, &namespace).await;
    let cut = nodes
        .iter()
        .position(|n| n.node_id == owner_id)
        .expect("the owner is one of ours");
    let owner = &nodes[cut];
    for expected in ["1", "2"] {
        assert_eq!(
            owner
                .call_settled("counter", "alice", "incr")
                .await
                .unwrap(),
            expected
        );
    }
    assert_eq!(live_keys(owner).await, 1, "alice is live on its owner");

    proxies[cut].set_cut(true);
    let cut_at = Instant::now();
    let status = wait_not_current(owner, LEASE_TTL).await;
    let fenced_after = cut_at.elapsed();
    let at_fence = observe(&db, &namespace, &owner_id).await;
    assert_eq!(
        at_fence.owner.as_deref(),
        Some(owner_id.as_str()),
        "alice's partition moved before {owner_id} fenced: {at_fence:?}"
    );
    assert!(
        at_fence.lease_current,
        "{owner_id} fenced only after the arbiter expired its lease ({fenced_after:?} after the \
         cut): {at_fence:?}; its status {status}"
    );
    // Checked right after the fence point: the node must refuse at once.
    let refused = owner
        .call_within("counter", "alice", "incr", POLL_CALL)
        .await
        .expect_err("a fenced node serves nothing");
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (503, "fenced"),
        "{refused:?}"
    );

    let others: Vec<&ClusterNode> = nodes.iter().filter(|n| n.node_id != owner_id).collect();
    let (reply, failures) = incr_until_taken_over(
        &db,
        &namespace,
        &owner_id,
        &others,
        cut_at,
        Duration::from_secs(12),
    )
    .await;
    assert_eq!(
        reply, "1",
        "alice restarts as a fresh process on its new owner"
    );
    let new_owner = alice_owner(&db, &namespace).await;
    assert_ne!(new_owner, owner_id);
    eprintln!(
        "cut {owner_id} off: fenced {fenced_after:?} after the cut ({:?} before the arbiter's \
         expiry); alice back on {new_owner} {:?} after the cut; {} calls failed before expiry",
        Duration::from_millis((at_fence.expires_at_ms - at_fence.db_now_ms).max(0) as u64),
        cut_at.elapsed(),
        failures.len()
    );
    drop(nodes);
    drop(proxies);
    drop_namespace(&db, &namespace).await;
}

/// The `node fenced` line of a node's log: its timestamp (RFC 3339, the
/// node's wall clock) and how many keys it killed. Only the node's own line
/// (`fief::node: node fenced … killed=N`): a killed key's line, whose reason
/// is "the node fenced", may come first, since the keys die on their own
/// tasks while the fence, on the coordination thread, goes on to log.
fn fence_log_line(log: &str) -> Option<(String, u64)> {
    let line = log
        .lines()
        .find(|l| l.contains("fief::node") && l.contains("node fenced"))?;
    let timestamp = line.split_whitespace().next()?.to_owned();
    let killed = line
        .split_whitespace()
        .find_map(|field| field.strip_prefix("killed="))?
        .parse()
        .ok()?;
    Some((timestamp, killed))
}

/// §5 row 2, "its keys stop", and §2: at the fence point, all at once,
/// `terminate` keys are killed. A node cut off from PostgreSQL must kill its
/// keys at its fence point (within the kill bound), and in any case before
/// the arbiter's expiry, after which another node may start the same key.
///
/// The kill is timed by the node's own `node fenced` log line (logged after
/// the kills), on the wall clock this host shares with PostgreSQL; the fence
/// point from the `lease_remaining_ms` the node reports while still current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_node_kills_its_keys_at_the_fence_point() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("cut-kills-keys");
    let proxy = PgProxy::start().await;
    let nodes = start_cluster(&namespace, &[proxy.arbiter_url()]).await;
    let node = &nodes[0];
    assert_eq!(
        node.call_settled("counter", "alice", "incr").await.unwrap(),
        "1"
    );
    assert_eq!(live_keys(node).await, 1);

    proxy.set_cut(true);
    let cut_at = Instant::now();
    tokio::time::sleep(Duration::from_millis(50)).await;
    // The fence point, on the wall clock: no renewal succeeds any more, so
    // every reading names the same one; keep the earliest upper bound.
    let mut fence_point_ms = i64::MAX;
    loop {
        let status = node
            .status()
            .await
            .expect("the node answers before its fence point");
        if status["lease"] != "current" {
            break;
        }
        let remaining = status["lease_remaining_ms"].as_i64().unwrap_or(0);
        fence_point_ms = fence_point_ms.min(unix_ms(SystemTime::now()) + remaining);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        fence_point_ms < i64::MAX,
        "never saw the lease current after the cut"
    );

    let (fenced_at, killed) = loop {
        if let Some(found) = fence_log_line(&node.log_text()) {
            break found;
        }
        assert!(
            cut_at.elapsed() < 3 * LEASE_TTL,
            "no `node fenced` line in {} within {:?} of the cut",
            node.log.display(),
            3 * LEASE_TTL
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(killed >= 1, "the fence killed no key, but alice was live");
    let row = db
        .query_one(
            "SELECT (extract(epoch FROM $1::text::timestamptz) * 1000)::bigint,
                    (extract(epoch FROM expires_at) * 1000)::bigint
               FROM fief_leases WHERE namespace = $2 AND node_id = $3",
            &[&fenced_at, &namespace, &node.node_id],
        )
        .await
        .expect("reading the lease");
    let (killed_ms, expires_ms): (i64, i64) = (row.get(0), row.get(1));
    assert!(
        killed_ms < expires_ms,
        "alice was killed at {fenced_at}, {} ms after the arbiter's expiry of the lease \
         ({} ms after the node's fence point): another node could already have started it",
        killed_ms - expires_ms,
        killed_ms - fence_point_ms
    );
    assert!(
        killed_ms - fence_point_ms <= 200,
        "alice was killed {} ms after the node's fence point; it must die at the fence point \
         (kill bound 10 ms)",
        killed_ms - fence_point_ms
    );
    drop(nodes);
    drop(proxy);
    drop_namespace(&db, &namespace).await;
}

/// §5 row 2 continued, and §2 "after fencing, a node rejoins with a fresh
/// lease and owns only what the leader assigns it anew": a fenced node keeps
/// answering (503 `fenced` for calls, its status), holds no key, and once it
/// reaches PostgreSQL again it rejoins; calls through it then reach the one
/// live `alice` (the counter goes on, it does not restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_node_answers_and_rejoins_when_the_cut_heals() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("fenced-rejoins");
    let (nodes, proxies) = start_proxied_cluster(&namespace, 2).await;

    let owner_id = alice_owner(&db, &namespace).await;
    let cut = nodes
        .iter()
        .position(|n| n.node_id == owner_id)
        .expect("the owner is one of ours");
    let (owner, other) = (&nodes[cut], &nodes[1 - cut]);
    assert_eq!(
        owner
            .call_settled("counter", "alice", "incr")
            .await
            .unwrap(),
        "1"
    );

    proxies[cut].set_cut(true);
    let cut_at = Instant::now();
    wait_not_current(owner, LEASE_TTL).await;
    let (reply, _) = incr_until_taken_over(
        &db,
        &namespace,
        &owner_id,
        &[other],
        cut_at,
        Duration::from_secs(12),
    )
    .await;
    assert_eq!(reply, "1", "alice restarts on {}", other.node_id);

    // Well past the point where the node's coordination has noticed its fence.
    tokio::time::sleep(LEASE_TTL).await;
    let status = owner
        .status_within(Duration::from_secs(1))
        .await
        .unwrap_or_else(|| panic!("fenced node {owner_id} does not answer GET /v1/status"));
    assert_ne!(status["lease"], "current", "{status}");
    assert_eq!(
        status["live_keys"], 0,
        "the fenced node holds no key: {status}"
    );
    let refused = owner
        .call_within("counter", "alice", "incr", Duration::from_secs(1))
        .await
        .expect_err("a fenced node serves nothing");
    assert_eq!(
        (refused.status, refused.code.as_str()),
        (503, "fenced"),
        "{refused:?}"
    );

    proxies[cut].set_cut(false);
    let healed_at = Instant::now();
    loop {
        if let Some(status) = owner.status_within(Duration::from_secs(1)).await
            && status["lease"] == "current"
        {
            break;
        }
        assert!(
            healed_at.elapsed() < Duration::from_secs(10),
            "{owner_id} did not rejoin within 10 s of reaching PostgreSQL again"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // One alice: through either node, the counter goes on from 1.
    assert_eq!(incr_eventually(owner).await, "2");
    assert_eq!(incr_eventually(other).await, "3");
    let live: u64 = live_keys(owner).await + live_keys(other).await;
    assert_eq!(live, 1, "alice is live on exactly one node");
    drop(nodes);
    drop(proxies);
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

// ===========================================================================
// Pause and resume, graceful leave, rolling restart (§5 rows 5 and 8)
// ===========================================================================

/// [`spec`] with the probe guest deployed too.
fn spec_with_probe(namespace: &str, node_id: &str, arbiter: String) -> NodeSpec {
    let mut spec = spec(namespace, node_id, arbiter);
    spec.deploy
        .push(("probe".to_owned(), guests::PROBE.to_owned()));
    spec
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

/// Whether a node's log line is about `module`/`key`: the node logs these
/// as fields, `module=probe key=alice` (or quoted, `key="alice"`).
fn is_about(line: &str, module: &str, key: &str) -> bool {
    let has = |name: &str, value: &str| {
        line.split_whitespace()
            .any(|w| w == format!("{name}={value}") || w == format!("{name}=\"{value}\""))
    };
    has("module", module) && has("key", key)
}

/// The id of `node`'s lease at the arbiter (a new one at each join).
async fn lease_id(db: &tokio_postgres::Client, namespace: &str, node: &str) -> i64 {
    db.query_one(
        "SELECT lease_id FROM fief_leases WHERE namespace = $1 AND node_id = $2",
        &[&namespace, &node],
    )
    .await
    .unwrap_or_else(|e| panic!("reading {node}'s lease: {e:?}"))
    .get(0)
}

/// Call `module`/`key` with `message` through `via` until it succeeds (at
/// most 10 s) and return the reply.
async fn call_eventually(via: &ClusterNode, module: &str, key: &str, message: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match via.call_within(module, key, message, POLL_CALL).await {
            Ok(reply) => return reply,
            Err(e) => assert!(
                Instant::now() < deadline,
                "{module}/{key} {message:?} via {} kept failing for 10 s: {e:?}",
                via.node_id
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// §5 row 5 (a node paused past its TTL, then resumed: "it performs no side
/// effect and answers nothing for keys it lost"), §2 ("even a node resumed
/// after a long pause (SIGSTOP, VM freeze) cannot act for a key after its
/// fence point"), and the fence-mode issue's item 3: a real process stopped
/// by SIGSTOP and resumed by SIGCONT after its lease expired and another
/// node took over.
///
/// alice's owner O counts `counter/alice` to 5; on O, `probe/alice` arms a
/// timer and makes `counter/alice` tick, both due while O is stopped. O is
/// stopped until the arbiter has expired its lease, another node serves
/// alice (a fresh counter: 1, 2) and the timers are due; calls for alice are
/// queued at O's socket; then O resumes. Then:
///
/// - (a) the queued calls are refused or reach the new owner: the counter
///   answers 3 or an error, never 6 (O's old process counting on);
/// - (b) O fences (it never reports a current lease without a fence
///   counted), rejoins with a fresh lease, and calls through it reach the
///   one alice (the count goes on);
/// - (c) O's old processes run no guest code after the resume. Between the
///   resume and the rejoin O's log shows both old alice processes *killed*;
///   no guest log line for alice (`log` is a gated import; the queued `log`
///   call must not show up in O's log); and no key death: had the old
///   counter handled its due tick, it would have re-armed its timer
///   (`send-after`, a gated import) and died "effect refused". The probe on
///   the new owner never sees the timer armed on O.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_node_acts_for_nothing_it_lost() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("paused-node");
    let specs: Vec<NodeSpec> = (1..=3)
        .map(|i| spec_with_probe(&namespace, &format!("n{i}"), arbiter_url(PG_ADDR)))
        .collect();
    let nodes = start_nodes(&specs).await;
    let owner_id = alice_owner(&db, &namespace).await;
    let owner = nodes
        .iter()
        .find(|n| n.node_id == owner_id)
        .expect("the owner is one of ours");
    let others: Vec<&ClusterNode> = nodes.iter().filter(|n| n.node_id != owner_id).collect();

    for i in 1..=5 {
        assert_eq!(
            owner
                .call_settled("counter", "alice", "incr")
                .await
                .unwrap(),
            i.to_string()
        );
    }
    // Controls: on O, the probe's log lines reach O's log, and its timers fire.
    assert_eq!(
        owner
            .call_settled("probe", "alice", "log before-pause")
            .await
            .unwrap(),
        "ok"
    );
    owner
        .call_settled("probe", "alice", "after 20 early")
        .await
        .unwrap();
    let control_since = Instant::now();
    while !owner
        .call_settled("probe", "alice", "events")
        .await
        .unwrap()
        .contains("timer:early")
    {
        assert!(
            control_since.elapsed() < Duration::from_secs(5),
            "a 20 ms timer on {owner_id} did not fire within 5 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        owner.log_text().lines().any(|l| l.contains("fief::guest")
            && l.contains("before-pause")
            && is_about(l, "probe", "alice")),
        "the probe's log line is not in {}",
        owner.log.display()
    );
    // Due while O is stopped: the counter's first tick, and the probe's timer.
    assert_eq!(
        owner
            .call_settled("probe", "alice", "cast counter alice tick-every 3000")
            .await
            .unwrap(),
        "ok"
    );
    let timer = owner
        .call_settled("probe", "alice", "after 3000 t")
        .await
        .unwrap();
    let armed_at = Instant::now();
    assert!(timer.parse::<u64>().is_ok(), "after 3000 t: {timer}");
    assert_eq!(live_keys(owner).await, 2, "counter and probe alice on O");
    let old_lease = lease_id(&db, &namespace, &owner_id).await;

    owner.signal("STOP");
    let paused_at = Instant::now();
    let taken = loop {
        let seen = observe(&db, &namespace, &owner_id).await;
        assert_no_move_before_expiry(&seen, &owner_id);
        if !seen.lease_current && seen.owner.as_deref().is_some_and(|n| n != owner_id) {
            break seen;
        }
        assert!(
            paused_at.elapsed() < Duration::from_secs(15),
            "15 s after stopping {owner_id}, alice's partition has not moved: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let new_owner_id = taken.owner.clone().expect("checked above");
    let new_owner = nodes
        .iter()
        .find(|n| n.node_id == new_owner_id)
        .expect("the new owner is one of ours");
    assert_eq!(
        incr_eventually(others[0]).await,
        "1",
        "alice restarts as a fresh process on {new_owner_id}"
    );
    assert_eq!(incr_eventually(others[1]).await, "2");
    assert_eq!(
        call_eventually(others[0], "probe", "alice", "init-state").await,
        "none",
        "the probe on {new_owner_id} starts fresh (no handoff from a crashed owner)"
    );
    // Every timer armed on O is due before O runs again.
    tokio::time::sleep_until((armed_at + Duration::from_millis(3500)).into()).await;

    // Calls queued at O's socket while it is stopped: its HTTP server takes
    // them the moment it runs again, maybe before its coordination loop has
    // noticed the fence.
    let log_offset = owner.log_text().len();
    let queued = async {
        tokio::join!(
            owner.call_within("counter", "alice", "incr", Duration::from_secs(10)),
            owner.call_within(
                "probe",
                "alice",
                "log queued-while-paused",
                Duration::from_secs(10)
            ),
        )
    };
    let resume = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        owner.signal("CONT");
        Instant::now()
    };
    let ((queued_incr, queued_log), resumed_at) = tokio::join!(queued, resume);
    let paused_for = resumed_at - paused_at;

    // (a) Refused, or served by the new owner; never by O's old process.
    let mut count = 2;
    if let Ok(reply) = &queued_incr {
        assert_eq!(
            reply, "3",
            "a call queued at {owner_id} while it was stopped was answered {reply:?}: the new \
             owner {new_owner_id} was at 2, O's old process at 5"
        );
        count = 3;
    }
    if let Ok(reply) = &queued_log {
        assert_eq!(reply, "ok", "probe log via {owner_id}");
    }

    // (b) O fences, then rejoins with a fresh lease.
    let mut states: Vec<String> = Vec::new();
    loop {
        if let Some(status) = owner.status_within(Duration::from_secs(1)).await {
            let lease = status["lease"].as_str().unwrap_or("?").to_owned();
            if states.last() != Some(&lease) {
                states.push(lease.clone());
            }
            if lease == "current" {
                assert!(
                    status["fences"].as_u64().unwrap_or(0) >= 1,
                    "{owner_id} reports a current lease after its pause without having fenced: \
                     {status}"
                );
                break;
            }
        }
        assert!(
            resumed_at.elapsed() < Duration::from_secs(15),
            "{owner_id} did not rejoin within 15 s of SIGCONT; lease states seen {states:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rejoined_after = resumed_at.elapsed();
    let new_lease = lease_id(&db, &namespace, &owner_id).await;
    assert_ne!(
        new_lease, old_lease,
        "{owner_id} must rejoin with a fresh lease"
    );

    // (c) What O did after the resume, up to its rejoin: no call for alice
    // has gone to O since, so every alice line here is about its old
    // processes. Their tasks log their end right after the fence; wait for
    // both lines.
    let segment = loop {
        let text = owner.log_text();
        let segment = text.get(log_offset..).unwrap_or_default().to_owned();
        let ended = |module: &str| {
            segment
                .lines()
                .any(|l| is_about(l, module, "alice") && l.contains("key killed"))
        };
        if ended("probe") && ended("counter") {
            break segment;
        }
        assert!(
            resumed_at.elapsed() < Duration::from_secs(20),
            "{owner_id}'s log has no `key killed` line for both old alice processes since the \
             resume:\n{segment}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        segment
            .lines()
            .any(|l| l.contains("fief::node") && l.contains("node fenced")),
        "{owner_id} logged no fence after the resume:\n{segment}"
    );
    for line in segment.lines() {
        let about_alice = is_about(line, "probe", "alice") || is_about(line, "counter", "alice");
        assert!(
            !(about_alice && line.contains("fief::guest")),
            "guest code of alice ran on {owner_id} after the resume: {line}"
        );
        assert!(
            !(about_alice && line.contains("key died")),
            "an old alice process on {owner_id} died instead of being killed: it ran after the \
             resume until a gated import refused it: {line}"
        );
        assert!(
            !line.contains("queued-while-paused"),
            "{owner_id} served a call queued while it was stopped: {line}"
        );
    }
    if queued_log.is_ok() {
        assert!(
            new_owner.log_text().contains("queued-while-paused"),
            "the queued probe call was answered, but not by the new owner {new_owner_id}"
        );
    }

    // One alice: the count goes on through O and the others.
    assert_eq!(incr_eventually(owner).await, (count + 1).to_string());
    assert_eq!(incr_eventually(others[0]).await, (count + 2).to_string());
    let events = call_eventually(others[1], "probe", "alice", "events").await;
    assert!(
        !events.lines().any(|e| e == "timer:t"),
        "the timer armed on {owner_id} fired for the live probe: {events:?}"
    );
    eprintln!(
        "paused {owner_id} for {paused_for:?}; alice moved to {new_owner_id}; queued calls: \
         incr {queued_incr:?}, log {queued_log:?}; {owner_id}'s lease states after SIGCONT \
         {states:?}, rejoined {rejoined_after:?} after it"
    );
    drop(nodes);
    drop_namespace(&db, &namespace).await;
}

/// One call of a background caller: when it returned (since the caller
/// started), through which node, and what came back.
#[derive(Debug)]
struct Attempt {
    at: Duration,
    via: String,
    result: Result<String, CallError>,
}

/// Check a background caller's `incr` replies for one counter that stood at
/// `before` when it started, and return them. Each reply must exceed the
/// one before (a value repeated or going back means two processes served
/// the key, guarantee 1); and it may exceed it by more than one only by as
/// many calls as failed in between (a failed call may still have been
/// processed, its reply lost; an increment nobody asked for would be a
/// message processed twice).
fn check_counts(attempts: &[Attempt], before: u64) -> Vec<u64> {
    let mut last = before;
    let mut failed_since = 0u64;
    let mut values = Vec::new();
    for attempt in attempts {
        let Ok(reply) = &attempt.result else {
            failed_since += 1;
            continue;
        };
        let value: u64 = reply
            .parse()
            .unwrap_or_else(|_| panic!("incr replied {reply:?}: {attempt:?}"));
        assert!(
            value > last,
            "alice answered {value} via {} at {:?} after {last}: two processes served it (every \
             attempt: {attempts:#?})",
            attempt.via,
            attempt.at
        );
        assert!(
            value - last <= 1 + failed_since,
            "alice went from {last} to {value} via {} at {:?} with {failed_since} failed calls in \
             between: a message was processed twice (every attempt: {attempts:#?})",
            attempt.via,
            attempt.at
        );
        last = value;
        failed_since = 0;
        values.push(value);
    }
    values
}

/// Failed calls and the longest time without a success (from the success
/// before a run of failures to the one after it).
fn error_summary(attempts: &[Attempt]) -> (usize, Duration) {
    let failed = attempts.iter().filter(|a| a.result.is_err()).count();
    let mut longest = Duration::ZERO;
    let mut last_ok = Duration::ZERO;
    let mut failing = false;
    for attempt in attempts {
        if attempt.result.is_ok() {
            if failing {
                longest = longest.max(attempt.at.saturating_sub(last_ok));
            }
            last_ok = attempt.at;
            failing = false;
        } else {
            failing = true;
        }
    }
    (failed, longest)
}

/// §5 row 8 (graceful leave: "no key is served twice; handoff state
/// arrives; calls see at most brief errors"), §3 ("`leave` drains
/// gracefully: each partition is handed off (keys stop normally, `handoff`
/// state travels) before the node goes"), and the "Cluster
/// ownership" item 6 and test list: "`fief leave` hands off counter state
/// with no double serve".
///
/// alice counts to 5; a caller keeps incrementing it through the two other
/// nodes while `fief leave --node <owner>` runs. The CLI succeeds and the
/// owner's process exits on its own; every reply is above the last (none
/// repeated, none back to 1: the handoff carried the count), and calls keep
/// succeeding after the owner is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leave_hands_off_counter_state_with_no_double_serve() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("leave-handoff");
    let mut nodes = start_cluster(&namespace, &vec![arbiter_url(PG_ADDR); 3]).await;
    for i in 1..=5 {
        let node = &nodes[(i - 1) % nodes.len()];
        assert_eq!(
            node.call_settled("counter", "alice", "incr").await.unwrap(),
            i.to_string(),
            "incr #{i} via {}",
            node.node_id
        );
    }
    let owner_id = alice_owner(&db, &namespace).await;
    let o = nodes
        .iter()
        .position(|n| n.node_id == owner_id)
        .expect("the owner is one of ours");
    let mut leaver = nodes.remove(o);
    let stayers = nodes;

    let done = std::sync::atomic::AtomicBool::new(false);
    let started = Instant::now();
    let caller = async {
        let mut attempts = Vec::new();
        let mut i = 0;
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            let via = &stayers[i % stayers.len()];
            i += 1;
            let result = via.call_within("counter", "alice", "incr", POLL_CALL).await;
            attempts.push(Attempt {
                at: started.elapsed(),
                via: via.node_id.clone(),
                result,
            });
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        attempts
    };
    let leave = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let leave_at = started.elapsed();
        leaver.leave_and_exit(Duration::from_secs(15)).await;
        let exited_at = started.elapsed();
        // Calls go on a while with the owner gone.
        tokio::time::sleep(Duration::from_secs(1)).await;
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        (leave_at, exited_at)
    };
    let (attempts, (leave_at, exited_at)) = tokio::join!(caller, leave);

    let log = leaver.log_text();
    assert!(
        log.contains("partitions handed off") && log.contains("left the cluster"),
        "{owner_id}'s log shows no handoff and leave:\n{}",
        leaver.log_tail(30)
    );

    let values = check_counts(&attempts, 5);
    assert!(
        attempts.iter().any(|a| a.at < leave_at && a.result.is_ok()),
        "no call succeeded before the leave began: {attempts:#?}"
    );
    assert!(
        attempts
            .iter()
            .any(|a| a.at > exited_at && a.result.is_ok()),
        "no call succeeded after {owner_id} exited: {attempts:#?}"
    );
    let last = *values.last().expect("checked above");
    assert_eq!(incr_eventually(&stayers[0]).await, (last + 1).to_string());
    assert_eq!(incr_eventually(&stayers[1]).await, (last + 2).to_string());
    let new_owner = alice_owner(&db, &namespace).await;
    assert!(
        stayers.iter().any(|n| n.node_id == new_owner),
        "alice's partition is on {new_owner}, not a remaining node"
    );
    let mut live = 0;
    for node in &stayers {
        live += live_keys(node).await;
    }
    assert_eq!(live, 1, "alice is live on exactly one remaining node");
    let (failed, longest) = error_summary(&attempts);
    eprintln!(
        "fief leave {owner_id}: alice to {new_owner}; {} calls, {failed} failed, longest time \
         without a success {longest:?}; replies {}..={last}; exited {:?} after the leave began",
        attempts.len(),
        values[0],
        exited_at.saturating_sub(leave_at)
    );
    drop(leaver);
    drop(stayers);
    drop_namespace(&db, &namespace).await;
}

/// §5 row 8 (rolling restart: "no key is served twice; handoff state
/// arrives; calls see at most brief errors"), and §3 "a graceful shutdown
/// runs `leave` first": each of 3 nodes in turn gets SIGTERM (it leaves,
/// handing its partitions off, then exits 0) and is started again with the
/// same id. A caller increments alice throughout, through the nodes that
/// are up: every reply is above the last (none repeated, none back to 1),
/// a call succeeds after each restart, and alice ends live on one node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restart_serves_every_key_once() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("rolling-restart");
    let arbiter = arbiter_url(PG_ADDR);
    let mut nodes = start_cluster(&namespace, &vec![arbiter.clone(); 3]).await;
    for i in 1..=3 {
        assert_eq!(
            nodes[i - 1]
                .call_settled("counter", "alice", "incr")
                .await
                .unwrap(),
            i.to_string()
        );
    }

    // (node id, URL) of the nodes the caller may use.
    let targets = std::sync::Mutex::new(
        nodes
            .iter()
            .map(|n| (n.node_id.clone(), n.url.clone()))
            .collect::<Vec<_>>(),
    );
    let attempts = std::sync::Mutex::new(Vec::<Attempt>::new());
    let done = std::sync::atomic::AtomicBool::new(false);
    let client = reqwest::Client::new();
    let started = Instant::now();
    let caller = async {
        let mut i = 0;
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            let (via, url) = {
                let targets = targets.lock().unwrap();
                targets[i % targets.len()].clone()
            };
            i += 1;
            let result = call_url(&client, &url, "counter", "alice", "incr", POLL_CALL).await;
            attempts.lock().unwrap().push(Attempt {
                at: started.elapsed(),
                via,
                result,
            });
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let mut retired = Vec::new();
    let mut steps = Vec::new();
    let restart_all = async {
        for i in 0..nodes.len() {
            let id = nodes[i].node_id.clone();
            targets.lock().unwrap().retain(|(n, _)| *n != id);
            let stop_at = started.elapsed();
            nodes[i].signal("TERM");
            let exit = nodes[i]
                .wait_exit(Duration::from_secs(20))
                .await
                .unwrap_or_else(|| panic!("{id} still runs 20 s after SIGTERM"));
            assert!(exit.success(), "{id} exited with {exit} after SIGTERM");
            let log = nodes[i].log_text();
            assert!(
                log.contains("left the cluster") && !log.contains("leaving before shutdown failed"),
                "{id} did not leave before stopping:\n{}",
                nodes[i].log_tail(30)
            );
            nodes[i].rename_log("before-restart");
            let mut fresh = ClusterNode::spawn(&spec(&namespace, &id, arbiter.clone())).await;
            fresh.wait_current(START_LIMIT).await;
            retired.push(std::mem::replace(&mut nodes[i], fresh));
            wait_settled(&nodes).await;
            let back_at = started.elapsed();
            targets
                .lock()
                .unwrap()
                .push((id.clone(), nodes[i].url.clone()));
            // Progress: alice is served again after this restart.
            loop {
                if attempts
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|a| a.at > back_at && a.result.is_ok())
                {
                    break;
                }
                assert!(
                    started.elapsed() < back_at + Duration::from_secs(10),
                    "no call for alice succeeded within 10 s of restarting {id}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            steps.push((id, back_at.saturating_sub(stop_at)));
        }
        done.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    tokio::join!(caller, restart_all);

    let attempts = attempts.into_inner().unwrap();
    let values = check_counts(&attempts, 3);
    let last = *values.last().expect("calls succeeded after each restart");
    for (i, node) in nodes.iter().enumerate() {
        assert_eq!(
            incr_eventually(node).await,
            (last + 1 + i as u64).to_string(),
            "via {}",
            node.node_id
        );
    }
    let mut live = 0;
    for node in &nodes {
        live += live_keys(node).await;
    }
    assert_eq!(live, 1, "alice is live on exactly one node");
    let (failed, longest) = error_summary(&attempts);
    eprintln!(
        "rolling restart (node, stop to settled again): {steps:?}; {} calls, {failed} failed, \
         longest time without a success {longest:?}; replies {}..={last}",
        attempts.len(),
        values[0]
    );
    drop(nodes);
    drop(retired);
    drop_namespace(&db, &namespace).await;
}
