//! Operator experience (issue 10): Prometheus metrics at `/metrics` that
//! move with calls and fences, the cluster view and its server-sent event
//! stream, `fief status` (`--json`, `--watch`, the readable summary), and
//! `fief node --log-format json`. The browser test of the dashboard page is
//! `dashboard.rs`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use fief_tests::{
    HttpServer, NodeProcess, call_text, eventually, eventually_async, fief_binary, fief_cli,
    guests, node_with,
};

use fief_tests::metric_value as metric;

async fn scrape(server: &HttpServer) -> String {
    let response = reqwest::get(server.url("/metrics"))
        .await
        .expect("GET /metrics");
    assert!(response.status().is_success(), "{response:?}");
    let content_type = response.headers()["content-type"]
        .to_str()
        .expect("ASCII")
        .to_owned();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    response.text().await.expect("the metrics text")
}

/// Issue 10 item 1: every family the issue lists is present, and the
/// counters move after a call (activation, call count, latency histogram)
/// and after a fence (the fence by cause, the key killed by the fence).
#[tokio::test]
async fn metrics_are_present_and_move_after_a_call_and_a_fence() {
    let node = Arc::new(node_with(&[("counter", guests::COUNTER)]).await);
    let server = HttpServer::start(node.clone()).await;
    let before = scrape(&server).await;
    for family in [
        "fief_lease_remaining_seconds",
        "fief_lease_renewals_total",
        "fief_lease_state",
        "fief_partitions_owned",
        "fief_table_epoch",
        "fief_leader_term",
        "fief_live_keys",
        "fief_limbo_entries",
        "fief_mailbox_depth",
        "fief_cache_operations_total",
        "fief_module_compile_seconds",
    ] {
        assert!(before.contains(family), "{family} missing from:\n{before}");
    }
    assert_eq!(
        metric(&before, r#"fief_lease_state{state="current"}"#),
        Some(1.0),
        "{before}"
    );
    assert!(metric(&before, "fief_lease_remaining_seconds").unwrap_or(0.0) > 0.0);
    assert_eq!(
        metric(&before, "fief_partitions_owned"),
        Some(node.status().partitions_owned as f64)
    );
    assert!(
        metric(&before, r#"fief_lease_renewals_total{outcome="ok"}"#).unwrap_or(0.0) >= 1.0,
        "the registration counts as a renewal:\n{before}"
    );
    assert!(
        metric(
            &before,
            r#"fief_module_compile_seconds_count{cached="false"}"#
        )
        .or_else(|| metric(
            &before,
            r#"fief_module_compile_seconds_count{cached="true"}"#
        ))
        .unwrap_or(0.0)
            >= 1.0,
        "{before}"
    );
    assert_eq!(
        metric(
            &before,
            r#"fief_calls_total{module="counter",route="local",outcome="ok"}"#
        ),
        None
    );

    assert_eq!(call_text(&node, "counter", "alice", "incr").await, "1");
    let after_call = scrape(&server).await;
    assert_eq!(
        metric(
            &after_call,
            r#"fief_calls_total{module="counter",route="local",outcome="ok"}"#
        ),
        Some(1.0),
        "{after_call}"
    );
    assert_eq!(
        metric(
            &after_call,
            r#"fief_key_activations_total{module="counter"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&after_call, r#"fief_live_keys{module="counter"}"#),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &after_call,
            r#"fief_call_duration_seconds_count{route="local"}"#
        ),
        Some(1.0)
    );

    node.fence_now();
    let server = &server;
    eventually_async(
        Duration::from_secs(10),
        "the fence's kill counted",
        || async {
            let text = scrape(server).await;
            metric(&text, r#"fief_fences_total{cause="requested"}"#) == Some(1.0)
                && metric(
                    &text,
                    r#"fief_key_kills_total{module="counter",cause="fence"}"#,
                ) == Some(1.0)
        },
    )
    .await;
}

/// Issue 10 item 4: `GET /v1/cluster` gives every partition's owner, the
/// members and the modules; `GET /v1/cluster/events` streams the same as
/// `snapshot` events, the first at once.
#[tokio::test]
async fn the_cluster_view_and_its_event_stream() {
    let node = Arc::new(node_with(&[("counter", guests::COUNTER)]).await);
    let server = HttpServer::start(node.clone()).await;
    call_text(&node, "counter", "bob", "incr").await;
    let view: serde_json::Value = reqwest::get(server.url("/v1/cluster"))
        .await
        .expect("GET /v1/cluster")
        .json()
        .await
        .expect("JSON");
    let me = node.status().node_id;
    let owners = view["owners"].as_array().expect("owners");
    assert_eq!(owners.len() as u32, node.status().partitions);
    assert!(
        owners.iter().all(|o| o.as_str() == Some(me.as_str())),
        "{view}"
    );
    assert_eq!(view["lease"], "current");
    assert_eq!(view["nodes"][0]["id"].as_str(), Some(me.as_str()));
    assert_eq!(view["modules"][0]["name"], "counter");
    assert_eq!(view["modules"][0]["calls_served"], 1);

    let mut stream = reqwest::get(server.url("/v1/cluster/events"))
        .await
        .expect("GET /v1/cluster/events");
    assert_eq!(
        stream.headers()["content-type"].to_str().ok(),
        Some("text/event-stream")
    );
    // Two snapshots: the first comes at once, the next one a period later.
    let mut text = String::new();
    let mut snapshots = Vec::new();
    let read = async {
        while snapshots.len() < 2 {
            let chunk = stream.chunk().await.expect("reading the stream");
            let chunk = chunk.expect("the stream stays open");
            text.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = text.find("\n\n") {
                let event: String = text.drain(..end + 2).collect();
                if event.contains("event: snapshot") {
                    let data: String = event
                        .lines()
                        .filter_map(|l| l.strip_prefix("data: ").or(l.strip_prefix("data:")))
                        .collect();
                    snapshots
                        .push(serde_json::from_str::<serde_json::Value>(&data).expect("JSON data"));
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("two snapshots within 20 s");
    for snapshot in &snapshots {
        assert_eq!(snapshot["node_id"].as_str(), Some(me.as_str()));
        assert_eq!(
            snapshot["owners"].as_array().map(Vec::len),
            Some(owners.len())
        );
    }
    assert!(snapshots[1]["at_ms"].as_u64() > snapshots[0]["at_ms"].as_u64());
}

/// Issue 10 item 4: the page and its assets are served from the binary.
#[tokio::test]
async fn the_dashboard_page_is_embedded() {
    let node = Arc::new(node_with(&[]).await);
    let server = HttpServer::start(node).await;
    for (path, kind, needle) in [
        ("/", "text/html", "/dashboard.js"),
        ("/dashboard.js", "text/javascript", "/v1/cluster"),
        ("/dashboard.css", "text/css", "#grid"),
    ] {
        let response = reqwest::get(server.url(path)).await.expect("GET");
        assert!(response.status().is_success(), "{path}: {response:?}");
        let content_type = response.headers()["content-type"]
            .to_str()
            .unwrap_or_default()
            .to_owned();
        assert!(content_type.starts_with(kind), "{path}: {content_type}");
        let body = response.text().await.expect("body");
        assert!(body.contains(needle), "{path} lacks {needle}");
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{path} loads nothing from elsewhere"
        );
    }
}

/// Issue 10 items 2 and 3 against a real `fief node`: `--log-format json`
/// writes one JSON object per line; `fief status --json` is the status with
/// its limbo added; the text summary draws lease bars; `--watch --json`
/// prints one object per refresh.
#[tokio::test]
async fn json_logs_and_fief_status() {
    let node = tokio::task::spawn_blocking(|| {
        NodeProcess::start(&[
            "--log-format",
            "json",
            "--deploy",
            &format!("counter={}", guests::COUNTER),
            "--deploy",
            &format!("probe={}", guests::PROBE),
        ])
    })
    .await
    .expect("starting the node");
    let url = node.url.clone();
    let out = fief_cli(&["call", "--node", &url, "counter", "carol", "incr"]);
    assert!(out.status.success(), "{out:?}");
    for message in ["print from-stdout", "log from-host-log"] {
        let out = fief_cli(&["call", "--node", &url, "probe", "dave", message]);
        assert!(out.status.success(), "{out:?}");
    }

    let log = node.log_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l["fields"]["message"] == "node started" && l["level"] == "INFO"),
        "{log}"
    );
    // Guest output is tagged with its module and key.
    for text in ["from-stdout", "from-host-log"] {
        assert!(
            lines.iter().any(|l| l["target"] == "fief::guest"
                && l["fields"]["message"] == text
                && l["fields"]["module"] == "probe"
                && l["fields"]["key"] == "dave"),
            "no tagged guest line {text:?} in:\n{log}"
        );
    }

    let status: serde_json::Value =
        serde_json::from_slice(&fief_cli(&["status", "--json", "--node", &url]).stdout)
            .expect("JSON status");
    assert!(status["limbo"].is_array(), "{status}");
    assert!(status["lease_ttl_ms"].as_u64() > Some(0), "{status}");
    assert_eq!(status["nodes"].as_array().map(Vec::len), Some(1));

    let text = String::from_utf8(fief_cli(&["status", "--node", &url]).stdout).expect("UTF-8");
    assert!(text.contains("leader "), "{text}");
    assert!(text.contains("[#"), "a lease bar: {text}");
    assert!(text.contains("in limbo: 0"), "{text}");
    assert!(text.contains("module counter"), "{text}");

    let frames = tokio::task::spawn_blocking(move || {
        let mut child = Command::new(fief_binary())
            .args([
                "status",
                "--watch",
                "--json",
                "--interval",
                "100ms",
                "--node",
                &url,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("fief status --watch");
        let stdout = child.stdout.take().expect("piped stdout");
        let frames: Vec<serde_json::Value> = BufReader::new(stdout)
            .lines()
            .take(3)
            .map(|l| serde_json::from_str(&l.expect("a line")).expect("one JSON object a line"))
            .collect();
        let _ = child.kill();
        let _ = child.wait();
        frames
    })
    .await
    .expect("watching");
    assert_eq!(frames.len(), 3);
    assert!(frames.iter().all(|f| f["node_id"].is_string()));
    drop(node);
}

/// Issue 18 item 4: the inline fast path (a warm call to an idle key runs on
/// its caller's task) stays on when events are logged, and the event log
/// records the calls it serves, so chaos runs (`--event-log`) exercise it
/// and the history checker sees them. Ten calls to one key: the first
/// activates it on the caller's task, later ones run inline
/// (`fief_calls_inline_total`; all ten when the machine is quiet), and all
/// ten are `Processing` events. Before, a node with an event observer never
/// ran a call inline (the counter stayed at 0); with inline calls
/// unreported, the log held fewer events than calls.
#[tokio::test]
async fn inline_calls_stay_on_and_are_in_the_event_log() {
    use fief::event_log::{MessageKind, NodeEventKind};
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let events: fief::event_log::NodeEventObserver = {
        let seen = seen.clone();
        Arc::new(move |event: fief::event_log::NodeEvent| {
            if let NodeEventKind::Processing { key, kind, .. } = event.kind {
                seen.lock().unwrap().push((key, kind));
            }
        })
    };
    let node = fief::Instance::builder(fief_tests::test_config())
        .events(events)
        .start()
        .await
        .expect("node starts");
    node.deploy(
        "counter",
        &guests::bytes(guests::COUNTER),
        fief::ModuleOptions::default(),
    )
    .await
    .expect("deploy");
    let node = Arc::new(node);
    // A call runs inline only if the key's task has let go of the process
    // since the last one; on a loaded machine that can take a while, so the
    // calls are spaced out.
    const CALLS: usize = 10;
    for n in 1..=CALLS {
        assert_eq!(
            call_text(&node, "counter", "ada", "incr").await,
            n.to_string()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let server = HttpServer::start(node.clone()).await;
    let text = scrape(&server).await;
    let inline = metric(&text, r#"fief_calls_inline_total{module="counter"}"#).unwrap_or(0.0);
    assert!(
        (1.0..=CALLS as f64).contains(&inline),
        "{inline} of {CALLS} calls ran inline"
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![("ada".to_owned(), MessageKind::Call); CALLS],
        "every routed call is a Processing event"
    );
}

/// A fence of many keys is logged once, with its count (the node's `node
/// fenced ... killed=N` line), and each key's end at `debug` only: a fence
/// of 100 000 keys once wrote 100 000 `key killed` lines at `info`. A key an
/// operator kills alone keeps its own line.
#[test]
fn a_fence_is_one_log_line_with_its_count_and_an_operators_kill_its_own() {
    use crate::hostile_logs::{count, run_captured};
    run_captured(|log| async move {
        let node = node_with(&[("counter", guests::COUNTER)]).await;
        for i in 0..20 {
            node.call("counter", &format!("k{i}"), b"get".to_vec())
                .await
                .expect("activating a key");
        }
        assert!(node.kill_key("counter", "k0"), "k0 was live");
        eventually(Duration::from_secs(10), "k0's end is logged", || {
            count(&log.since(0), "key killed") == 1
        })
        .await;
        node.fence_now();
        eventually(Duration::from_secs(10), "every key has ended", || {
            node.status().live_keys == 0
        })
        .await;
        // The fence's line is written before its keys end.
        let text = log.since(0);
        let killed: Vec<&str> = text.lines().filter(|l| l.contains("key killed")).collect();
        assert!(
            killed.len() == 1 && killed[0].contains("k0") && killed[0].contains("operator"),
            "only the operator's kill has a line of its own:\n{text}"
        );
        let fenced: Vec<&str> = text.lines().filter(|l| l.contains("node fenced")).collect();
        assert!(
            fenced.len() == 1 && fenced[0].contains("killed=19"),
            "the fence is one line with its count:\n{text}"
        );
    });
}
