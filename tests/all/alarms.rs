//! Durable alarms (issue 20 item 2, `docs/alarms.md`), end to end through
//! `examples/reminders`:
//!
//! - an alarm fires once, never before its time, and its firing's writes
//!   land with its deletion; a cancelled one never fires;
//! - a handler that traps is retried with backoff and sees the attempt;
//! - a handler that sets a new alarm keeps it;
//! - an alarm wakes an evicted key (and a never-live one);
//! - an alarm survives a restart of its node (embedded storage on disk),
//!   and the partitions a node takes wake its alarm loop;
//! - a flood is bounded: `max_alarms_per_key` per key, its ceiling per
//!   node, ten years ahead at most.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fief::{Instance, ModuleOptions, NodeConfig};
use fief_tests::{call_text, guests, metric_value, node_with_options, test_config};

fn now_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_millis(),
    )
    .expect("fits")
}

/// The handled firings `key` logged: `(name, attempt, fired_at_ms)`.
async fn fired(node: &Instance, key: &str) -> Vec<(String, u32, u64)> {
    // A call queued behind a handler that traps fails (retry): it was not
    // processed.
    let mut log = None;
    for _ in 0..20 {
        match node.call("reminders", key, b"fired".to_vec()).await {
            Ok(reply) => {
                log = Some(String::from_utf8(reply).expect("text"));
                break;
            }
            Err(fief::Error::KeyDied(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("fired: {e}"),
        }
    }
    log.expect("the key answers within a second")
        .lines()
        .map(|line| {
            let mut words = line.split_whitespace();
            let name = words.next().expect("a name").to_owned();
            let attempt = words.next().expect("an attempt").parse().expect("a number");
            let at = words.next().expect("a time").parse().expect("a number");
            (name, attempt, at)
        })
        .collect()
}

/// Wait (at most `limit`) until `key` has logged `n` firings; return them.
async fn wait_fired(
    node: &Instance,
    key: &str,
    n: usize,
    limit: Duration,
) -> Vec<(String, u32, u64)> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let log = fired(node, key).await;
        if log.len() >= n || tokio::time::Instant::now() >= deadline {
            return log;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn reminders_node(config: NodeConfig, options: ModuleOptions) -> Arc<Instance> {
    Arc::new(node_with_options(config, &[("reminders", guests::REMINDERS, options)]).await)
}

/// An alarm set 400 ms ahead fires once, not before its time; one
/// cancelled never fires; `alarms` lists what is pending; the firing is
/// counted in the metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alarm_fires_once_never_early_and_a_cancelled_one_never() {
    let node = reminders_node(test_config(), ModuleOptions::default()).await;
    let at: u64 = call_text(&node, "reminders", "ann", "set soon 400")
        .await
        .parse()
        .expect("the alarm's time");
    call_text(&node, "reminders", "ann", "set never 300").await;
    assert_eq!(
        call_text(&node, "reminders", "ann", "cancel never").await,
        "true"
    );
    let listed = call_text(&node, "reminders", "ann", "alarms").await;
    assert_eq!(listed, format!("soon={at}\n"));
    let log = wait_fired(&node, "ann", 1, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 1, "{log:?}");
    let (name, attempt, fired_at) = &log[0];
    assert_eq!((name.as_str(), *attempt), ("soon", 1));
    assert!(*fired_at >= at, "fired at {fired_at}, before its time {at}");
    // Nothing more: not twice, and not the cancelled one.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(fired(&node, "ann").await.len(), 1);
    assert_eq!(call_text(&node, "reminders", "ann", "alarms").await, "");
    let metrics = node.metrics_text().await;
    assert_eq!(
        metric_value(&metrics, "fief_alarm_outcomes_total{outcome=\"committed\"}"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(metric_value(&metrics, "fief_alarms_pending"), Some(0.0));
}

/// A handler that traps on its first attempt is retried (after the 1 s
/// backoff) and its second run sees attempt 2; the process the trap killed
/// is replaced. A handler that sets a new alarm keeps it (`again` sets
/// `again-2`, which fires too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trapping_handler_is_retried_with_its_attempt_and_a_reset_alarm_survives() {
    let node = reminders_node(test_config(), ModuleOptions::default()).await;
    call_text(&node, "reminders", "bea", "set flaky 50").await;
    call_text(&node, "reminders", "cal", "set again 50").await;
    let log = wait_fired(&node, "bea", 1, Duration::from_secs(15)).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!((log[0].0.as_str(), log[0].1), ("flaky", 2), "{log:?}");
    let log = wait_fired(&node, "cal", 2, Duration::from_secs(15)).await;
    let names: Vec<_> = log.iter().map(|(n, a, _)| (n.as_str(), *a)).collect();
    assert_eq!(names, [("again", 1), ("again-2", 1)]);
    let metrics = node.metrics_text().await;
    assert_eq!(
        metric_value(&metrics, "fief_alarm_outcomes_total{outcome=\"trapped\"}"),
        Some(1.0),
        "{metrics}"
    );
}

/// An alarm wakes its key when no process of it is live: the key is
/// evicted (its module's `max_live_keys` is 1 and another key is called),
/// and the alarm activates it again; its firing is logged in storage
/// before anyone calls the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alarm_wakes_an_evicted_key() {
    let options = ModuleOptions {
        max_live_keys: 1,
        ..ModuleOptions::default()
    };
    let node = reminders_node(test_config(), options).await;
    // Due well after the eviction below, even on a loaded machine: an alarm
    // that fired first would keep `dee` busy, and the eviction refused.
    call_text(&node, "reminders", "dee", "set wake 1500").await;
    // Another key takes the only place: `dee` is evicted. A key is briefly
    // busy after its reply on a loaded machine (its task finishing on a
    // guest thread): refused with "retry later", as a client would, retry.
    let retry_until = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match node.call("reminders", "other", b"alarms".to_vec()).await {
            Ok(_) => break,
            Err(fief::Error::TooManyKeys { .. }) if tokio::time::Instant::now() < retry_until => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("calling `other` to evict `dee`: {e}"),
        }
    }
    let mut evicted = false;
    for _ in 0..100 {
        if !node.keys().iter().any(|k| k.key == "dee") {
            evicted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(evicted, "dee is still live");
    // Woken by its alarm: it becomes live again on its own.
    let mut woken = false;
    for _ in 0..200 {
        if node.keys().iter().any(|k| k.key == "dee") {
            woken = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(woken, "the alarm did not activate its evicted key");
    let log = wait_fired(&node, "dee", 1, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0].0, "wake");
}

/// An alarm outlives its node: set on a node with its storage on disk, due
/// after that node has shut down, it fires once on the node started next on
/// the same data directory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alarm_fires_after_its_node_restarts() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let at = set_and_shut_down(dir.path()).await;
    let second = restart(dir.path(), |builder| builder).await;
    let log = wait_fired(&second, "eve", 1, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].2 >= at, "fired at {}, before {at}", log[0].2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fired(&second, "eve").await.len(), 1);
    second.shutdown().await;
}

/// Partitions taken wake the alarm loop: with its look at the routing view
/// made only once an hour otherwise, a node restarted on an alarm's data
/// still loads the partitions it takes at start and fires the alarm. (The
/// loop's first look comes before the node holds its lease, so without the
/// wake it would wait the hour; with a 250 ms period, the node's first
/// keys' loads each raised their partition's fence in a write round of
/// their own meanwhile.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_taken_at_start_have_their_alarms_loaded_at_once() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let at = set_and_shut_down(dir.path()).await;
    let second = restart(dir.path(), |builder| {
        builder.alarm_reconcile_period(Duration::from_secs(3600))
    })
    .await;
    let log = wait_fired(&second, "eve", 1, Duration::from_secs(10)).await;
    assert_eq!(log.len(), 1, "{log:?}");
    assert!(log[0].2 >= at, "fired at {}, before {at}", log[0].2);
    second.shutdown().await;
}

/// A node on `data_dir` whose key `eve` sets an alarm 700 ms ahead, then
/// shuts down; returns the alarm's time.
async fn set_and_shut_down(data_dir: &std::path::Path) -> u64 {
    let first = node_with_options(
        disk_config(data_dir),
        &[("reminders", guests::REMINDERS, ModuleOptions::default())],
    )
    .await;
    let at: u64 = call_text(&first, "reminders", "eve", "set later 700")
        .await
        .parse()
        .expect("a time");
    first.shutdown().await;
    at
}

/// A node started on `data_dir` with `reminders`, as `choose` builds it,
/// once the node before has released the store.
async fn restart(
    data_dir: &std::path::Path,
    choose: impl Fn(fief::InstanceBuilder) -> fief::InstanceBuilder,
) -> Instance {
    // The first node's store closes once its last task has let go of it.
    for _ in 0..100 {
        let builder = Instance::builder(disk_config(data_dir)).module(
            "reminders",
            guests::bytes(guests::REMINDERS),
            ModuleOptions::default(),
        );
        match choose(builder).start().await {
            Ok(node) => return node,
            Err(e) if e.to_string().contains("locked") => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the second node: {e}"),
        }
    }
    panic!("the first node's store was not released within 5 s");
}

fn disk_config(data_dir: &std::path::Path) -> NodeConfig {
    NodeConfig {
        data_dir: Some(data_dir.to_path_buf()),
        ..test_config()
    }
}

/// Alarms are bounded: past `max_alarms_per_key` a new name is refused
/// with `limit` (re-setting an existing one is not); a time more than ten
/// years ahead is refused; a module asking for more alarms per key than
/// the node's ceiling is refused at deploy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alarm_flood_is_refused_past_the_modules_limit() {
    let options = ModuleOptions {
        max_alarms_per_key: 3,
        ..ModuleOptions::default()
    };
    let node = reminders_node(test_config(), options).await;
    for name in ["a", "b", "c"] {
        call_text(&node, "reminders", "flo", &format!("set {name} 3600000")).await;
    }
    let refused = node
        .call("reminders", "flo", b"set d 3600000".to_vec())
        .await
        .expect_err("a fourth alarm");
    assert!(
        refused.to_string().contains("max_alarms_per_key"),
        "{refused}"
    );
    // Moving an existing alarm is not a new one.
    call_text(&node, "reminders", "flo", "set a 7200000").await;
    let far = now_ms() + 11 * 366 * 24 * 3600 * 1000;
    let refused = node
        .call("reminders", "flo", format!("set-at z {far}").into_bytes())
        .await
        .expect_err("eleven years ahead");
    assert!(refused.to_string().contains("ten years"), "{refused}");
    // The node refuses a module asking for more than its ceiling.
    let greedy = ModuleOptions {
        max_alarms_per_key: 100_000,
        ..ModuleOptions::default()
    };
    let err = node
        .deploy("greedy", &guests::bytes(guests::REMINDERS), greedy)
        .await
        .expect_err("over the ceiling");
    assert!(err.to_string().contains("max_alarms_per_key"), "{err}");
}

