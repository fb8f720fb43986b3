//! Eviction: live processes as a cache of keys (issue 20 item 1,
//! `docs/eviction.md`).
//!
//! - Past a module's `max_live_keys`, the least recently used idle key of
//!   the module retires for the new one, and every key's stored state is
//!   kept: a stored counter served round-robin over many more keys than
//!   the budget counts right, with no refusal.
//! - Past the node's `max_live_keys`, the least recently used idle key of
//!   any module retires; the same; and the new key does not wait for it:
//!   it starts in the instance pool's reserve while its victim retires.
//! - Only busy keys refuse: with every live key in a callback, a new key is
//!   refused naming the budget (the module's, or the node's though the
//!   pool's reserve is free), and served once one is free; a key with an
//!   armed timer is never a victim.
//! - Messages racing evictions are served once, by one process at a time:
//!   the single-ownership checker over every key life of a churning run.

use std::sync::Arc;
use std::time::Duration;

use fief::{Error, Instance, ModuleOptions, NodeConfig};
use fief_tests::{call_text, guests, metric_value, node_with_options, test_config};

use crate::cluster::ownership_checker::{LifeRecorder, assert_single_ownership};

fn budget(max_live_keys: u32) -> ModuleOptions {
    ModuleOptions {
        max_live_keys,
        ..ModuleOptions::default()
    }
}

/// Start a node with `modules`, recording every key life.
async fn node_recording(
    config: NodeConfig,
    modules: &[(&str, &str, ModuleOptions)],
) -> (Arc<Instance>, LifeRecorder) {
    let lives = LifeRecorder::default();
    let mut builder = Instance::builder(config).observer(lives.observer());
    for (name, path, options) in modules {
        builder = builder.module(name, guests::bytes(path), options.clone());
    }
    let node = builder.start().await.expect("node starts");
    (Arc::new(node), lives)
}

async fn evicted(node: &Instance, module: &str, cause: &str) -> f64 {
    let text = node.metrics_text().await;
    metric_value(
        &text,
        &format!("fief_keys_evicted_total{{module=\"{module}\",cause=\"{cause}\"}}"),
    )
    .unwrap_or(0.0)
}

/// Issue 20 item 1 and test "eviction under budget keeps every key's
/// state": a stored counter with `max_live_keys = 4`, called round-robin
/// over 40 keys three times. Each round every key answers its round number
/// (its state came back from storage), nothing is refused, at most 4 keys
/// (plus those retiring) are live at the end, and the evictions are counted
/// with their cause. Without eviction the fifth key is refused
/// `too_many_keys`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_a_modules_budget_keeps_every_keys_state() {
    let (node, lives) = node_recording(
        test_config(),
        &[("stored", guests::STORED_COUNTER, budget(4))],
    )
    .await;
    for round in 1..=3 {
        for k in 0..40 {
            let key = format!("k{k}");
            let reply = call_text(&node, "stored", &key, "incr").await;
            assert_eq!(reply, round.to_string(), "{key} in round {round}");
        }
    }
    assert!(
        evicted(&node, "stored", "module_budget").await >= 100.0,
        "{}",
        node.metrics_text().await
    );
    let reactivated = metric_value(
        &node.metrics_text().await,
        "fief_keys_reactivated_total{module=\"stored\"}",
    )
    .unwrap_or(0.0);
    assert!(reactivated >= 70.0, "reactivations counted: {reactivated}");
    // Evictions finish: the table falls back to its budget.
    let mut live = usize::MAX;
    for _ in 0..200 {
        live = node.keys().len();
        if live <= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(live <= 4, "{live} keys live with max_live_keys = 4");
    assert_single_ownership(&lives.events());
}

