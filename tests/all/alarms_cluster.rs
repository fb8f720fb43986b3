//! Durable alarms across owner changes (issue 20 item 4), on the
//! in-process cluster with a controlled lease clock (`cluster.rs`), every
//! node over one shared store: an alarm whose owner crashes fires on the
//! new owner once it has taken the partition over (after the arbiter's
//! expiry), and one whose owner leaves gracefully fires on the node it
//! moved to; in both, exactly one handled firing is logged and the
//! single-ownership checker finds no two lives of a key at once.
//!
//! Alarm times are wall-clock times; the lease clock is the cluster's.

use std::time::Duration;

use fief::Instance;
use fief_tests::{eventually, guests, metric_value};

use crate::cluster::{Cluster, PARTITIONS, REACT, RENEW, STEP};

const REMINDERS: (&str, &str) = ("reminders", guests::REMINDERS);

async fn call(node: &Instance, key: &str, message: &str) -> Result<String, fief::Error> {
    node.call("reminders", key, message.as_bytes().to_vec())
        .await
        .map(|reply| String::from_utf8(reply).expect("a UTF-8 reply"))
}

/// `key`'s log of handled firings, read through `node` once it answers.
async fn fired_log(node: &Instance, key: &str) -> Vec<String> {
    for _ in 0..200 {
        if let Ok(log) = call(node, key, "fired").await {
            return log.lines().map(str::to_owned).collect();
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{key} never answered `fired`");
}

/// How many firings `node` saw committed.
async fn committed(node: &Instance) -> f64 {
    metric_value(
        &node.metrics_text().await,
        "fief_alarm_outcomes_total{outcome=\"committed\"}",
    )
    .unwrap_or(0.0)
}

/// Wait (at most 10 s) until `key`'s log has an entry; return the log.
async fn wait_for_firing(node: &Instance, key: &str) -> Vec<String> {
    for _ in 0..100 {
        let log = fired_log(node, key).await;
        if !log.is_empty() {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fired_log(node, key).await
}

/// The owner of a key with an alarm crashes before the alarm is due (a
/// `kill -9`, in process: no graceful stop, no lease release). Nothing
/// fires while no node serves the partition; after the arbiter's expiry
/// n1 takes the partition over, loads its alarms (raising the fence) and
/// fires the missed alarm once, late.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_alarm_whose_owner_crashed_fires_once_on_the_new_owner() {
    let mut c = Cluster::start(2, &[REMINDERS]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    call(c.node(1), &key, "set missed 300")
        .await
        .expect("the alarm is set through n1, on n0");
    let expiry = c.arbiter_expiry(0);
    c.crash(0).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Due now, but n1 does not serve the partition yet.
    assert_eq!(committed(c.node(1)).await, 0.0, "fired before the takeover");
    c.advance_to(expiry + RENEW).await;
    eventually(REACT, "n1 owns every partition", || {
        c.node(1).status().partitions_owned == PARTITIONS as usize
    })
    .await;
    let log = wait_for_firing(c.node(1), &key).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].starts_with("missed 1 "), "{log:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fired_log(c.node(1), &key).await.len(), 1, "fired twice");
    assert_eq!(committed(c.node(1)).await, 1.0);
    c.check();
}

/// The owner of a key with an alarm leaves gracefully before the alarm is
/// due: the partition moves to n1, which fires the alarm; n0 fires none.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_alarm_fires_on_the_node_its_key_moved_to() {
    let c = Cluster::start(2, &[REMINDERS]).await;
    c.stabilize().await;
    let key = c.key_owned_by(0).await;
    call(c.node(0), &key, "set moved 3000")
        .await
        .expect("the alarm is set on n0");
    let leave = c.node(0).leave(Duration::from_secs(30));
    let clock = async {
        for _ in 0..50 {
            c.clock.advance(STEP);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (left, ()) = tokio::join!(leave, clock);
    left.expect("n0 leaves");
    assert_eq!(c.node(0).status().partitions_owned, 0);
    let log = wait_for_firing(c.node(1), &key).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].starts_with("moved 1 "), "{log:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fired_log(c.node(1), &key).await.len(), 1, "fired twice");
    assert_eq!(
        committed(c.node(0)).await,
        0.0,
        "the node that left fired it"
    );
    assert_eq!(committed(c.node(1)).await, 1.0);
    c.check();
}
