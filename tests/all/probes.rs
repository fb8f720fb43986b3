//! Health and readiness (issue 22 item 6): `GET /v1/health` answers `200`
//! whenever the process serves HTTP; `GET /v1/ready` answers `200` only
//! while the node holds a current lease and serves, `503` with the reason
//! while it is joining or fenced; neither needs a token, nor does
//! `GET /v1/openapi.json` (`docs/operations.md`, "Health and readiness").
//! The fenced and joining cases run a real `fief node` against PostgreSQL
//! through a proxy that cuts it off.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief::auth::Auth;
use fief::http::ApiOptions;
use fief_tests::multiprocess::{
    ClusterNode, FAST_TIMINGS, NodeSpec, PgProxy, drop_namespace, test_database, unique_namespace,
};
use fief_tests::{guests, node_with};
use serde_json::Value;

/// `GET url`: the status and the body as JSON (`Null` if it is not JSON),
/// or `None` if no answer came within 2 s.
async fn get(url: &str) -> Option<(u16, Value)> {
    let response = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    Some((status, body))
}

/// Poll `GET {node}/v1/ready` until `check` holds (at most `limit`); the
/// last answer.
async fn ready_until(
    node: &ClusterNode,
    limit: Duration,
    what: &str,
    check: impl Fn(u16, &Value) -> bool,
) -> (u16, Value) {
    let deadline = Instant::now() + limit;
    loop {
        let answer = get(&format!("{}/v1/ready", node.url)).await;
        if let Some((status, body)) = &answer
            && check(*status, body)
        {
            return (*status, body.clone());
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {limit:?}; last answer {answer:?}; log:\n{}",
            node.log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn assert_healthy(node: &ClusterNode) {
    let (status, body) = get(&format!("{}/v1/health", node.url))
        .await
        .expect("the node answers /v1/health");
    assert_eq!(
        (status, &body["status"]),
        (200, &Value::from("up")),
        "{body}"
    );
}

fn spec(namespace: &str, arbiter: String) -> NodeSpec {
    NodeSpec {
        node_id: "n1".to_owned(),
        namespace: namespace.to_owned(),
        arbiter,
        deploy: vec![("counter".to_owned(), guests::COUNTER.to_owned())],
        extra_args: FAST_TIMINGS.iter().map(|s| (*s).to_owned()).collect(),
    }
}

/// The probes and the document answer without a token on a node that
/// requires one for everything else.
#[tokio::test]
async fn probes_and_the_document_need_no_token() {
    let node = Arc::new(node_with(&[("counter", guests::COUNTER)]).await);
    let auth = Auth::parse(
        "[tenants.acme]\ntokens = [\"acme-token-0123456789\"]",
        false,
    )
    .expect("a tokens file");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let options = ApiOptions {
        auth: Arc::new(auth),
        tls: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(fief::http::serve_with(node, listener, options, async {
        let _ = stopped.await;
    }));

    let (status, body) = get(&format!("{base}/v1/health")).await.unwrap();
    assert_eq!((status, body), (200, serde_json::json!({"status": "up"})));
    let (status, body) = get(&format!("{base}/v1/ready")).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["ready"], &body["state"], &body["lease"]),
        (
            &Value::from(true),
            &Value::from("serving"),
            &Value::from("current")
        ),
        "{body}"
    );
    let (status, doc) = get(&format!("{base}/v1/openapi.json")).await.unwrap();
    assert_eq!((status, &doc["openapi"]), (200, &Value::from("3.1.0")));
    assert!(doc["paths"]["/v1/ready"]["get"]["responses"]["503"].is_object());
    // Everything else still needs the token.
    let (status, body) = get(&format!("{base}/v1/status")).await.unwrap();
    assert_eq!(
        (status, &body["error"]["code"]),
        (401, &Value::from("unauthorized"))
    );
    let _ = stop.send(());
}

/// A fenced node is not ready (`503`, state `fenced`) but healthy, and ready
/// again once it rejoins: a balancer skips it meanwhile, an orchestrator
/// does not restart it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_node_is_healthy_but_not_ready_until_it_rejoins() {
    let db = test_database().await;
    let namespace = unique_namespace("probes-fenced");
    let proxy = PgProxy::start().await;
    let mut node = ClusterNode::spawn(&spec(&namespace, proxy.arbiter_url())).await;
    node.wait_current(Duration::from_secs(30)).await;
    let (_, body) = ready_until(&node, Duration::from_secs(10), "ready", |s, _| s == 200).await;
    assert_eq!(body["state"], "serving", "{body}");
    assert_eq!(
        node.call_settled("counter", "a", "incr").await.unwrap(),
        "1"
    );

    proxy.set_cut(true);
    let (_, body) = ready_until(
        &node,
        Duration::from_secs(10),
        "not ready once fenced",
        |s, _| s == 503,
    )
    .await;
    assert_eq!(
        (&body["ready"], &body["state"], &body["lease"]),
        (
            &Value::from(false),
            &Value::from("fenced"),
            &Value::from("fenced")
        ),
        "{body}"
    );
    assert!(
        body["reason"].as_str().unwrap().contains("fenced"),
        "{body}"
    );
    assert_healthy(&node).await;
    let refused = node.call("counter", "a", "incr").await.unwrap_err();
    assert_eq!((refused.status, refused.code.as_str()), (503, "fenced"));

    proxy.set_cut(false);
    let (_, body) = ready_until(
        &node,
        Duration::from_secs(20),
        "ready after rejoining",
        |s, _| s == 200,
    )
    .await;
    assert_eq!(body["state"], "serving", "{body}");
    assert_eq!(node.call_settled("counter", "a", "get").await.unwrap(), "0");
    drop(node);
    drop_namespace(&db, &namespace).await;
}

/// A node whose arbiter does not answer at start is joining: healthy, not
/// ready; ready once the arbiter answers. (In process, with a local arbiter
/// taken down: a `fief node` on PostgreSQL does not start without reaching
/// its database.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joining_node_is_healthy_but_not_ready() {
    let config = fief::NodeConfig {
        lease_ttl: Duration::from_secs(2),
        renew_interval: Duration::from_millis(400),
        fence_margin: Duration::from_millis(500),
        ..fief_tests::test_config()
    };
    let clock = Arc::new(fief::TokioClock::new());
    let arbiter = Arc::new(fief::arbiter::LocalArbiter::new(
        clock.clone(),
        config.partition_count(),
    ));
    arbiter.set_down(true);
    // Returns after one lease TTL without a lease, still trying.
    let node = Arc::new(
        fief::Instance::builder(config)
            .clock(clock)
            .arbiter(arbiter.clone())
            .start()
            .await
            .expect("the node starts"),
    );
    let server = fief_tests::HttpServer::start(node.clone()).await;
    let (status, body) = get(&server.url("/v1/ready")).await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        (&body["ready"], &body["state"], &body["lease"]),
        (
            &Value::from(false),
            &Value::from("joining"),
            &Value::from("pending")
        ),
        "{body}"
    );
    assert!(
        body["reason"].as_str().unwrap().contains("joining"),
        "{body}"
    );
    let (status, _) = get(&server.url("/v1/health")).await.unwrap();
    assert_eq!(status, 200);

    arbiter.set_down(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = get(&server.url("/v1/ready")).await.unwrap();
        if status == 200 {
            assert_eq!(body["state"], "serving", "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "not ready within 20 s: {body}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
