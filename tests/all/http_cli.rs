//! The interfaces (contract §3 "Interfaces"; issue items 8 and 9): the HTTP
//! API on a real socket (deploy, call, cast, status, keys, kill) and the
//! `fief` binary (node, deploy, call, cast, status), run as a child process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief_tests::{
    HttpServer, NodeProcess, eventually, eventually_async, fief_cli, guests, is_live, node_with,
};

// ---- HTTP ----

#[tokio::test]
async fn http_deploys_calls_casts_and_reports() {
    let node = Arc::new(node_with(&[]).await);
    let server = HttpServer::start(node.clone()).await;
    let client = reqwest::Client::new();

    let response = client
        .put(server.url("/v1/modules/counter"))
        .body(guests::bytes(guests::COUNTER))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let info: serde_json::Value = response.json().await.unwrap();
    assert_eq!(
        (info["name"].as_str(), info["version"].as_u64()),
        (Some("counter"), Some(1))
    );

    for expected in ["1", "2"] {
        let response = client
            .post(server.url("/v1/keys/counter/alice/call"))
            .body("incr")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), expected, "the raw reply");
    }

    // A cast is accepted at once and then processed: bob starts ticking.
    let response = client
        .post(server.url("/v1/keys/counter/bob/cast"))
        .body("tick-every 10")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202);
    eventually_async(Duration::from_secs(5), "bob ticks", || async {
        let reply = client
            .post(server.url("/v1/keys/counter/bob/call"))
            .body("get")
            .send()
            .await
            .unwrap();
        reply.text().await.unwrap() != "0"
    })
    .await;

    let status: serde_json::Value = reqwest::get(server.url("/v1/status"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status["lease"], "current", "{status}");
    assert_eq!(status["partitions_owned"], 1024, "{status}");
    assert_eq!(status["modules"][0]["name"], "counter", "{status}");
}

