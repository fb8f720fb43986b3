//! Durable key state against real `fief node` processes (issue "Durable
//! per-key state, fenced by the ownership token", item 9): the stored
//! counter (`examples/stored-counter`, deployed as `stored`) keeps its
//! value in PostgreSQL (the arbiter's database, the default) or in the
//! embedded redb file, and the tests SIGKILL, pause, cut off and stop the
//! nodes that own it.
//!
//! The cluster test records every call the clients make (when it was
//! invoked, when and what it answered, or that its outcome is unknown) and
//! checks each key's history with the counter linearizability checker
//! (`counter_history.rs`): every answered `incr` survives every fault, no
//! stale owner's commit lands after a newer owner served the key (its old
//! value would come back, which the checker sees as a read going back),
//! and every reply, including those after failovers, is one a single
//! counter could give. A durable alarm (`examples/reminders`) survives
//! `kill -9` of its node. Timings are `FAST_TIMINGS` (TTL 2 s); the tests
//! take the process tests' lock (`processes::SERIAL`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use fief_tests::guests;
use fief_tests::multiprocess::{
    ClusterNode, FAST_TIMINGS, NodeSpec, PgProxy, call_url, drop_namespace, test_database,
    unique_namespace,
};

use crate::counter_history::{self, Event, Op};
use crate::processes::{SERIAL, start_nodes, wait_settled};

/// Keys the load spreads over.
const KEYS: usize = 32;
/// Concurrent clients.
const WORKERS: usize = 4;
/// Pause between one client's calls.
const PACE: Duration = Duration::from_millis(20);
/// How long a call may take before its outcome counts as unknown.
const CALL_LIMIT: Duration = Duration::from_secs(2);
/// The lease TTL of `FAST_TIMINGS`.
const LEASE_TTL: Duration = Duration::from_secs(2);
/// How long a node may take to start.
const START_LIMIT: Duration = Duration::from_secs(30);
/// Operations recorded per key at most (the checker's bound, less room for
/// the final read).
const OPS_PER_KEY: usize = counter_history::MAX_OPS - 8;

fn stored_spec(namespace: &str, node_id: &str, arbiter: String, extra: &[&str]) -> NodeSpec {
    NodeSpec {
        node_id: node_id.to_owned(),
        namespace: namespace.to_owned(),
        arbiter,
        deploy: vec![("stored".to_owned(), guests::STORED_COUNTER.to_owned())],
        extra_args: FAST_TIMINGS
            .iter()
            .chain(extra)
            .map(|s| (*s).to_owned())
            .collect(),
    }
}

/// Whether a refusal says the call was answered before any key processed
/// it (the API documents these as "retry"): it took no effect.
fn refused_before_processing(status: u16, code: &str) -> bool {
    status == 503 && matches!(code, "unowned" | "not_owner" | "fenced")
}

/// The clients' record: per key, every operation that may have taken effect.
#[derive(Default)]
struct Record {
    keys: Mutex<HashMap<String, Vec<Event>>>,
}

impl Record {
    /// Whether `key` still has room for an operation.
    fn has_room(&self, key: &str) -> bool {
        self.keys
            .lock()
            .unwrap()
            .get(key)
            .is_none_or(|ops| ops.len() < OPS_PER_KEY)
    }

    fn push(&self, key: &str, event: Event) {
        self.keys
            .lock()
            .unwrap()
            .entry(key.to_owned())
            .or_default()
            .push(event);
    }
}