/// The node's instance pool (`max_live_keys = 4` of the node) is the
/// budget: two modules' keys called round-robin, 12 each, three rounds; the
/// oldest idle key of either module makes room. Without eviction the fifth
/// key is refused `PoolFull`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_the_nodes_pool_keeps_every_keys_state() {
    let config = NodeConfig {
        max_live_keys: 4,
        ..test_config()
    };
    let (node, lives) = node_recording(
        config,
        &[
            ("a", guests::STORED_COUNTER, budget(100)),
            ("b", guests::STORED_COUNTER, budget(100)),
        ],
    )
    .await;
    for round in 1..=3 {
        for k in 0..12 {
            for module in ["a", "b"] {
                let key = format!("k{k}");
                let reply = node
                    .call(module, &key, b"incr".to_vec())
                    .await
                    .unwrap_or_else(|e| panic!("{module}/{key} in round {round}: {e}"));
                assert_eq!(reply, round.to_string().into_bytes(), "{module}/{key}");
            }
        }
    }
    let by_pool =
        evicted(&node, "a", "node_budget").await + evicted(&node, "b", "node_budget").await;
    assert!(by_pool >= 60.0, "evictions for the pool: {by_pool}");
    assert_single_ownership(&lives.events());
}

/// Only busy keys refuse. `max_live_keys = 2`: two keys spin in a callback
/// (busy), so a third is refused `too_many_keys` naming the budget; a key
/// with an armed timer is not a victim either. Once a spinner is killed,
/// the third is served. Then with one idle key among the live ones, a new
/// key evicts it rather than be refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_busy_keys_refuse_and_the_refusal_names_the_budget() {
    let node = Arc::new(
        node_with_options(test_config(), &[("hostile", guests::HOSTILE, budget(2))]).await,
    );
    // One key busy in a callback, one with an armed timer (its callback
    // returned: it is idle but for the timer).
    node.cast("hostile", "spinner", b"loop".to_vec())
        .expect("cast");
    assert_eq!(
        call_text(&node, "hostile", "timed", "rearm-zero").await,
        "armed"
    );
    let refused = third_refused(&node, "every live key is busy or has a timer").await;
    assert!(matches!(refused, Error::TooManyKeys { .. }), "{refused}");
    assert!(refused.to_string().contains("max_live_keys"), "{refused}");
    // The timed key is still there, its timer still firing.
    assert!(node.keys().iter().any(|k| k.key == "timed"));
    // Free the spinner's slot: the third key is served (once the spinner's
    // store is dropped).
    assert!(node.kill_key("hostile", "spinner"));
    assert_eq!(served_soon(&node, "third").await, b"pong");
    // Live now: `timed` (timer) and `third` (idle once its task has let go
    // of the process after replying). A fourth key evicts `third`, not
    // `timed`.
    assert_eq!(served_soon(&node, "fourth").await, b"pong");
    assert!(
        node.keys().iter().any(|k| k.key == "timed"),
        "the timed key was evicted"
    );
    // Counted once `third`'s task has retired it (after `fourth` started).
    let mut count = 0.0;
    for _ in 0..200 {
        count = evicted(&node, "hostile", "module_budget").await;
        if count >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        count, 1.0,
        "evictions of hostile keys for the module budget"
    );
    node.kill_key("hostile", "timed");
}

/// A node with `max_live_keys = 2` serving `hostile` (its own budget far
/// above: the node's is the one reached).
async fn hostile_node_of_two_keys() -> Instance {
    let config = NodeConfig {
        max_live_keys: 2,
        ..test_config()
    };
    node_with_options(config, &[("hostile", guests::HOSTILE, budget(100))]).await
}