#[tokio::test]
async fn http_lists_and_kills_keys() {
    let node = Arc::new(node_with(&[("counter", guests::COUNTER)]).await);
    let server = HttpServer::start(node.clone()).await;
    let client = reqwest::Client::new();
    let call = |message: &'static str| {
        client
            .post(server.url("/v1/keys/counter/alice/call"))
            .body(message)
            .send()
    };
    assert_eq!(call("incr").await.unwrap().text().await.unwrap(), "1");

    let keys: serde_json::Value = reqwest::get(server.url("/v1/keys"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let listed = keys.as_array().expect("a list of keys");
    assert_eq!(listed.len(), 1, "{keys}");
    assert_eq!(
        (&listed[0]["module"], &listed[0]["key"]),
        (&"counter".into(), &"alice".into())
    );

    let response = client
        .delete(server.url("/v1/keys/counter/alice"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["killed"], true, "{body}");
    eventually(Duration::from_secs(5), "alice is gone", || {
        !is_live(&node, "counter", "alice")
    })
    .await;
    // Its state died with it (guarantee 4): a fresh process starts at 0.
    assert_eq!(call("get").await.unwrap().text().await.unwrap(), "0");
}

// ---- CLI ----

/// stdout of a successful `fief` run, trimmed.
fn cli_ok(args: &[&str]) -> String {
    let output = fief_cli(args);
    assert!(
        output.status.success(),
        "fief {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// stderr of a failing `fief` run, trimmed; it must be one line.
fn cli_err(args: &[&str]) -> String {
    let output = fief_cli(args);
    assert!(!output.status.success(), "fief {args:?} succeeded");
    let stderr = String::from_utf8(output.stderr).unwrap().trim().to_owned();
    assert_eq!(stderr.lines().count(), 1, "one line of stderr: {stderr:?}");
    stderr
}

#[test]
fn cli_runs_a_node_and_calls_casts_and_reports() {
    let node = NodeProcess::start(&["--deploy", &format!("counter={}", guests::COUNTER)]);
    let url = node.url.as_str();

    assert_eq!(
        cli_ok(&["call", "--node", url, "counter", "alice", "incr"]),
        "1"
    );
    assert_eq!(
        cli_ok(&["call", "--node", url, "counter", "alice", "incr"]),
        "2"
    );
    assert_eq!(
        cli_ok(&["call", "--node", url, "counter", "bob", "get"]),
        "0"
    );

    // A cast is delivered: carol starts ticking.
    cli_ok(&["cast", "--node", url, "counter", "carol", "tick-every 20"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while cli_ok(&["call", "--node", url, "counter", "carol", "get"]) == "0" {
        assert!(Instant::now() < deadline, "carol never ticked");
        std::thread::sleep(Duration::from_millis(20));
    }
    cli_ok(&["cast", "--node", url, "counter", "carol", "stop-ticking"]);

    let status: serde_json::Value =
        serde_json::from_str(&cli_ok(&["status", "--json", "--node", url])).expect("JSON status");
    assert_eq!(status["lease"], "current", "{status}");
    assert_eq!(status["modules"][0]["name"], "counter", "{status}");
    assert!(cli_ok(&["status", "--node", url]).contains("module counter"));

    let stderr = cli_err(&["call", "--node", url, "nosuch", "alice", "get"]);
    assert!(stderr.contains("unknown module"), "{stderr}");
}

#[test]
fn cli_deploys_with_options_and_refuses_bad_ones() {
    let node = NodeProcess::start(&[]);
    let url = node.url.as_str();

    let out = cli_ok(&[
        "deploy",
        guests::COUNTER,
        "--module",
        "m2",
        "--node",
        url,
        "-o",
        "memory_limit=32MiB",
    ]);
    assert!(out.contains("m2"), "{out}");
    assert_eq!(cli_ok(&["call", "--node", url, "m2", "k", "incr"]), "1");
    let status: serde_json::Value =
        serde_json::from_str(&cli_ok(&["status", "--json", "--node", url])).expect("JSON status");
    assert_eq!(status["modules"][0]["name"], "m2", "{status}");
    assert_eq!(
        status["modules"][0]["options"]["memory_limit"],
        serde_json::to_value(fief::config::ByteSize::mib(32)).unwrap(),
        "{status}"
    );

    let stderr = cli_err(&[
        "deploy",
        guests::COUNTER,
        "--module",
        "m3",
        "--node",
        url,
        "-o",
        "cpu_limit=soon",
    ]);
    assert!(stderr.contains("cpu_limit"), "{stderr}");
    let stderr = cli_err(&[
        "deploy",
        guests::COUNTER,
        "--module",
        "m3",
        "--node",
        url,
        "-o",
        "nonsense",
    ]);
    assert!(stderr.contains("NAME=VALUE"), "{stderr}");
}

#[test]
fn cli_without_a_node_says_so_in_one_line() {
    let url = format!("http://127.0.0.1:{}", fief_tests::free_port());
    let stderr = cli_err(&["status", "--node", &url]);
    assert!(stderr.contains("cannot reach the node"), "{stderr}");
}

/// Issue "Single-node key runtime" item 6: a guest's stdout and its `log`
/// lines go to the node's log, tagged with the module and the key, as plain
/// text (no terminal colour codes in a log file).
#[test]
fn guest_output_goes_to_the_node_log_tagged_with_its_key() {
    let node = NodeProcess::start(&["--deploy", &format!("probe={}", guests::PROBE)]);
    let url = node.url.as_str();
    assert_eq!(
        cli_ok(&[
            "call",
            "--node",
            url,
            "probe",
            "carol",
            "print hello-from-the-guest"
        ]),
        "ok"
    );
    assert_eq!(
        cli_ok(&[
            "call",
            "--node",
            url,
            "probe",
            "carol",
            "log logged-by-the-guest"
        ]),
        "ok"
    );
    let tagged = |log: &str, text: &str| {
        log.lines().any(|l| {
            l.contains(text) && l.contains("module=\"probe\"") && l.contains("key=\"carol\"")
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = node.log_text();
        if tagged(&log, "hello-from-the-guest") && tagged(&log, "logged-by-the-guest") {
            assert!(
                !log.contains('\u{1b}'),
                "the log file holds terminal escape codes:\n{log}"
            );
            assert!(
                log.lines()
                    .any(|l| l.contains("hello-from-the-guest") && l.contains("stdout")),
                "{log}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the guest's lines never reached the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The client crate (`fief-client`, which the CLI uses) against a real node
/// over a real socket: deploy, call, cast, state, status, kill, metrics,
/// the cache's compare-and-set, and the API's refusals as typed errors.
#[tokio::test]
async fn the_client_crate_drives_a_real_node_with_typed_errors() {
    use fief_client::{CacheExpect, Client, Error};
    let node = Arc::new(node_with(&[]).await);
    let server = HttpServer::start(node.clone()).await;
    let client = Client::new(&server.base).unwrap();
    let deployed = client
        .deploy(
            "counter",
            guests::bytes(guests::COUNTER),
            &[("cpu_limit", "200ms")],
        )
        .await
        .unwrap();
    assert_eq!((deployed.name.as_str(), deployed.version), ("counter", 1));
    assert_eq!(client.call("counter", "alice", "incr").await.unwrap(), b"1");
    // The counter counts its ticks: a cast starts them.
    client
        .cast("counter", "alice", "tick-every 10")
        .await
        .unwrap();
    eventually_async(Duration::from_secs(10), "the cast was handled", || async {
        client.call("counter", "alice", "get").await.ok() != Some(b"1".to_vec())
    })
    .await;
    assert_eq!(
        client.status().await.unwrap()["modules"][0]["name"],
        "counter"
    );
    assert!(client.metrics().await.unwrap().contains("fief_"));
    assert!(client.kill("counter", "alice").await.unwrap());

    let v1 = client
        .cache_put("c", "k", "one", None, CacheExpect::Absent)
        .await
        .unwrap();
    let stale = client
        .cache_put("c", "k", "two", None, CacheExpect::Version(v1 + 7))
        .await
        .unwrap_err();
    assert_eq!(stale.code(), Some("version_conflict"), "{stale}");
    let entry = client.cache_get("c", "k").await.unwrap().unwrap();
    assert_eq!((entry.value.as_slice(), entry.version), (&b"one"[..], v1));
    assert!(
        client
            .cache_delete("c", "k", CacheExpect::Version(v1))
            .await
            .unwrap()
    );
    assert_eq!(client.cache_get("c", "k").await.unwrap(), None);

    let unknown = client.call("nope", "alice", "incr").await.unwrap_err();
    match &unknown {
        Error::Api(e) => {
            assert_eq!((e.status, e.code.as_str()), (404, "unknown_module"));
            assert!(!e.is_refusal());
        }
        other => panic!("expected the API's error, got {other:?}"),
    }
    let bad = client
        .deploy(
            "counter",
            guests::bytes(guests::COUNTER),
            &[("cpu_limit", "forever")],
        )
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Some("invalid_options"), "{bad}");
}
