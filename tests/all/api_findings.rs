//! What Schemathesis found in the HTTP API (issue 22 item 2;
//! `tests/all/schemathesis.rs`, `docs/testing.md` "Schemathesis"), each
//! pinned by a plain test so it cannot come back unnoticed even where a
//! fuzzing run would miss it.

use std::sync::Arc;

use fief_tests::{HttpServer, guests, node_with};

/// A call, a kill, a call: the second call starts a fresh process. Before,
/// the kill answered while the killed process still held the key's entry,
/// the call queued on it and died with it (`500 key_died`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_right_after_a_kill_reaches_a_fresh_process() {
    let node = Arc::new(node_with(&[("counter", guests::COUNTER)]).await);
    let server = HttpServer::start(node).await;
    let client = reqwest::Client::new();
    for round in 0..40 {
        let key = format!("k{round}");
        let call = || {
            client
                .post(server.url(&format!("/v1/keys/counter/{key}/call")))
                .body("incr")
                .send()
        };
        let first = call().await.unwrap();
        assert_eq!(first.status(), 200, "round {round}");
        let killed: serde_json::Value = client
            .delete(server.url(&format!("/v1/keys/counter/{key}")))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(killed["killed"], true, "round {round}");
        let second = call().await.unwrap();
        let status = second.status();
        let body = second.text().await.unwrap();
        assert_eq!(
            (status.as_u16(), body.as_str()),
            (200, "1"),
            "round {round}"
        );
    }
}

/// Every key route refuses a key over 1024 bytes with `400 invalid_key`.
/// Before, a kill answered `200 {"killed": false}` and a state read
/// `200 {"entries": []}` for a key no call could reach.
#[tokio::test]
async fn key_routes_refuse_a_key_over_the_limit() {
    let node = Arc::new(node_with(&[("counter", guests::COUNTER)]).await);
    let server = HttpServer::start(node).await;
    let client = reqwest::Client::new();
    let key = "k".repeat(1025);
    let requests = [
        client.delete(server.url(&format!("/v1/keys/counter/{key}"))),
        client.get(server.url(&format!("/v1/state/counter/{key}"))),
        client.get(server.url(&format!("/v1/alarms/counter/{key}"))),
        client.get(server.url(&format!("/v1/keys/counter/{key}/connect"))),
        client.post(server.url(&format!("/v1/keys/counter/{key}/call"))),
        client.post(server.url(&format!("/v1/keys/counter/{key}/cast"))),
    ];
    for request in requests {
        let response = request.send().await.unwrap();
        let url = response.url().path().chars().take(40).collect::<String>();
        let status = response.status().as_u16();
        let body: serde_json::Value = response.json().await.unwrap();
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (400, Some("invalid_key")),
            "{url}…: {body}"
        );
    }
}

/// A cache write with both `If-Match` and `If-None-Match: *` can never meet
/// both (one needs an entry, the other none): `412`, nothing written.
/// Before, `If-None-Match` won and `If-Match` was ignored.
#[tokio::test]
async fn a_cache_write_with_both_preconditions_is_refused() {
    let node = Arc::new(node_with(&[]).await);
    let server = HttpServer::start(node).await;
    let client = reqwest::Client::new();
    let url = server.url("/v1/cache/sessions/alice");
    let both = |version: &str| {
        client
            .put(&url)
            .header("If-Match", format!("\"{version}\""))
            .header("If-None-Match", "*")
            .body("overwritten")
    };

    let response = both("7").send().await.unwrap();
    assert_eq!(response.status(), 412);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["error"]["code"], "version_conflict", "{body}");
    assert_eq!(client.get(&url).send().await.unwrap().status(), 404);

    let written = client.put(&url).body("kept").send().await.unwrap();
    let version = written.headers()["etag"]
        .to_str()
        .unwrap()
        .trim_matches('"')
        .to_owned();
    let response = both(&version).send().await.unwrap();
    assert_eq!(response.status(), 412);
    let read = client.get(&url).send().await.unwrap();
    assert_eq!(read.text().await.unwrap(), "kept");
    let deleted = client
        .delete(&url)
        .header("If-Match", format!("\"{version}\""))
        .header("If-None-Match", "*")
        .send()
        .await
        .unwrap();
    assert_eq!(deleted.status(), 412);
    assert_eq!(client.get(&url).send().await.unwrap().status(), 200);
}
