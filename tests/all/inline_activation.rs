//! Inline activations (issue 20, reactivation): a routed call to a key with
//! no live process starts the process on the caller's task and runs on it
//! there, with no hop to a guest thread and back; a long `init` goes on on
//! the guest threads from its first epoch tick, and a kill or a refusal ends
//! it as it would end a start on the key's task.

use std::sync::Arc;
use std::time::Duration;

use fief::{Error, ModuleOptions};
use fief_tests::{call_text, guests, is_live, metric_value, test_config};

use crate::fence_modes::{Lives, observed_node};
use crate::hostile::{hostile_options, stop};

/// The CPU time this thread has used (`/proc/thread-self/schedstat`, first
/// field, nanoseconds).
fn thread_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    let nanos = stat
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .expect("schedstat's first field");
    Duration::from_nanos(nanos)
}

/// The first call to a key starts it on the caller's task: it is counted in
/// `fief_calls_inline_total` (before, an activation always went through the
/// key's mailbox and its task on a guest thread, and the counter stayed at
/// 0), it answers, and the key has one process, started once.
#[tokio::test]
async fn a_call_to_an_absent_key_starts_it_on_the_callers_task() {
    let lives = Lives::default();
    let node = observed_node(
        test_config(),
        &lives,
        &[("counter", guests::COUNTER, ModuleOptions::default())],
    )
    .await;
    assert_eq!(call_text(&node, "counter", "ada", "incr").await, "1");
    let inline = metric_value(
        &node.metrics_text().await,
        r#"fief_calls_inline_total{module="counter"}"#,
    );
    assert_eq!(inline, Some(1.0), "the activating call ran inline");
    assert!(is_live(&node, "counter", "ada"));
    assert_eq!(call_text(&node, "counter", "ada", "incr").await, "2");
    assert_eq!(
        lives.of("counter", "ada"),
        vec![fief::KeyLifeEvent::Started],
        "one process"
    );
    stop(node).await;
}

/// An activation whose `init` runs past its first epoch tick goes on on the
/// guest threads (it is demoted, as a long inline call is): the caller's
/// thread (this test's only one) spends about a tick on it, not the second of
/// CPU the looping `init` burns before its `cpu_limit` kills it. Measured in
/// the thread's CPU time, so load on the machine does not move it. Without
/// the demotion the caller's thread ran the whole loop, a slice at a time.
#[tokio::test]
async fn a_long_init_goes_on_on_the_guest_threads() {
    let cpu_limit = Duration::from_secs(1);
    // On a loaded machine the loop's second of ticks takes longer than the
    // default call timeout.
    let config = fief::NodeConfig {
        call_timeout: Duration::from_secs(120),
        ..test_config()
    };
    let node = Arc::new(
        fief_tests::node_with_options(
            config,
            &[
                (
                    "hostile",
                    guests::HOSTILE,
                    ModuleOptions {
                        cpu_limit,
                        ..hostile_options()
                    },
                ),
                ("probe", guests::PROBE, ModuleOptions::default()),
            ],
        )
        .await,
    );
    let before = thread_cpu();
    let died = node.call("hostile", "loop-init-1", b"ping".to_vec()).await;
    let used = thread_cpu() - before;
    match died {
        Err(Error::KeyDied(why)) => assert!(why.contains("CPU limit exceeded"), "{why}"),
        other => panic!("expected KeyDied, got {other:?}"),
    }
    assert!(
        used < cpu_limit / 2,
        "the caller's thread ran {used:?} of the {cpu_limit:?} init"
    );
    assert_eq!(call_text(&node, "probe", "bystander", "ping").await, "pong");
    stop(node).await;
}

/// A kill while an activation's `init` runs ends the activation: its caller
/// hears why, the key is not live once the caller has heard, and the next
/// call starts a fresh process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_during_an_activation_ends_it() {
    let node = crate::hostile::node(ModuleOptions {
        cpu_limit: Duration::from_secs(60),
        ..hostile_options()
    })
    .await;
    let caller = {
        let node = node.clone();
        tokio::spawn(async move { node.call("hostile", "loop-init-2", b"ping".to_vec()).await })
    };
    fief_tests::eventually(Duration::from_secs(10), "the key is live", || {
        is_live(&node, "hostile", "loop-init-2")
    })
    .await;
    assert!(node.kill_key("hostile", "loop-init-2"));
    let reply = tokio::time::timeout(Duration::from_secs(10), caller)
        .await
        .expect("the killed activation answers")
        .expect("the caller's task");
    match reply {
        Err(Error::KeyDied(why)) => assert!(why.contains("killed"), "{why}"),
        other => panic!("expected KeyDied, got {other:?}"),
    }
    fief_tests::eventually(Duration::from_secs(10), "the key is gone", || {
        !is_live(&node, "hostile", "loop-init-2")
    })
    .await;
    assert_eq!(call_text(&node, "probe", "bystander", "ping").await, "pong");
    stop(node).await;
}

/// A refused `init` is answered once the key's entry is gone: a retry at
/// once starts a fresh activation (refused again, with the key's own
/// words), never a message queued on the refused one.
#[tokio::test]
async fn a_refused_activation_is_answered_once_its_entry_is_gone() {
    let node = Arc::new(fief_tests::node_with(&[("probe", guests::PROBE)]).await);
    for _ in 0..3 {
        match node.call("probe", "refuse-y", b"ping".to_vec()).await {
            Err(Error::InitRefused(why)) => assert!(why.contains("refusing key refuse-y"), "{why}"),
            other => panic!("expected InitRefused, got {other:?}"),
        }
        assert!(
            !is_live(&node, "probe", "refuse-y"),
            "a refused key is not live"
        );
    }
    stop(node).await;
}