/// Issue 20 item 3: `fief alarms MODULE KEY` lists a key's committed
/// alarms (name, time, due in), sorted, from the store; the HTTP answer
/// (`GET /v1/alarms/{module}/{key}`) carries the same as JSON; a key with
/// none prints nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fief_alarms_lists_a_keys_committed_alarms() {
    let node = reminders_node(test_config(), ModuleOptions::default()).await;
    let server = fief_tests::HttpServer::start(node.clone()).await;
    let url = server.url("");
    let url = url.trim_end_matches('/').to_owned();
    call_text(&node, "reminders", "gus", "set zeta 3600000").await;
    call_text(&node, "reminders", "gus", "set alpha 7200000").await;
    let out = tokio::task::spawn_blocking({
        let url = url.clone();
        move || fief_tests::fief_cli(&["alarms", "--node", &url, "reminders", "gus"])
    })
    .await
    .expect("the CLI ran");
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("alpha\t") && lines[0].contains("due in 1h"),
        "{text}"
    );
    assert!(
        lines[1].starts_with("zeta\t") && lines[1].contains("due in 59m"),
        "{text}"
    );
    let json: serde_json::Value = reqwest::get(format!("{url}/v1/alarms/reminders/gus"))
        .await
        .expect("GET /v1/alarms")
        .json()
        .await
        .expect("JSON");
    assert_eq!(json["alarms"][0]["name"], "alpha", "{json}");
    assert!(json["alarms"][1]["at_ms"].as_u64().is_some(), "{json}");
    let out = tokio::task::spawn_blocking(move || {
        fief_tests::fief_cli(&["alarms", "--node", &url, "reminders", "nobody"])
    })
    .await
    .expect("the CLI ran");
    assert!(out.status.success(), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
}
