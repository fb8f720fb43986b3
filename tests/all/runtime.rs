//! The single-node key runtime (contract §3 "Key runtime"; issue items:
//! activation, ordering, idle): a key is activated by its first message, its
//! messages are processed one at a time in arrival order, keys are
//! independent, a graceful stop hands off state, idle keys are retired, and an
//! `init` refusal fails only that activation.

use std::time::Duration;

use fief::{Error, ModuleOptions, StopReason};
use fief_tests::{
    call_text, eventually, guests, is_live, node_with, node_with_options, test_config,
};

#[tokio::test]
async fn counter_counts_per_key() {
    let node = node_with(&[("counter", guests::COUNTER)]).await;
    assert_eq!(call_text(&node, "counter", "alice", "incr").await, "1");
    assert_eq!(call_text(&node, "counter", "alice", "incr").await, "2");
    assert_eq!(call_text(&node, "counter", "bob", "get").await, "0");
    node.shutdown().await;
}

#[tokio::test]
async fn a_key_is_activated_by_its_first_message() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert!(node.keys().is_empty(), "no key is live before any message");
    assert_eq!(call_text(&node, "probe", "alice", "ping").await, "pong");
    let keys = node.keys();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(
        (keys[0].module.as_str(), keys[0].key.as_str()),
        ("probe", "alice")
    );
    node.shutdown().await;
}

#[tokio::test]
async fn a_keys_messages_are_processed_in_order() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    for n in 0..50 {
        node.cast("probe", "k", format!("record {n}").into_bytes())
            .unwrap();
    }
    let events = call_text(&node, "probe", "k", "events").await;
    let expected: Vec<String> = (0..50).map(|n| format!("cast:record {n}")).collect();
    assert_eq!(events.lines().collect::<Vec<_>>(), expected);
    node.shutdown().await;
}

#[tokio::test]
async fn a_cast_is_processed_without_a_reply() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    node.cast("probe", "k", b"hello".to_vec()).unwrap();
    assert_eq!(call_text(&node, "probe", "k", "events").await, "cast:hello");
    node.shutdown().await;
}

#[tokio::test]
async fn keys_are_independent() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    node.cast("probe", "a", b"for-a".to_vec()).unwrap();
    node.cast("probe", "b", b"for-b".to_vec()).unwrap();
    assert_eq!(call_text(&node, "probe", "a", "events").await, "cast:for-a");
    assert_eq!(call_text(&node, "probe", "b", "events").await, "cast:for-b");
    assert_eq!(call_text(&node, "probe", "c", "events").await, "");
    node.shutdown().await;
}

#[tokio::test]
async fn a_handoff_stop_returns_the_state_and_the_next_message_starts_afresh() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    node.cast("probe", "k", b"one".to_vec()).unwrap();
    node.cast("probe", "k", b"two".to_vec()).unwrap();
    assert_eq!(
        call_text(&node, "probe", "k", "events").await,
        "cast:one\ncast:two"
    );

    let state = node
        .stop_key("probe", "k", StopReason::Handoff)
        .await
        .unwrap();
    assert_eq!(state.as_deref(), Some(&b"probe-handoff:2"[..]));
    assert!(!is_live(&node, "probe", "k"), "a stopped key is not live");

    assert_eq!(
        call_text(&node, "probe", "k", "events").await,
        "",
        "a fresh process"
    );
    assert_eq!(call_text(&node, "probe", "k", "init-state").await, "none");
    node.shutdown().await;
}

#[tokio::test]
async fn stopping_a_key_that_is_not_live_returns_none() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let state = node
        .stop_key("probe", "nobody", StopReason::Handoff)
        .await
        .unwrap();
    assert_eq!(state, None);
    node.shutdown().await;
}

#[tokio::test]
async fn an_idle_key_is_retired_but_a_key_with_an_armed_timer_is_not() {
    let options = ModuleOptions {
        idle_timeout: Duration::from_millis(200),
        ..ModuleOptions::default()
    };
    let node = node_with_options(test_config(), &[("probe", guests::PROBE, options)]).await;
    assert_eq!(call_text(&node, "probe", "idle", "ping").await, "pong");
    call_text(&node, "probe", "waiting", "after 60000 t").await;
    assert!(is_live(&node, "probe", "idle"));

    eventually(Duration::from_secs(10), "the idle key is retired", || {
        !is_live(&node, "probe", "idle")
    })
    .await;
    // Four more idle timeouts: a key with an armed timer is still not idle.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        is_live(&node, "probe", "waiting"),
        "a key with an armed timer must not be retired as idle"
    );
    node.shutdown().await;
}

/// A message that reaches a key while it runs `terminate(idle)` waits for
/// that process's store to be dropped, then starts the next one: there is
/// never a second process of the key beside the retiring one (guarantee 1;
/// the entry used to be removed before `terminate` ran, and this message
/// started a second process at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_during_an_idle_terminate_waits_for_the_next_process() {
    let lives = crate::fence_modes::Lives::default();
    let options = ModuleOptions {
        idle_timeout: Duration::from_millis(200),
        ..ModuleOptions::default()
    };
    let node = crate::fence_modes::observed_node(
        test_config(),
        &lives,
        &[("hostile", guests::HOSTILE, options)],
    )
    .await;
    let key = "slow-terminate";
    assert_eq!(call_text(&node, "hostile", key, "ping").await, "pong");
    // Its terminate(idle) has begun (and blocks for 1.5 s).
    fief_tests::slow_terminate_begun(&node, key).await;
    assert_eq!(call_text(&node, "hostile", key, "ping").await, "pong");
    let events = lives.of("hostile", key);
    use fief::KeyLifeEvent::{Ended, Started};
    assert_eq!(
        events.get(..3),
        Some(&[Started, Ended, Started][..]),
        "the second process started only after the first ended: {events:?}"
    );
    crate::hostile::stop(node).await;
}

#[tokio::test]
async fn an_init_refusal_fails_that_activation_only() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let err = node
        .call("probe", "refuse-x", b"ping".to_vec())
        .await
        .unwrap_err();
    match &err {
        Error::InitRefused(why) => assert!(why.contains("refusing key refuse-x"), "{why}"),
        other => panic!("expected InitRefused, got {other:?}"),
    }
    assert!(
        !is_live(&node, "probe", "refuse-x"),
        "a refused key is not live"
    );
    assert_eq!(call_text(&node, "probe", "other", "ping").await, "pong");
    node.shutdown().await;
}