/// At the node's `max_live_keys` a new key starts at once, in the instance
/// pool's reserve, while its victim retires: it does not wait for the
/// victim's store to drop. `max_live_keys = 2`: `slow-terminate-old` (whose
/// `terminate` takes 1.5 s) and `young` are live and idle; `new`'s call
/// orders the older to retire and is answered while that key is still in
/// its `terminate` (an entry leaves the table only after its store is
/// dropped). Without the reserve, `new`'s start waited for the victim's
/// `terminate` and its store's drop. Once the victim is gone the node is
/// back at its budget, the eviction counted for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_at_the_nodes_budget_does_not_wait_for_its_victim_to_retire() {
    let node = hostile_node_of_two_keys().await;
    for key in ["slow-terminate-old", "young"] {
        assert_eq!(served_soon(&node, key).await, b"pong");
    }
    assert_eq!(served_soon(&node, "new").await, b"pong");
    let live: Vec<String> = node.keys().into_iter().map(|k| k.key).collect();
    assert!(
        live.iter().any(|k| k == "slow-terminate-old"),
        "the victim had retired before the new key was served: {live:?}"
    );
    assert!(
        live.iter().any(|k| k == "young"),
        "a second key was evicted for the new one: {live:?}"
    );
    settles_at_two_keys(&node, 1.0).await;
    let live: Vec<String> = node.keys().into_iter().map(|k| k.key).collect();
    assert!(
        !live.iter().any(|k| k == "slow-terminate-old"),
        "the victim is still live and another key went in its place: {live:?}"
    );
}

/// A retired key's next process (its queued messages need one) counts
/// against the node's `max_live_keys` like any start: `max_live_keys = 2`,
/// `slow-terminate-old` and `young` idle; `new` evicts the older, and a call
/// to it once it is in its 1.5 s `terminate` queues for its next process (a
/// call that reached it before its task saw the order would be served by
/// the old process, which then retires: the test waits for the `terminate`).
/// That process starts at the budget (`young` and `new` live), so `young`,
/// now the least recently used idle key, retires for it: the node settles
/// at 2 live keys, two `node_budget` evictions counted. Without the check
/// (`095639d`) the node stayed at 3 until the next start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retired_keys_next_process_makes_room_at_the_nodes_budget() {
    let node = hostile_node_of_two_keys().await;
    for key in ["slow-terminate-old", "young", "new"] {
        assert_eq!(served_soon(&node, key).await, b"pong");
    }
    fief_tests::slow_terminate_begun(&node, "slow-terminate-old").await;
    assert_eq!(
        node.call("hostile", "slow-terminate-old", b"ping".to_vec())
            .await
            .expect("served by its next process"),
        b"pong"
    );
    settles_at_two_keys(&node, 2.0).await;
    let live: Vec<String> = node.keys().into_iter().map(|k| k.key).collect();
    assert!(
        !live.iter().any(|k| k == "young"),
        "the least recently used idle key is still live: {live:?}"
    );
}

/// Wait (at most 5 s) until `node` (of [`hostile_node_of_two_keys`]) is
/// back at its budget of 2 live keys with `evictions` counted for it.
async fn settles_at_two_keys(node: &Instance, evictions: f64) {
    let mut settled = (usize::MAX, 0.0);
    for _ in 0..500 {
        settled = (
            node.keys().len(),
            evicted(node, "hostile", "node_budget").await,
        );
        if settled == (2, evictions) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        settled,
        (2, evictions),
        "(live keys, evictions for the node's budget)"
    );
}

/// Starts racing at the node's `max_live_keys` pass it, and the next start
/// catches up: `max_live_keys = 2`, `a` live; `b` and `c` start together
/// (made to meet after the budget check, before either store exists: each
/// counted one live key, so neither evicted), and three are live. The next
/// start, `d`, orders two retirements, for its own room and the one the race
/// took, and the node settles at 2. Ordering one (its own room only), the
/// node stayed at 3 live keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_after_a_race_past_the_nodes_budget_makes_up_for_it() {
    let node = hostile_node_of_two_keys().await;
    assert_eq!(served_soon(&node, "a").await, b"pong");
    node.inject_start_rendezvous(2);
    let (b, c) = tokio::join!(
        node.call("hostile", "b", b"ping".to_vec()),
        node.call("hostile", "c", b"ping".to_vec())
    );
    assert_eq!(b.expect("b is served"), b"pong");
    assert_eq!(c.expect("c is served"), b"pong");
    assert_eq!(
        (
            node.keys().len(),
            evicted(&node, "hostile", "node_budget").await
        ),
        (3, 0.0),
        "the race past the budget did not happen: (live keys, evictions)"
    );
    assert_eq!(served_soon(&node, "d").await, b"pong");
    settles_at_two_keys(&node, 2.0).await;
}

