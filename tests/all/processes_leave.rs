//! Graceful moves with real processes (contract §5 row 8): `fief leave`,
//! and a rolling restart by SIGTERM, hand keys off with their state while a
//! background caller checks that no key is served twice. The harness,
//! timings and conventions (`FAST_TIMINGS`, one test at a time, logs) are
//! those of `processes.rs` (its module header).

use std::time::{Duration, Instant};

use fief_tests::multiprocess::{
    CallError, ClusterNode, PG_ADDR, arbiter_url, call_url, drop_namespace, test_database,
    unique_namespace,
};

use crate::processes::{
    POLL_CALL, SERIAL, START_LIMIT, alice_owner, incr_eventually, live_keys, spec, start_cluster,
    wait_settled,
};

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
///
/// `fences` are the `node fenced` lines of the nodes' logs ([`fence_lines`]):
/// a fence kills the keys its node held and the counter's in-memory state
/// with them, by design, so a count that starts again after one is the
/// fence's doing, not two processes'. These tests need no node to fence;
/// when one did (a machine too loaded for their 2 s TTL), the failure says
/// so instead of accusing the ownership.
fn check_counts(attempts: &[Attempt], before: u64, fences: &str) -> Vec<u64> {
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
            value > last || fences.is_empty(),
            "alice answered {value} via {} at {:?} after {last}, and a node fenced meanwhile: \
             its keys were killed with their in-memory state, as a fence does (no renewal in \
             time: is the machine too loaded for these tests' 2 s TTL?); not a double serve, but \
             this test needs no fence:\n{fences}",
            attempt.via,
            attempt.at
        );
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

/// The `node fenced` lines of `nodes`' logs, each after its node's id; empty
/// when none fenced.
fn fence_lines<'a>(nodes: impl IntoIterator<Item = &'a ClusterNode>) -> String {
    let mut lines = String::new();
    for node in nodes {
        for line in node
            .log_text()
            .lines()
            .filter(|l| l.contains("node fenced"))
        {
            lines.push_str(&format!("{}: {line}\n", node.node_id));
        }
    }
    lines
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

    let fences = fence_lines(stayers.iter().chain([&leaver]));
    let values = check_counts(&attempts, 5, &fences);
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
    let fences = fence_lines(nodes.iter().chain(&retired));
    let values = check_counts(&attempts, 3, &fences);
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
