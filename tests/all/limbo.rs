//! The survivor lifecycle (`docs/fencing.md`, the fence-mode page, "The
//! survivor lifecycle"; contract §3 "Limbo", §5 rows 6 and 7).
//!
//! Survivors (`continue` keys, and `callback` keys that answered
//! `continue`) live in the instance's limbo, outside their partitions' kill
//! tree. They outlive a crash of the node's coordination; they die with the
//! instance and with limbo's own bookkeeper; and they are reaped when the
//! node next initializes their partition, before a fresh process for the key
//! can start there. Every test watches the key processes' lives through a
//! [`KeyLife`](fief::KeyLife) observer.

use std::time::Duration;

use fief::core::OnFence;
use fief::{Error, KeyLifeEvent, LeaseState, ModuleOptions, NodeConfig};
use fief_tests::{call_text, eventually, eventually_async, guests, test_config};

use crate::fence_modes::{
    Lives, PATIENCE, in_limbo, local, local_ok, mode, observed_node, steady_config,
};

/// A node configuration that rejoins soon after a fence: lease TTL 3 s,
/// renewed every 500 ms, fence margin 1 s. A fenced node can rejoin once the
/// arbiter has expired its old lease, at most about 3 s after the fence.
fn rejoining_config() -> NodeConfig {
    NodeConfig {
        lease_ttl: Duration::from_secs(3),
        renew_interval: Duration::from_millis(500),
        fence_margin: Duration::from_secs(1),
        call_timeout: Duration::from_secs(30),
        ..test_config()
    }
}

/// The modules of these tests: `cache` (probe, `continue`), `cb` (probe,
/// `callback`) and `plain` (probe, `terminate`).
fn modules() -> [(&'static str, &'static str, ModuleOptions); 3] {
    [
        ("cache", guests::PROBE, mode(OnFence::Continue)),
        ("cb", guests::PROBE, mode(OnFence::Callback)),
        ("plain", guests::PROBE, ModuleOptions::default()),
    ]
}

/// The page: survivors live in a limbo "which is what lets them outlive the
/// fence — and Fief's own kernel restarts (a crashed coordination process
/// fences the node, which is exactly when survivors must keep living)";
/// contract §5 row 6: "node's coordination crashes → node fences;
/// continue/callback survivors live on in limbo". The coordination loop
/// panics: the node fences, its terminate key is killed, and both survivors
/// are in limbo and still answer through their local handles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_outlive_a_coordination_crash() {
    let lives = Lives::default();
    let node = observed_node(steady_config(), &lives, &modules()).await;
    assert_eq!(call_text(&node, "cache", "c", "subscribe T").await, "ok");
    assert_eq!(call_text(&node, "cb", "k", "on-fence continue").await, "ok");
    assert_eq!(call_text(&node, "plain", "t", "ping").await, "pong");

    node.inject_coordination_crash();
    eventually(PATIENCE, "the node fences", || {
        node.status().lease != LeaseState::Current && node.status().fences >= 1
    })
    .await;
    eventually(PATIENCE, "the terminate key is killed", || {
        lives.ended("plain", "t")
    })
    .await;
    assert!(node.keys().is_empty());
    let limbo = node.limbo().await;
    assert_eq!(
        limbo
            .iter()
            .map(|e| (e.module.as_str(), e.key.as_str(), e.mode.as_str()))
            .collect::<Vec<_>>(),
        vec![("cache", "c", "continue"), ("cb", "k", "callback")]
    );
    assert_eq!(local_ok(&node, "cache", "c", "ping").await, "pong");
    eventually_async(PATIENCE, "k answered handle-fence", || async {
        local_ok(&node, "cb", "k", "events").await == "fence:50"
    })
    .await;
    // The survivors still act (publish, receive): they live on, fully.
    assert_eq!(local_ok(&node, "cb", "k", "publish T alive").await, "1");
    eventually_async(PATIENCE, "c received it", || async {
        local_ok(&node, "cache", "c", "events").await == "pub:T:alive"
    })
    .await;
    assert_eq!(
        node.call("cache", "c", b"ping".to_vec()).await,
        Err(Error::Fenced)
    );
    for (module, key) in [("cache", "c"), ("cb", "k")] {
        assert_eq!(lives.of(module, key), vec![KeyLifeEvent::Started]);
    }
}

