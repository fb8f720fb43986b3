//! The kill path (contract §2 "The kill does not depend on guest code";
//! issue item 7; failure row 10 "infinite loop"): a key killed mid-callback
//! traps at the next epoch tick and its caller gets an error; a spinning key
//! does not stop other keys from being served; a key over its CPU limit is
//! killed without help; nothing a killed key armed (timers, subscriptions)
//! has any effect afterwards; and the next message starts a fresh process,
//! even when it is sent the moment the caller hears of the death.

use std::sync::Arc;
use std::time::Duration;

use fief::{Error, Instance, ModuleOptions};
use fief_tests::{
    call_text, eventually, eventually_async, guests, is_live, node_with, node_with_options,
    test_config,
};

/// A node with `spin` (CPU limit high enough that only a kill stops a
/// spinner) and `probe`.
async fn spin_node() -> Arc<Instance> {
    let spin = ModuleOptions {
        cpu_limit: Duration::from_secs(600),
        ..ModuleOptions::default()
    };
    let node = node_with_options(
        test_config(),
        &[
            ("spin", guests::SPIN, spin),
            ("probe", guests::PROBE, ModuleOptions::default()),
        ],
    )
    .await;
    Arc::new(node)
}

/// Start `key` of `spin` spinning in a task; returns once it is past its
/// last host call (it host-calls `probe/marker-<key>` right before the loop).
async fn start_spinning(
    node: &Arc<Instance>,
    key: &str,
) -> tokio::task::JoinHandle<fief::Result<Vec<u8>>> {
    let marker = format!("marker-{key}");
    let message = format!("spin-after-call probe {marker}").into_bytes();
    let task = tokio::spawn({
        let node = node.clone();
        let key = key.to_owned();
        async move { node.call("spin", &key, message).await }
    });
    eventually(
        Duration::from_secs(10),
        "the spinner reaches its loop",
        || is_live(node, "probe", &marker),
    )
    .await;
    task
}

/// The result of a pending call, which must end soon after a kill.
async fn ended(pending: tokio::task::JoinHandle<fief::Result<Vec<u8>>>) -> fief::Result<Vec<u8>> {
    tokio::time::timeout(Duration::from_secs(5), pending)
        .await
        .expect("the pending call ends soon after the kill")
        .expect("the calling task does not panic")
}

/// Check a pending call was answered with its key's death by a kill.
fn assert_killed(result: fief::Result<Vec<u8>>) {
    match result {
        Err(Error::KeyDied(why)) => assert!(why.contains("killed"), "{why}"),
        other => panic!("expected KeyDied, got {other:?}"),
    }
}

#[tokio::test]
async fn a_spinning_key_is_killed_and_its_caller_is_told_why() {
    let node = spin_node().await;
    let spinning = start_spinning(&node, "s").await;
    assert!(node.kill_key("spin", "s"), "the spinner was live");
    assert_killed(ended(spinning).await);
}

