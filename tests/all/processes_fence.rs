//! Fencing with real processes (contract §5 rows 2 and 5): `fief node`
//! children cut off from PostgreSQL by a TCP proxy that stops forwarding, or
//! stopped (SIGSTOP) past their TTL and resumed (SIGCONT), fence before any
//! other node takes over, kill their keys at the fence point, act for
//! nothing they lost, and rejoin. The harness, timings and conventions
//! (`FAST_TIMINGS`, one test at a time, logs) are those of `processes.rs`
//! (its module header).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fief_tests::guests;
use fief_tests::multiprocess::{
    ClusterNode, NodeSpec, PG_ADDR, PgProxy, arbiter_url, drop_namespace, test_database,
    unique_namespace,
};

use crate::processes::{
    LEASE_TTL, POLL_CALL, SERIAL, alice_owner, assert_no_move_before_expiry, incr_eventually,
    incr_until_taken_over, live_keys, observe, spec, start_cluster, start_nodes,
};

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
    // The renewals the cut swallowed say so before the fence (they timed
    // out silently before `renew got no answer in time` was logged).
    assert!(
        node.log_text()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("renew got no answer in time")),
        "no renewal timeout was logged before the fence:\n{}",
        node.log_tail(30)
    );
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

// ===========================================================================
// Pause and resume (§5 row 5)
// ===========================================================================

/// [`spec`] with the probe guest deployed too.
fn spec_with_probe(namespace: &str, node_id: &str, arbiter: String) -> NodeSpec {
    let mut spec = spec(namespace, node_id, arbiter);
    spec.deploy
        .push(("probe".to_owned(), guests::PROBE.to_owned()));
    spec
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