/// Issue 18 item 5: a crashed coordination loop is restarted. The loop
/// panics: the node fences, kills its `terminate` key and keeps its
/// survivor in limbo; one lease TTL later the loop runs again, the node
/// rejoins with a fresh lease and serves calls again, and the fence was the
/// only one. With the loop left dead the node stayed fenced until its
/// process restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashed_coordination_loop_is_restarted_and_the_node_serves_again() {
    let lives = Lives::default();
    let node = observed_node(rejoining_config(), &lives, &modules()).await;
    assert_eq!(call_text(&node, "plain", "t", "ping").await, "pong");
    assert_eq!(call_text(&node, "cache", "c", "ping").await, "pong");

    node.inject_coordination_crash();
    eventually(PATIENCE, "the node fences", || node.status().fences >= 1).await;
    eventually(PATIENCE, "the terminate key is killed", || {
        lives.ended("plain", "t")
    })
    .await;
    assert!(
        in_limbo(&node, "cache", "c").await.is_some(),
        "the survivor is in limbo"
    );

    // Lease TTL 3 s: the loop restarts after it, then the node rejoins.
    eventually_async(
        Duration::from_secs(30),
        "the node serves again after the restart",
        || async {
            node.status().lease == LeaseState::Current
                && node.call("plain", "t", b"ping".to_vec()).await == Ok(b"pong".to_vec())
        },
    )
    .await;
    // The crash fenced once and the loop restarted once. Counted by cause:
    // on a loaded machine the rejoined node may also miss a renewal, and a
    // fence for that is the lease doing its job, not the restart's doing.
    let metrics = node.metrics_text().await;
    let value = |series: &str| fief_tests::metric_value(&metrics, series);
    assert_eq!(
        value(r#"fief_fences_total{cause="coordination_crash"}"#),
        Some(1.0),
        "the restart fenced only once:\n{metrics}"
    );
    assert_eq!(
        value("fief_coordination_restarts_total"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        lives.of("plain", "t"),
        vec![
            KeyLifeEvent::Started,
            KeyLifeEvent::Ended,
            KeyLifeEvent::Started
        ],
        "the terminate key was killed at the fence and started afresh after the rejoin"
    );
}

/// The page: "Two things do end a survivor early: instance shutdown, and …
/// a crash of the limbo's own bookkeeper"; contract §3: "survivors die with
/// instance shutdown". After `shutdown` returns, both survivors' lives have
/// ended (their stores were dropped).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_die_with_the_instance() {
    let lives = Lives::default();
    let node = observed_node(steady_config(), &lives, &modules()).await;
    assert_eq!(call_text(&node, "cache", "c", "ping").await, "pong");
    assert_eq!(call_text(&node, "cb", "k", "on-fence continue").await, "ok");
    node.fence_now();
    eventually_async(PATIENCE, "both are in limbo, k answered", || async {
        node.limbo().await.len() == 2 && local_ok(&node, "cb", "k", "events").await == "fence:50"
    })
    .await;
    assert!(!lives.ended("cache", "c") && !lives.ended("cb", "k"));

    let node = std::sync::Arc::try_unwrap(node).unwrap_or_else(|_| panic!("one handle"));
    node.shutdown().await;
    for (module, key) in [("cache", "c"), ("cb", "k")] {
        assert_eq!(
            lives.of(module, key),
            vec![KeyLifeEvent::Started, KeyLifeEvent::Ended],
            "{module}/{key} died with the instance"
        );
    }
}

