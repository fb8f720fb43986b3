//! Cluster-wide pub/sub (issue 21 item 1) on the in-process cluster with a
//! controlled lease clock (`cluster.rs`): nodes talk over real loopback
//! sockets and advertise their topics to each other.
//!
//! - a publication made on any node reaches every subscriber on every node,
//!   once, and a node's publications reach a subscriber in the order they
//!   were made there;
//! - a node that fenced takes no forwarded publication (the sender counts
//!   it dropped, `reason="fenced"`), and its interest goes with its lease:
//!   once the arbiter expired it, the others forward nothing to it;
//! - when the fenced node rejoins, interest is exchanged again (a new
//!   stream both ways) and its publications reach the others' subscribers.

use std::time::Duration;

use fief::core::OnFence;
use fief::{Instance, ModuleOptions};
use fief_tests::{eventually_async, guests, metric_value};

use crate::cluster::{Cluster, REACT, RENEW, STEP};

const PROBE: (&str, &str) = ("probe", guests::PROBE);

async fn call(node: &Instance, key: &str, message: &str) -> String {
    let reply = node
        .call("probe", key, message.as_bytes().to_vec())
        .await
        .unwrap_or_else(|e| panic!("{key} {message:?}: {e}"));
    String::from_utf8(reply).expect("a UTF-8 reply")
}

/// The publications `key`'s process received, in order (payloads of
/// topic `t`).
async fn received(node: &Instance, key: &str) -> Vec<String> {
    call(node, key, "events")
        .await
        .lines()
        .filter_map(|event| event.strip_prefix("pub:t:"))
        .map(str::to_owned)
        .collect()
}

/// Publish warm-ups of `t` from `key` through `node` until the publication
/// counts `subscribers` (every node's interest has reached `node`).
async fn wait_for_subscribers(node: &Instance, key: &str, subscribers: u32) {
    let want = subscribers.to_string();
    eventually_async(
        REACT,
        "every node's interest reached the publisher",
        || async { call(node, key, "publish t warmup").await == want },
    )
    .await;
}