/// One client: calls `incr` (three in four) or `get` on the keys in turn,
/// through the nodes in turn, until `stop`.
async fn client(
    w: usize,
    urls: Arc<RwLock<Vec<String>>>,
    record: Arc<Record>,
    stop: Arc<AtomicBool>,
) {
    let http = reqwest::Client::new();
    let mut i = w;
    while !stop.load(Ordering::SeqCst) {
        i += WORKERS;
        let key = format!("k{}", (i * 7 + w) % KEYS);
        let op = if i % 4 == 3 { Op::Get } else { Op::Incr };
        let via = {
            let urls = urls.read().unwrap();
            urls[i % urls.len()].clone()
        };
        if !record.has_room(&key) {
            tokio::time::sleep(PACE).await;
            continue;
        }
        let message = match op {
            Op::Incr => "incr",
            Op::Get => "get",
        };
        let invoked = Instant::now();
        let result = call_url(&http, &via, "stored", &key, message, CALL_LIMIT).await;
        let returned = Instant::now();
        let answer = match result {
            Ok(text) => Some(
                text.trim()
                    .parse::<u64>()
                    .unwrap_or_else(|e| panic!("{key} answered {text:?} to {message}: {e}")),
            ),
            Err(e) if refused_before_processing(e.status, &e.code) => {
                tokio::time::sleep(PACE).await;
                continue;
            }
            Err(_) => None,
        };
        record.push(
            &key,
            Event {
                client: w,
                op,
                answer,
                invoked,
                returned,
            },
        );
        tokio::time::sleep(PACE).await;
    }
}

/// A stored counter driven by concurrent clients through every node, while
/// one node is SIGKILLed (and restarted), one is paused past its TTL, one is
/// cut from PostgreSQL, and one leaves, is linearizable, key by key, with a
/// final read of every key after the faults.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stored_counter_stays_linearizable_through_kills_pauses_cuts_and_leaves() {
    let _serial = SERIAL.lock().await;
    // The nodes reach PostgreSQL through proxies: make sure the test
    // database exists (run alone, no other test has made it).
    let db = test_database().await;
    let namespace = unique_namespace("stored-lin");
    let proxies: Vec<PgProxy> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(PgProxy::start().await);
        }
        out
    };
    let specs: Vec<NodeSpec> = proxies
        .iter()
        .enumerate()
        .map(|(i, p)| stored_spec(&namespace, &format!("n{}", i + 1), p.arbiter_url(), &[]))
        .collect();
    let mut nodes = start_nodes(&specs).await;
    let urls = Arc::new(RwLock::new(
        nodes.iter().map(|n| n.url.clone()).collect::<Vec<_>>(),
    ));
    let record = Arc::new(Record::default());
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..WORKERS)
        .map(|w| tokio::spawn(client(w, urls.clone(), record.clone(), stop.clone())))
        .collect();
    let pause = |d: Duration| tokio::time::sleep(d);

    // A crash: n1 (the leader) SIGKILLed under load, then started again.
    pause(Duration::from_secs(2)).await;
    nodes[0].kill9();
    pause(LEASE_TTL + Duration::from_secs(1)).await;
    nodes[0].rename_log("killed");
    let mut again = ClusterNode::spawn(&specs[0]).await;
    again.wait_current(START_LIMIT).await;
    urls.write().unwrap()[0] = again.url.clone();
    nodes[0] = again;

    // A pause past the TTL: n2 stopped mid-load, resumed after its
    // partitions moved (its in-flight commits must not land).
    pause(Duration::from_secs(2)).await;
    nodes[1].signal("STOP");
    pause(LEASE_TTL * 2).await;
    nodes[1].signal("CONT");

    // A cut: n3 loses PostgreSQL (arbiter and store) for twice the TTL.
    pause(Duration::from_secs(2)).await;
    proxies[2].set_cut(true);
    pause(LEASE_TTL * 2).await;
    proxies[2].set_cut(false);

    // A leave: n1 hands its partitions off and exits.
    pause(Duration::from_secs(2)).await;
    urls.write().unwrap().remove(0);
    let mut leaver = nodes.remove(0);
    leaver.leave_and_exit(Duration::from_secs(15)).await;
    pause(Duration::from_secs(2)).await;
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        c.await.expect("a client panicked");
    }

    // After the faults: every key read once more, through a survivor, once
    // the cluster has settled.
    wait_settled(&nodes).await;
    for k in 0..KEYS {
        let key = format!("k{k}");
        let invoked = Instant::now();
        let value = nodes[k % nodes.len()]
            .call_settled("stored", &key, "get")
            .await
            .unwrap_or_else(|e| panic!("the final read of {key}: {e:?}"));
        record.push(
            &key,
            Event {
                client: WORKERS,
                op: Op::Get,
                answer: Some(value.trim().parse().expect("a number")),
                invoked,
                returned: Instant::now(),
            },
        );
    }

    {
        let histories = record.keys.lock().unwrap();
        let answered_incrs = histories
            .values()
            .flatten()
            .filter(|e| e.op == Op::Incr && e.answer.is_some())
            .count();
        let unknown = histories
            .values()
            .flatten()
            .filter(|e| e.answer.is_none())
            .count();
        eprintln!(
            "stored counter: {answered_incrs} answered incrs, {unknown} of unknown outcome, {} keys",
            histories.len()
        );
        assert!(
            answered_incrs >= 200,
            "only {answered_incrs} incrs were answered: the load did not run"
        );
        let mut failures = Vec::new();
        for (key, history) in histories.iter() {
            if let Err(why) = counter_history::check(history) {
                failures.push(format!("{key}: {why}"));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    }
    drop(nodes);
    drop_namespace(&db, &namespace).await;
}

/// A stored counter in the embedded backend survives `kill -9` of its node:
/// a node started again on the same data directory serves every answered
/// `incr`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedded_stored_counter_survives_kill_9_and_a_restart() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().expect("a data directory");
    let data_dir = dir.path().to_str().expect("a UTF-8 path").to_owned();
    let namespace = unique_namespace("stored-embedded");
    let spec = stored_spec(
        &namespace,
        "n1",
        "local".to_owned(),
        &["--data-dir", &data_dir],
    );
    let mut node = ClusterNode::spawn(&spec).await;
    node.wait_current(START_LIMIT).await;
    for i in 1..=5u64 {
        let key = format!("k{}", i % 2);
        node.call_settled("stored", &key, "incr")
            .await
            .unwrap_or_else(|e| panic!("incr #{i} of {key}: {e:?}"));
    }
    node.kill9();
    node.rename_log("killed");
    let mut again = ClusterNode::spawn(&spec).await;
    again.wait_current(START_LIMIT).await;
    assert_eq!(
        again.call_settled("stored", "k0", "get").await.unwrap(),
        "2"
    );
    assert_eq!(
        again.call_settled("stored", "k1", "get").await.unwrap(),
        "3"
    );
    assert_eq!(
        again.call_settled("stored", "k1", "incr").await.unwrap(),
        "4"
    );
    let status = again.status().await.expect("a status");
    assert!(
        status["storage"]
            .as_str()
            .is_some_and(|s| s.contains("state.redb")),
        "fief status names the embedded file: {status}"
    );
}