/// The page: "a deliberate, should-never-happen exception — a crash of the
/// limbo's own bookkeeper, whose entry map is what makes survivors
/// reapable; rather than risk unreapable survivors (a double-serve hole),
/// the bookkeeper and its survivors share a fate"; contract §5 row 7:
/// "limbo bookkeeper crashes → its survivors die with it". After the
/// injected crash, both survivors' lives end, `limbo()` is empty and their
/// local handles fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_die_with_the_limbo_bookkeeper() {
    let lives = Lives::default();
    let node = observed_node(steady_config(), &lives, &modules()).await;
    assert_eq!(call_text(&node, "cache", "c", "ping").await, "pong");
    assert_eq!(call_text(&node, "cb", "k", "on-fence continue").await, "ok");
    node.fence_now();
    eventually_async(PATIENCE, "both are in limbo, k answered", || async {
        node.limbo().await.len() == 2 && local_ok(&node, "cb", "k", "events").await == "fence:50"
    })
    .await;

    node.inject_limbo_crash();
    eventually(PATIENCE, "both survivors died with the bookkeeper", || {
        lives.ended("cache", "c") && lives.ended("cb", "k")
    })
    .await;
    assert!(node.limbo().await.is_empty());
    assert!(local(&node, "cache", "c", "ping").await.is_err());
    assert!(local(&node, "cb", "k", "ping").await.is_err());
    for (module, key) in [("cache", "c"), ("cb", "k")] {
        assert_eq!(
            lives.of(module, key),
            vec![KeyLifeEvent::Started, KeyLifeEvent::Ended]
        );
    }
}

/// The fate-sharing's other half (`host/src/limbo.rs`, "a survivor nobody
/// could reap must not live"; the page: the bookkeeper's "entry map is what
/// makes survivors reapable"): once the bookkeeper is gone, a `continue` key
/// does not survive the node's next fence at all. The bookkeeper crashes,
/// then a `continue` key is activated and the node fences: the key is
/// killed at the fence like a terminate key, and nothing is in limbo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_bookkeeper_no_key_survives_a_fence() {
    let lives = Lives::default();
    let node = observed_node(steady_config(), &lives, &modules()).await;
    node.inject_limbo_crash();
    assert!(node.limbo().await.is_empty());
    assert_eq!(call_text(&node, "cache", "c", "ping").await, "pong");

    node.fence_now();
    eventually(PATIENCE, "the would-be survivor is killed", || {
        lives.ended("cache", "c")
    })
    .await;
    assert!(node.limbo().await.is_empty());
    assert!(local(&node, "cache", "c", "ping").await.is_err());
    assert!(node.keys().is_empty());
}

/// The page: survivors "are reaped when the same node next initializes that
/// key's vnode — so one node never hosts a survivor and a fresh serving
/// process for the same key"; contract §3 "reaped when the same node next
/// initializes that key's partition". After `fence_now` the embedded node
/// rejoins (once the arbiter has expired its old lease) and gets its
/// partitions again: both survivors leave limbo, their lives end, and only
/// then does a routed call start a fresh process for the key (its `events`
/// are empty: not the survivor's state).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivors_are_reaped_when_their_partition_is_initialized_again() {
    let lives = Lives::default();
    let node = observed_node(rejoining_config(), &lives, &modules()).await;
    node.cast("cache", "r", b"record before".to_vec()).unwrap();
    assert_eq!(
        call_text(&node, "cache", "r", "events").await,
        "cast:record before"
    );
    assert_eq!(call_text(&node, "cb", "k", "on-fence continue").await, "ok");

    node.fence_now();
    assert!(in_limbo(&node, "cache", "r").await.is_some());
    assert_eq!(
        local_ok(&node, "cache", "r", "events").await,
        "cast:record before"
    );

    eventually_async(PATIENCE, "the node rejoined and reaped limbo", || async {
        node.status().lease == LeaseState::Current
            && node.limbo().await.is_empty()
            && lives.ended("cache", "r")
            && lives.ended("cb", "k")
    })
    .await;
    eventually_async(PATIENCE, "r is served again", || async {
        node.call("cache", "r", b"events".to_vec()).await.is_ok()
    })
    .await;
    assert_eq!(
        call_text(&node, "cache", "r", "events").await,
        "",
        "a fresh process, not the survivor"
    );
    assert_eq!(
        lives.of("cache", "r"),
        vec![
            KeyLifeEvent::Started,
            KeyLifeEvent::Ended,
            KeyLifeEvent::Started
        ]
    );
    let records = lives.records("cache", "r");
    assert!(
        records[1].at <= records[2].at,
        "the survivor ended before the fresh process started"
    );
    assert_eq!(call_text(&node, "cb", "k", "events").await, "");
    assert_eq!(
        lives.of("cb", "k"),
        vec![
            KeyLifeEvent::Started,
            KeyLifeEvent::Ended,
            KeyLifeEvent::Started
        ]
    );
}
