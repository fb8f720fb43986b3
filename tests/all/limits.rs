//! Resource limits against a hostile guest (contract §3 "Module registry"
//! options; failure row 10 "memory bomb, deep recursion, huge reply"; issue
//! item 10): each limit kills or refuses only the offending key, and every
//! other key keeps being served.

use std::time::Duration;

use fief::config::ByteSize;
use fief::{Error, Instance, ModuleOptions, NodeConfig};
use fief_tests::{call_text, guests, node_with_options, test_config};

const MESSAGE_LIMIT: usize = 64 * 1024;

/// A node with `max_message_size = 64KiB` and `bomb` deployed with a 16 MiB
/// memory limit and 10 timers per key. The CPU limit is generous so that
/// each bomb meets the limit it aims at, not the CPU limit.
async fn bomb_node() -> Instance {
    let config = NodeConfig {
        max_message_size: ByteSize::b(MESSAGE_LIMIT as u64),
        ..test_config()
    };
    let options = ModuleOptions {
        memory_limit: ByteSize::mib(16),
        max_timers_per_key: 10,
        cpu_limit: Duration::from_secs(10),
        ..ModuleOptions::default()
    };
    node_with_options(config, &[("bomb", guests::BOMB, options)]).await
}

/// Another key answers: the node is unaffected.
async fn others_still_served(node: &Instance) {
    assert_eq!(call_text(node, "bomb", "bystander", "ping").await, "pong");
}

/// `KeyDied`'s text, or a panic naming what came instead.
fn key_died(result: fief::Result<Vec<u8>>) -> String {
    match result {
        Err(Error::KeyDied(why)) => why,
        other => panic!("expected KeyDied, got {:?}", other.map(|r| r.len())),
    }
}

#[tokio::test]
async fn a_memory_bomb_is_killed_at_its_memory_limit() {
    let node = bomb_node().await;
    let why = key_died(node.call("bomb", "b", b"memory".to_vec()).await);
    assert!(why.contains("memory limit"), "{why}");
    others_still_served(&node).await;
    node.shutdown().await;
}

#[tokio::test]
async fn unbounded_recursion_kills_only_that_key() {
    let node = bomb_node().await;
    // The guest's shadow stack sits at the bottom of its linear memory, so
    // overflowing it traps as an out-of-bounds access before the native
    // stack could overflow; either way the key (and only it) dies.
    let why = key_died(node.call("bomb", "b", b"recurse".to_vec()).await);
    assert!(why.contains("trap"), "{why}");
    assert!(
        !why.contains("CPU limit"),
        "the recursion itself trapped: {why}"
    );
    assert_eq!(
        call_text(&node, "bomb", "b", "ping").await,
        "pong",
        "a fresh process"
    );
    others_still_served(&node).await;
    node.shutdown().await;
}

#[tokio::test]
async fn a_reply_over_max_message_size_is_refused() {
    let node = bomb_node().await;
    let err = node
        .call("bomb", "b", b"reply 100000".to_vec())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::ReplyTooLarge { size: 100000, limit } if limit == MESSAGE_LIMIT),
        "{err:?}"
    );
    let err = err.to_string();
    assert!(err.contains("100000"), "{err}");
    assert!(err.contains(&MESSAGE_LIMIT.to_string()), "{err}");
    // A reply at the limit passes.
    let reply = node
        .call("bomb", "b", format!("reply {MESSAGE_LIMIT}").into_bytes())
        .await
        .unwrap();
    assert_eq!(reply.len(), MESSAGE_LIMIT);
    others_still_served(&node).await;
    node.shutdown().await;
}

#[tokio::test]
async fn a_message_over_max_message_size_is_refused() {
    let node = bomb_node().await;
    let err = node
        .call("bomb", "b", vec![b'x'; MESSAGE_LIMIT + 1])
        .await
        .unwrap_err();
    assert_eq!(
        err,
        Error::MessageTooLarge {
            size: MESSAGE_LIMIT + 1,
            limit: MESSAGE_LIMIT
        }
    );
    let err = node
        .cast("bomb", "b", vec![b'x'; MESSAGE_LIMIT + 1])
        .unwrap_err();
    assert!(matches!(err, Error::MessageTooLarge { .. }), "{err:?}");
    others_still_served(&node).await;
    node.shutdown().await;
}

#[tokio::test]
async fn timers_stop_at_max_timers_per_key() {
    let node = bomb_node().await;
    assert_eq!(call_text(&node, "bomb", "b", "timers").await, "10");
    assert_eq!(
        call_text(&node, "bomb", "b", "ping").await,
        "pong",
        "refused, not killed"
    );
    others_still_served(&node).await;
    node.shutdown().await;
}

/// The kernel's per-process mapping limit, if this is Linux.
fn max_map_count() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|v| v.trim().parse().ok())
}

#[tokio::test]
async fn a_max_live_keys_the_kernel_cannot_map_is_refused_at_start() {
    let Some(limit) = max_map_count() else {
        eprintln!("no /proc/sys/vm/max_map_count: nothing to check against");
        return;
    };
    // Six mappings per key: one key more than the limit holds even in an
    // empty process (on a default kernel, 65 530 / 6 + 1 = 10 922 keys).
    let keys = u32::try_from(limit / 6 + 1).unwrap_or(u32::MAX);
    let config = NodeConfig {
        max_live_keys: keys,
        ..test_config()
    };
    let Err(Error::Config(why)) = Instance::start_embedded(config).await else {
        panic!("a node with max_live_keys = {keys} started under vm.max_map_count = {limit}");
    };
    assert!(why.contains("vm.max_map_count"), "{why}");
    assert!(why.contains("sysctl -w"), "names the setting: {why}");
    assert!(
        why.contains("lower max_live_keys"),
        "names the other way: {why}"
    );
}
