//! Trace context across real `fief node` processes (issue 22 item 4;
//! `docs/design.md`, "Trace context"): one W3C `traceparent` trace id
//! follows a request from the client to a node that does not own the key,
//! over the peer link to the owner, into the guest's log line there, and
//! through a key-to-key call back over the peer link to the other node.
//!
//! Two nodes share a namespace in PostgreSQL (`FAST_TIMINGS`). Keys of the
//! `probe` guest are chosen from the partition table. The test checks that:
//!
//! 1. a call sent to the non-owner with a `traceparent` is answered with a
//!    `traceparent` of the same trace id (and this node's own span id), and
//!    the owner's log has the guest's line with `trace_id=<that id>`;
//! 2. a key-to-key call made while handling a traced call carries the
//!    trace: the callee (owned by the first node, reached over the peer
//!    link) logs its line with the same `trace_id`;
//! 3. an invalid `traceparent` (uppercase hex) is not refused: the call is
//!    answered, in a new trace.
//!
//! Without the response header step 1 fails at once; without the trace on
//! the peer link (or in the key's envelope, or in its log lines) the
//! owner's line has no `trace_id`; without carrying it into the key's own
//! calls step 2's line has none. The test takes the process tests' lock
//! (`processes::SERIAL`).

use std::time::{Duration, Instant};

use fief::core::PartitionCount;
use fief_tests::guests;
use fief_tests::multiprocess::{
    ClusterNode, FAST_TIMINGS, NodeSpec, PG_ADDR, arbiter_url, drop_namespace, test_database,
    unique_namespace,
};

use crate::processes::{SERIAL, start_nodes, wait_settled};

/// How long a log line may take to reach the node's log file.
const PATIENCE: Duration = Duration::from_secs(10);

fn spec(namespace: &str, node_id: &str) -> NodeSpec {
    NodeSpec {
        node_id: node_id.to_owned(),
        namespace: namespace.to_owned(),
        arbiter: arbiter_url(PG_ADDR),
        deploy: vec![("probe".to_owned(), guests::PROBE.to_owned())],
        extra_args: FAST_TIMINGS.iter().map(|s| (*s).to_owned()).collect(),
    }
}

/// A key `<prefix><i>` whose partition `node` owns per the arbiter's table.
async fn key_of(db: &tokio_postgres::Client, namespace: &str, node: &str, prefix: &str) -> String {
    let rows = db
        .query(
            "SELECT partition FROM fief_partitions WHERE namespace = $1 AND node_id = $2",
            &[&namespace, &node],
        )
        .await
        .expect("reading fief_partitions");
    let owned: Vec<u32> = rows
        .iter()
        .map(|row| u32::try_from(row.get::<_, i32>(0)).expect("a partition number"))
        .collect();
    (0..100_000)
        .map(|i| format!("{prefix}{i}"))
        .find(|key| owned.contains(&PartitionCount::default().of(key).0))
        .unwrap_or_else(|| panic!("{node} owns no key {prefix}*"))
}

/// `POST /v1/keys/probe/{key}/call` with `message` and `traceparent`: the
/// reply and the response's `traceparent`.
async fn traced_call(
    node: &ClusterNode,
    key: &str,
    message: &str,
    traceparent: &str,
) -> (String, String) {
    let response = reqwest::Client::new()
        .post(format!("{}/v1/keys/probe/{key}/call", node.url))
        .header("traceparent", traceparent)
        .body(message.to_owned())
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("the call was answered");
    let header = response
        .headers()
        .get("traceparent")
        .map(|v| v.to_str().expect("ASCII").to_owned())
        .unwrap_or_default();
    let status = response.status();
    let body = response.text().await.unwrap_or_default();
    assert!(
        status.is_success(),
        "call {message:?} to {key}: {status} {body}"
    );
    (body, header)
}

/// Wait until `node`'s log has a line with `marker`; that line.
async fn logged_line(node: &ClusterNode, marker: &str) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(line) = node.log_text().lines().find(|l| l.contains(marker)) {
            return line.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "{} never logged {marker:?}; its log ends:\n{}",
            node.node_id,
            node.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_id_follows_a_call_to_the_owner_s_guest_log_and_through_key_calls() {
    let _serial = SERIAL.lock().await;
    let db = test_database().await;
    let namespace = unique_namespace("trace-context");
    let nodes = start_nodes(&[spec(&namespace, "n1"), spec(&namespace, "n2")]).await;
    wait_settled(&nodes).await;
    let (n1, n2) = (&nodes[0], &nodes[1]);
    let owned_by_n2 = key_of(&db, &namespace, "n2", "traced-").await;
    let owned_by_n1 = key_of(&db, &namespace, "n1", "callee-").await;

    // 1. Client → n1 (not the owner) → peer link → n2's guest log.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let sent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let marker = format!("traced-marker-{namespace}");
    let (reply, answered) = traced_call(n1, &owned_by_n2, &format!("log {marker}"), &sent).await;
    assert_eq!(reply, "ok");
    let parts: Vec<&str> = answered.split('-').collect();
    assert_eq!(
        parts.len(),
        4,
        "the response's traceparent {answered:?} is not one"
    );
    assert_eq!(
        (parts[0], parts[1]),
        ("00", trace_id),
        "the response's traceparent {answered:?} is not of the trace sent"
    );
    assert_ne!(
        parts[2], "00f067aa0ba902b7",
        "n1 answers with its own span id"
    );
    let line = logged_line(n2, &marker).await;
    assert!(
        line.contains(&format!("trace_id={trace_id}")),
        "the owner's guest log line has not the trace id: {line}"
    );
    assert!(
        !n1.log_text().contains(&marker),
        "the guest ran on n1, which does not own {owned_by_n2}"
    );

    // 2. Client → n1 → n2's key → key-to-key call → n1's key's guest log.
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let sent = format!("00-{trace_id}-b7ad6b7169203331-01");
    let marker = format!("key-call-marker-{namespace}");
    let command = format!("call probe {owned_by_n1} log {marker}");
    let (reply, answered) = traced_call(n1, &owned_by_n2, &command, &sent).await;
    assert_eq!(reply, "ok", "the key-to-key call");
    assert!(
        answered.starts_with(&format!("00-{trace_id}-")),
        "{answered}"
    );
    let line = logged_line(n1, &marker).await;
    assert!(
        line.contains(&format!("trace_id={trace_id}")),
        "the callee's guest log line has not the caller's trace id: {line}"
    );

    // 3. An invalid traceparent is ignored: a new trace, never a refusal.
    let invalid = format!("00-{}-00F067AA0BA902B7-01", trace_id.to_uppercase());
    let (reply, answered) = traced_call(n1, &owned_by_n2, "ping", &invalid).await;
    assert_eq!(reply, "pong");
    assert!(
        answered.starts_with("00-") && answered.len() == 55 && !answered.contains(trace_id),
        "a new trace: {answered:?}"
    );

    drop(nodes);
    drop_namespace(&db, &namespace).await;
}