/// Only busy keys refuse at the node's `max_live_keys` too, though the
/// pool's reserve is free: two keys spin in a callback with
/// `max_live_keys = 2`, so a third is refused `PoolFull`, naming the budget;
/// once a spinner is killed the third is served. Without the budget's own
/// check the third would start in the reserve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_busy_keys_refuse_at_the_nodes_budget_though_the_reserve_is_free() {
    let node = hostile_node_of_two_keys().await;
    for spinner in ["spinner-1", "spinner-2"] {
        node.cast("hostile", spinner, b"loop".to_vec())
            .expect("cast");
    }
    let refused = third_refused(&node, "every live key is busy").await;
    assert!(matches!(refused, Error::PoolFull { .. }), "{refused}");
    assert!(
        refused
            .to_string()
            .contains("all 2 keys of its max_live_keys are live"),
        "{refused}"
    );
    assert!(node.kill_key("hostile", "spinner-1"));
    assert_eq!(served_soon(&node, "third").await, b"pong");
    node.kill_key("hostile", "spinner-2");
}

/// Keys retiring do not hide idle ones from the next eviction: with
/// `max_live_keys = 100` (the pool's reserve: 100 more), 100 idle
/// `slow-terminate-…` keys (each `terminate` takes 1.5 s) are live, then 100
/// new keys are called one after another: each evicts one of the first, and
/// their retirements pile up. Every new key is served. Before the victim's
/// scan skipped the keys already retiring, the 65th new key found only
/// retiring keys among the 64 oldest and was refused `PoolFull` with 36 idle
/// keys live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_retiring_do_not_hide_idle_keys_from_the_next_eviction() {
    let config = NodeConfig {
        max_live_keys: 100,
        ..test_config()
    };
    let node = node_with_options(config, &[("hostile", guests::HOSTILE, budget(1000))]).await;
    for i in 0..100 {
        assert_eq!(
            served_soon(&node, &format!("slow-terminate-{i}")).await,
            b"pong"
        );
    }
    for i in 0..100 {
        let key = format!("new-{i}");
        match node.call("hostile", &key, b"ping".to_vec()).await {
            Ok(reply) => assert_eq!(reply, b"pong"),
            Err(e) => panic!("{key} refused with idle keys live: {e}"),
        }
    }
}

/// The refusal of a call to a third key of `hostile` (`why`: why it must
/// be refused), once the callbacks cast before have begun: a 429
/// `too_many_keys`.
async fn third_refused(node: &Instance, why: &str) -> Error {
    tokio::time::sleep(Duration::from_millis(50)).await;
    let refused = node
        .call("hostile", "third", b"ping".to_vec())
        .await
        .expect_err(why);
    assert_eq!(refused.code(), "too_many_keys");
    refused
}

/// `ping` `key` of `hostile` until it is not refused for a budget (for at
/// most 2 s: a key that has just replied holds its process a moment).
async fn served_soon(node: &Instance, key: &str) -> Vec<u8> {
    for _ in 0..200 {
        match node.call("hostile", key, b"ping".to_vec()).await {
            Ok(reply) => return reply,
            Err(Error::TooManyKeys { .. } | Error::PoolFull { .. }) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => panic!("{key}: {e}"),
        }
    }
    panic!("{key} was refused for 2 s");
}