/// A guest killed mid-callback on its key's task traps at its next epoch
/// check, and its callback ends with that trap in the same poll that saw
/// the kill (unless the kill came while it was between two slices): the
/// end is still a kill
/// (an `info` "key killed" line naming the operator, counted with cause
/// `operator`), not a guest failure (a `warn` "key died" line counted as a
/// `trap`), which a dashboard would show as a crashing module.
#[test]
fn a_key_killed_mid_callback_is_logged_and_counted_as_a_kill() {
    use crate::hostile_logs::{count, run_captured};
    run_captured(|log| async move {
        let node = spin_node().await;
        // A cast runs on the key's own task (a call would run inline on
        // its caller's, whose kill takes another path).
        node.cast("spin", "s", b"spin-after-call probe marker-cast".to_vec())
            .expect("the cast is queued");
        eventually(
            Duration::from_secs(10),
            "the spinner reaches its loop",
            || is_live(&node, "probe", "marker-cast"),
        )
        .await;
        assert!(node.kill_key("spin", "s"), "the spinner was live");
        eventually(Duration::from_secs(10), "the key ended", || {
            !is_live(&node, "spin", "s")
        })
        .await;
        let text = log.since(0);
        assert!(
            count(&text, "key died") == 0
                && text
                    .lines()
                    .any(|l| l.contains("key killed") && l.contains("operator")),
            "the spinner's end is a kill:\n{text}"
        );
        let metrics = node.metrics_text().await;
        assert!(
            metrics.contains(r#"fief_key_kills_total{module="spin",cause="operator"} 1"#)
                && !metrics.contains(r#"fief_key_kills_total{module="spin",cause="trap"}"#),
            "{metrics}"
        );
    });
}

/// Guarantee 4: a message queued for a key that dies is answered with an
/// error, not replayed into the next process. A call waits in the spinner's
/// mailbox; the kill answers it (and the spinning call) with the key's
/// death, and only a message sent afterwards starts a fresh process.
#[tokio::test]
async fn a_message_queued_for_a_key_that_dies_is_answered_with_an_error_not_replayed() {
    let node = spin_node().await;
    let spinning = start_spinning(&node, "q").await;
    let queued = tokio::spawn({
        let node = node.clone();
        async move { node.call("spin", "q", b"ping".to_vec()).await }
    });
    // The queued call is in the mailbox once its bytes are charged to the
    // key (the spinning call's were given back when it was taken out).
    eventually(Duration::from_secs(10), "the call is queued", || {
        node.keys()
            .iter()
            .any(|k| k.module == "spin" && k.key == "q" && k.host_bytes > 0)
    })
    .await;
    assert!(node.kill_key("spin", "q"), "the spinner was live");
    assert_killed(ended(spinning).await);
    match ended(queued).await {
        Err(Error::KeyDied(_)) => {}
        other => panic!("the queued call must fail with the key's death, got {other:?}"),
    }
    // Nothing was replayed: the next message is the fresh process's first.
    assert_eq!(call_text(&node, "spin", "q", "ping").await, "pong");
}

#[tokio::test]
async fn a_key_killed_while_waiting_in_a_host_call_is_killed_at_once() {
    let node = spin_node().await;
    let waiting = tokio::spawn({
        let node = node.clone();
        async move {
            node.call("probe", "waiter", b"call spin s spin".to_vec())
                .await
        }
    });
    eventually(
        Duration::from_secs(10),
        "the waiter is in its host call",
        || is_live(&node, "spin", "s"),
    )
    .await;
    assert!(node.kill_key("probe", "waiter"));
    assert_killed(ended(waiting).await);
    node.kill_key("spin", "s");
}

#[tokio::test]
async fn other_keys_are_served_while_a_key_spins() {
    let node = spin_node().await;
    let spinning = start_spinning(&node, "s").await;
    assert_eq!(call_text(&node, "spin", "other", "ping").await, "pong");
    assert_eq!(call_text(&node, "probe", "other", "ping").await, "pong");
    assert!(!spinning.is_finished(), "the spinner was still spinning");
    node.kill_key("spin", "s");
    assert_killed(ended(spinning).await);
}

#[tokio::test]
async fn the_next_message_to_a_killed_key_starts_a_fresh_process() {
    let node = spin_node().await;
    let spinning = start_spinning(&node, "s").await;
    node.kill_key("spin", "s");
    assert_killed(ended(spinning).await);
    eventually(Duration::from_secs(5), "the killed process is gone", || {
        !is_live(&node, "spin", "s")
    })
    .await;
    assert_eq!(call_text(&node, "spin", "s", "ping").await, "pong");
}

/// A caller told its key died may retry at once: the answer comes only
/// once the dead process is gone, so the retry starts a fresh one instead
/// of finding the ending one ("the message was not processed"). The key is
/// idle, so each trapping call runs inline on this task; repeated because
/// the key's task, left to run late, loses the race only sometimes.
#[tokio::test]
async fn a_call_right_after_a_trap_reaches_a_fresh_process() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    for round in 0..20 {
        assert_eq!(call_text(&node, "probe", "k", "ping").await, "pong");
        let err = node
            .call("probe", "k", b"panic".to_vec())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::KeyDied(_)), "round {round}: {err}");
        let retry = node.call("probe", "k", b"ping".to_vec()).await;
        assert_eq!(
            retry.map_err(|e| e.to_string()),
            Ok(b"pong".to_vec()),
            "round {round}: the retry right after the trap"
        );
    }
    node.shutdown().await;
}

#[tokio::test]
async fn killing_a_key_that_is_not_live_reports_false() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert!(!node.kill_key("probe", "nobody"));
    assert!(!node.kill_key("nosuch", "nobody"));
    node.shutdown().await;
}

#[tokio::test]
async fn a_key_over_its_cpu_limit_is_killed_without_help() {
    let spin = ModuleOptions {
        cpu_limit: Duration::from_millis(50),
        ..ModuleOptions::default()
    };
    let node = node_with_options(test_config(), &[("spin", guests::SPIN, spin)]).await;
    let result = node.call("spin", "s", b"spin".to_vec()).await;
    match result {
        Err(Error::KeyDied(why)) => assert!(why.contains("CPU limit"), "{why}"),
        other => panic!("expected KeyDied, got {other:?}"),
    }
    eventually(Duration::from_secs(5), "the dead process is gone", || {
        !is_live(&node, "spin", "s")
    })
    .await;
    assert_eq!(call_text(&node, "spin", "s", "ping").await, "pong");
    node.shutdown().await;
}

#[tokio::test]
async fn a_killed_keys_timer_never_fires() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    call_text(&node, "probe", "k", "after 200 t").await;
    assert!(node.kill_key("probe", "k"));
    eventually(Duration::from_secs(5), "the killed process is gone", || {
        !is_live(&node, "probe", "k")
    })
    .await;
    assert_eq!(
        call_text(&node, "probe", "k", "events").await,
        "",
        "a fresh process"
    );
    // Once a timer armed later for longer has fired, the killed key's timer
    // would have fired too.
    call_text(&node, "probe", "control", "after 300 c").await;
    eventually_async(
        Duration::from_secs(5),
        "the control timer fires",
        || async { call_text(&node, "probe", "control", "events").await == "timer:c" },
    )
    .await;
    assert_eq!(call_text(&node, "probe", "k", "events").await, "");
    node.shutdown().await;
}

#[tokio::test]
async fn a_killed_keys_subscription_is_removed() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    call_text(&node, "probe", "reader", "subscribe news").await;
    assert_eq!(
        call_text(&node, "probe", "writer", "publish news one").await,
        "1"
    );
    assert!(node.kill_key("probe", "reader"));
    eventually(Duration::from_secs(5), "the killed process is gone", || {
        !is_live(&node, "probe", "reader")
    })
    .await;
    assert_eq!(
        call_text(&node, "probe", "writer", "publish news two").await,
        "0"
    );
    node.shutdown().await;
}