async fn metric(node: &Instance, series: &str) -> f64 {
    metric_value(&node.metrics_text().await, series).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publication_reaches_every_subscriber_on_every_node_once_and_in_order() {
    let c = Cluster::start(3, &[PROBE]).await;
    c.stabilize().await;
    let mut keys = Vec::new();
    for i in 0..3 {
        let key = c.key_owned_by(i).await;
        assert_eq!(call(c.node(i), &key, "subscribe t").await, "ok");
        keys.push(key);
    }
    for (i, key) in keys.iter().enumerate() {
        wait_for_subscribers(c.node(i), key, 3).await;
    }
    let mut sent = Vec::new();
    for round in 0..10 {
        for (i, key) in keys.iter().enumerate() {
            let payload = format!("m{i}-{round}");
            let count = call(c.node(i), key, &format!("publish t {payload}")).await;
            assert_eq!(count, "3", "{payload}: the count is every subscriber");
            sent.push(payload);
        }
    }
    for (i, key) in keys.iter().enumerate() {
        let node = c.node(i);
        eventually_async(REACT, "every publication arrived", || async {
            let got = received(node, key).await;
            sent.iter().all(|payload| got.contains(payload))
        })
        .await;
        // Late copies, if any, would arrive within this.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let got: Vec<String> = received(node, key)
            .await
            .into_iter()
            .filter(|payload| payload != "warmup")
            .collect();
        assert_eq!(
            got.len(),
            sent.len(),
            "n{i}'s subscriber got each once: {got:?}"
        );
        for from in 0..3 {
            let prefix = format!("m{from}-");
            let order: Vec<&String> = got.iter().filter(|p| p.starts_with(&prefix)).collect();
            let made: Vec<&String> = sent.iter().filter(|p| p.starts_with(&prefix)).collect();
            assert_eq!(order, made, "n{from}'s publications reach n{i} in order");
        }
    }
    for i in 0..3 {
        let forwarded = metric(c.node(i), "fief_publications_forwarded_total").await;
        assert!(forwarded >= 20.0, "n{i} forwarded {forwarded}");
        assert_eq!(
            c.node(i).status().remote_topics,
            2,
            "n{i} knows both peers' topic"
        );
    }
    c.check();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_node_takes_no_forwarded_publication_and_its_interest_goes_with_its_lease() {
    // `continue`: n1's subscriber survives its node's fence in limbo, still
    // subscribed, so n1's interest stays advertised until its lease expires
    // (a `terminate` key is killed at the fence and unsubscribes at once).
    let survive = ModuleOptions {
        on_fence: OnFence::Continue,
        ..ModuleOptions::default()
    };
    let c = Cluster::start_with_options(2, &[("probe", guests::PROBE, survive)]).await;
    c.stabilize().await;
    let (k0, k1) = (c.key_owned_by(0).await, c.key_owned_by(1).await);
    assert_eq!(call(c.node(0), &k0, "subscribe t").await, "ok");
    assert_eq!(call(c.node(1), &k1, "subscribe t").await, "ok");
    wait_for_subscribers(c.node(0), &k0, 2).await;
    wait_for_subscribers(c.node(1), &k1, 2).await;

    // n1 loses the arbiter: it fences at its fence point, a margin before
    // the arbiter expires its lease; meanwhile n0 still counts it a member.
    let expiry = c.arbiter_expiry(1);
    c.set_arbiter_reachable(1, false);
    c.advance_to(expiry - 2 * STEP).await;
    assert_ne!(
        c.node(1).status().lease,
        fief::LeaseState::Current,
        "n1 fenced"
    );
    let received_before = metric(c.node(1), "fief_publications_received_total").await;
    let reply = call(c.node(0), &k0, "publish t after-fence").await;
    assert_eq!(
        reply, "2",
        "n0 still has n1's interest until its lease expires"
    );
    let n0 = c.node(0);
    eventually_async(REACT, "n0 saw n1 refuse the publication", || async {
        metric(n0, "fief_publications_dropped_total{reason=\"fenced\"}").await >= 1.0
    })
    .await;
    assert_eq!(
        metric(c.node(1), "fief_publications_received_total").await,
        received_before,
        "a fenced node delivers nothing forwarded"
    );

    // Past the arbiter's expiry n1 is no member: its interest is gone.
    c.advance_to(expiry + STEP).await;
    eventually_async(REACT, "n0 dropped n1's interest", || async {
        call(n0, &k0, "publish t alone").await == "1" && n0.status().remote_topics == 0
    })
    .await;

    // n1 comes back with a new lease: interest flows both ways again. (Its
    // survivor stays in limbo, no longer served: another key publishes.)
    c.set_arbiter_reachable(1, true);
    c.stabilize().await;
    // The leader hands n1 its share over the next rounds.
    for _ in 0..30 {
        if c.arbiter_owners().await.get("n1").is_some_and(|&n| n > 0) {
            break;
        }
        c.advance(RENEW).await;
    }
    let k1 = c.key_owned_by_except(1, &[&k1]).await;
    assert_eq!(call(c.node(1), &k1, "subscribe t").await, "ok");
    wait_for_subscribers(c.node(1), &k1, 2).await;
    wait_for_subscribers(c.node(0), &k0, 2).await;
    assert_eq!(call(c.node(1), &k1, "publish t back").await, "2");
    eventually_async(
        REACT,
        "n1's publication reached n0's subscriber",
        || async { received(n0, &k0).await.contains(&"back".to_owned()) },
    )
    .await;
    let got = received(n0, &k0).await;
    let copies = got.iter().filter(|p| *p == "after-fence").count();
    assert_eq!(copies, 1, "n0's own subscriber got it once: {got:?}");
    c.check();
}