/// A durable alarm survives `kill -9` of its node (issue 20 item 4): set
/// 1.5 s ahead on an embedded node, the node killed at once, it fires once
/// on the node started again on the same data directory (the alarm row was
/// committed with the callback that set it; the new run's partition load
/// finds it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_alarm_fires_after_kill_9_of_its_node_and_a_restart() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().expect("a data directory");
    let data_dir = dir.path().to_str().expect("a UTF-8 path").to_owned();
    let namespace = unique_namespace("alarms-embedded");
    let mut spec = stored_spec(
        &namespace,
        "n1",
        "local".to_owned(),
        &["--data-dir", &data_dir],
    );
    spec.deploy = vec![("reminders".to_owned(), guests::REMINDERS.to_owned())];
    let mut node = ClusterNode::spawn(&spec).await;
    node.wait_current(START_LIMIT).await;
    node.call_settled("reminders", "k", "set wake 1500")
        .await
        .expect("the alarm is set");
    node.kill9();
    node.rename_log("killed");
    let mut again = ClusterNode::spawn(&spec).await;
    again.wait_current(START_LIMIT).await;
    let mut log = String::new();
    for _ in 0..100 {
        log = again
            .call_settled("reminders", "k", "fired")
            .await
            .expect("the log");
        if !log.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Once, and not again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = again
        .call_settled("reminders", "k", "fired")
        .await
        .expect("the log");
    assert_eq!(later, log);
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 1, "{log:?}");
    assert!(lines[0].starts_with("wake 1 "), "{log:?}");
}