/// A message racing an eviction is served once, by one process: 8 callers
/// hammer 24 keys of a stored counter with `max_live_keys = 3`, so keys are
/// evicted while calls for them arrive. Every `incr` answered is counted
/// exactly once (each key's final value is the number of its answered
/// increments) and no two processes of one key ever overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_racing_evictions_are_served_once_by_one_process() {
    let (node, lives) = node_recording(
        test_config(),
        &[("stored", guests::STORED_COUNTER, budget(3))],
    )
    .await;
    let keys: Vec<String> = (0..24).map(|k| format!("k{k}")).collect();
    let mut callers = Vec::new();
    for c in 0..8 {
        let (node, keys) = (node.clone(), keys.clone());
        callers.push(tokio::spawn(async move {
            let mut answered = vec![0u64; keys.len()];
            for i in 0..150 {
                let k = (i * 7 + c * 5) % keys.len();
                match node.call("stored", &keys[k], b"incr".to_vec()).await {
                    Ok(_) => answered[k] += 1,
                    // Every live key busy: refused before processing.
                    Err(Error::TooManyKeys { .. } | Error::PoolFull { .. }) => {}
                    Err(e) => panic!("{}: {e}", keys[k]),
                }
            }
            answered
        }));
    }
    let mut answered = vec![0u64; keys.len()];
    for caller in callers {
        for (total, n) in answered.iter_mut().zip(caller.await.expect("caller")) {
            *total += n;
        }
    }
    // Refusals happen (all three live keys busy at once, often with eight
    // callers); most calls are answered all the same.
    let total: u64 = answered.iter().sum();
    eprintln!("answered {total} of 1200 increments: {answered:?}");
    assert!(total >= 50, "answered {total} of 1200: {answered:?}");
    for (k, key) in keys.iter().enumerate() {
        let value = call_text(&node, "stored", key, "get").await;
        assert_eq!(value, answered[k].to_string(), "{key}");
    }
    assert!(evicted(&node, "stored", "module_budget").await > 0.0);
    assert_single_ownership(&lives.events());
}

/// The node's memory budget (`max_guest_memory`) is an eviction trigger
/// too: with room for some number of stored counters' linear memories
/// (64 MiB, the smallest a node with the default module options takes),
/// each activation past it evicts the least recently used idle key (any
/// module), so a round-robin over twice as many keys keeps about that many
/// live while every count stays right; the pool and the module could hold
/// them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nodes_memory_budget_evicts_idle_keys_and_keeps_their_state() {
    // One stored counter's linear memory, measured on a node without the
    // budget.
    let probe = node_with_options(
        test_config(),
        &[("stored", guests::STORED_COUNTER, budget(10))],
    )
    .await;
    call_text(&probe, "stored", "one", "get").await;
    let one_key = probe.status().guest_memory_bytes;
    assert!(one_key > 0, "a live key holds linear memory");
    probe.shutdown().await;
    let memory = fief::config::ByteSize::mib(64);
    let room = memory.as_u64() / one_key;
    let keys = 2 * room + 10;
    // The pool and the module hold every key: only the memory budget
    // evicts (its own cause, `memory_budget`).
    let pool = u32::try_from(keys + 16).expect("fits");
    let config = NodeConfig {
        max_guest_memory: Some(memory),
        max_memory_per_key: memory,
        max_live_keys: pool,
        ..test_config()
    };
    let (node, lives) =
        node_recording(config, &[("stored", guests::STORED_COUNTER, budget(pool))]).await;
    for round in 1..=2 {
        for k in 0..keys {
            let reply = call_text(&node, "stored", &format!("k{k}"), "incr").await;
            assert_eq!(reply, round.to_string(), "k{k} in round {round}");
        }
    }
    let mut live = u64::MAX;
    for _ in 0..200 {
        live = node.keys().len() as u64;
        if live <= room + 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        live <= room + 2,
        "{live} keys live with room for {room} ({one_key} bytes each)"
    );
    assert!(node.status().guest_memory_bytes <= memory.as_u64() + 2 * one_key);
    assert!(evicted(&node, "stored", "memory_budget").await >= keys as f64);
    assert_single_ownership(&lives.events());
}
