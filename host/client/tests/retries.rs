//! The client's retry rule against a stub API on a real socket: a refusal
//! is sent again until it succeeds or the attempts run out; an answer that
//! may have been processed (`answer_lost`) never is; a node that cannot be
//! reached is a typed, retryable error; the token travels as a bearer.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use fief_client::{Client, Error, RetryPolicy};

/// Requests each route has seen.
#[derive(Default)]
struct Seen {
    flaky: AtomicU32,
    lost: AtomicU32,
    fenced: AtomicU32,
}

fn refusal(code: &str) -> (StatusCode, String) {
    let status = if code == "answer_lost" {
        StatusCode::BAD_GATEWAY
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        format!(r#"{{"error":{{"code":"{code}","message":"{code}, said the stub"}}}}"#),
    )
}

async fn stub() -> (String, Arc<Seen>) {
    let seen = Arc::new(Seen::default());
    let app = Router::new()
        .route(
            "/v1/keys/m/flaky/call",
            post({
                let seen = seen.clone();
                move |headers: HeaderMap| async move {
                    assert_eq!(
                        headers.get("authorization").and_then(|v| v.to_str().ok()),
                        Some("Bearer sesame")
                    );
                    // Refused twice (a move settling), then answered.
                    if seen.flaky.fetch_add(1, Ordering::SeqCst) < 2 {
                        refusal("unowned")
                    } else {
                        (StatusCode::OK, "pong".to_owned())
                    }
                }
            }),
        )
        .route(
            "/v1/keys/m/lost/call",
            post({
                let seen = seen.clone();
                move || async move {
                    seen.lost.fetch_add(1, Ordering::SeqCst);
                    refusal("answer_lost")
                }
            }),
        )
        .route(
            "/v1/keys/m/fenced/call",
            post({
                let seen = seen.clone();
                move || async move {
                    seen.fenced.fetch_add(1, Ordering::SeqCst);
                    refusal("fenced")
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), seen)
}

fn fast(attempts: u32) -> RetryPolicy {
    RetryPolicy {
        attempts,
        backoff: Duration::from_millis(5),
    }
}

#[tokio::test]
async fn refusals_are_sent_again_and_a_lost_answer_never_is() {
    let (url, seen) = stub().await;
    let node = Client::builder(&url)
        .token("sesame")
        .retry(fast(3))
        .build()
        .unwrap();
    assert_eq!(node.call("m", "flaky", "ping").await.unwrap(), b"pong");
    assert_eq!(seen.flaky.load(Ordering::SeqCst), 3);

    let lost = node.call("m", "lost", "ping").await.unwrap_err();
    assert_eq!(lost.code(), Some("answer_lost"));
    assert!(!lost.is_retryable());
    assert_eq!(seen.lost.load(Ordering::SeqCst), 1, "never resent");

    let fenced = node.call("m", "fenced", "ping").await.unwrap_err();
    match &fenced {
        Error::Api(e) => assert_eq!((e.status, e.code.as_str()), (503, "fenced")),
        other => panic!("expected the API's refusal, got {other:?}"),
    }
    assert_eq!(seen.fenced.load(Ordering::SeqCst), 3, "all three attempts");
    let once = node.clone().with_retry(fast(1));
    once.call("m", "fenced", "ping").await.unwrap_err();
    assert_eq!(
        seen.fenced.load(Ordering::SeqCst),
        4,
        "one attempt, no retry"
    );
}

#[tokio::test]
async fn an_unreachable_node_and_bad_settings_are_typed_errors() {
    // A port nothing listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let node = Client::builder(format!("http://127.0.0.1:{port}"))
        .retry(fast(2))
        .build()
        .unwrap();
    let e = node.status().await.unwrap_err();
    assert!(matches!(e, Error::Unreachable { .. }), "{e:?}");
    assert!(e.is_retryable(), "nothing was sent");
    assert!(
        e.to_string()
            .starts_with("cannot reach the node at http://127.0.0.1:"),
        "{e}"
    );

    for bad in [
        Client::builder("ftp://x").build(),
        Client::builder("not a url").build(),
        Client::builder("http://x").token("new\nline").build(),
        Client::builder("http://x").ca_cert_pem("not pem").build(),
    ] {
        assert!(matches!(bad, Err(Error::InvalidInput(_))), "{bad:?}");
    }
}
