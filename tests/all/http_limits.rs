//! Hostile API clients (issue "Hostile tenants cannot hurt the node or each
//! other", findings 5 and 10): more idle and slow-header connections than
//! the node's connection cap do not lock callers out, and with every
//! connection busy a new one gets a JSON `503`; a head sent too slowly
//! is closed at the header-read timeout (a TLS handshake that never comes
//! too), a kept-alive connection at the idle timeout and not before; heads
//! over the limits get `414` and `431` with JSON bodies; a cap that does not
//! fit the open-file limit is refused at start; a body that stalls or
//! dribbles is cut off at the body-read timeout, and one over the size limit
//! gets a JSON `413`. See docs/security.md.
//!
//! Time bounds are lower bounds the server cannot beat (it starts its clock
//! after the client's) and generous upper ones: a loaded machine only
//! makes the server later.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fief::http::ApiOptions;
use fief::{Instance, ModuleOptions, NodeConfig};
use fief_tests::{guests, node_with_options, test_config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long anything the server should do at once may take on a loaded
/// machine.
const PROMPTLY: Duration = Duration::from_secs(20);

/// A node with `counter` and these HTTP limits, its API served on a real
/// socket; the sender stops it.
async fn api(
    config: NodeConfig,
    options: ApiOptions,
) -> (String, tokio::sync::oneshot::Sender<()>) {
    let modules = [("counter", guests::COUNTER, ModuleOptions::default())];
    let node: Arc<Instance> = Arc::new(node_with_options(config, &modules).await);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(fief::http::serve_with(node, listener, options, async {
        let _ = stopped.await;
    }));
    (addr, stop)
}

fn limits(cap: Option<u32>, header_read: Duration, idle: Duration) -> NodeConfig {
    NodeConfig {
        http_max_connections: cap,
        http_header_read_timeout: header_read,
        http_idle_timeout: idle,
        ..test_config()
    }
}

/// Wait up to `limit` for the server to close `stream` (a read that ends or
/// fails); `Some(elapsed since start)` if it did.
async fn closed_within(
    stream: &mut TcpStream,
    start: Instant,
    limit: Duration,
) -> Option<Duration> {
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(start.elapsed()),
            // An answer before the close (none is expected): keep reading.
            Ok(Ok(_)) => {}
        }
    }
}

/// A status call and a key call on fresh connections, each bounded.
async fn calls_succeed(addr: &str, round: usize) {
    // A new client per call: each needs a new connection, admitted at the cap.
    let client = || {
        reqwest::Client::builder()
            .timeout(PROMPTLY)
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
    };
    let status = client()
        .get(format!("http://{addr}/v1/status"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("round {round}: the status call failed: {e}"));
    assert_eq!(
        status.status(),
        200,
        "round {round}: {:?}",
        status.text().await
    );
    let reply = client()
        .post(format!("http://{addr}/v1/keys/counter/alice/call"))
        .body("incr")
        .send()
        .await
        .unwrap_or_else(|e| panic!("round {round}: the key call failed: {e}"));
    assert_eq!(reply.status(), 200, "round {round}");
    assert_eq!(reply.text().await.unwrap(), (round + 1).to_string());
}

/// One figure from the metrics text: the value of the line starting `series `.
async fn metric(addr: &str, series: &str) -> f64 {
    let text = reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in the metrics:\n{text}"))
}

#[tokio::test]
async fn idle_and_slow_connections_over_the_cap_do_not_lock_callers_out() {
    const CAP: usize = 32;
    // Timeouts far longer than the test: only the cap's handling keeps the
    // API reachable here.
    let config = limits(
        Some(CAP as u32),
        Duration::from_secs(120),
        Duration::from_secs(120),
    );
    let (addr, _stop) = api(config, ApiOptions::default()).await;
    let mut attackers = Vec::new();
    for i in 0..120 {
        let mut stream = TcpStream::connect(&addr).await.unwrap();
        if i % 6 == 0 {
            // Slowloris: half a head, then nothing.
            stream
                .write_all(b"GET /v1/status HTTP/1.1\r\nHost: fief\r\nX-Slow: ")
                .await
                .unwrap();
        }
        attackers.push(stream);
    }
    // While every attacker is still connected, callers get through.
    for round in 0..3 {
        calls_succeed(&addr, round).await;
    }
    // The node kept to its cap: all but the newest CAP attackers were closed
    // (the callers took slots too, so a few more).
    let start = Instant::now();
    let waits = attackers.into_iter().map(|mut stream| async move {
        closed_within(&mut stream, start, Duration::from_secs(10))
            .await
            .is_some()
    });
    let closed = futures_util::future::join_all(waits)
        .await
        .into_iter()
        .filter(|c| *c)
        .count();
    assert!(
        closed >= 120 - CAP,
        "only {closed} of 120 idle or slow connections were closed at a cap of {CAP}"
    );
    let open = metric(&addr, "fief_api_connections").await;
    assert!(
        open <= CAP as f64,
        "{open} API connections open at a cap of {CAP}"
    );
    let evicted = metric(
        &addr,
        "fief_api_connections_closed_total{reason=\"evicted\"}",
    )
    .await;
    assert!(evicted >= (120 - CAP) as f64, "{evicted} evicted");
}

/// Start a call on `stream` whose body never finishes, and wait until the
/// node reads the body (its `100 Continue`): the connection is busy.
async fn busy(stream: &mut TcpStream) {
    stream
        .write_all(
            b"POST /v1/keys/counter/slow/call HTTP/1.1\r\nHost: fief\r\n\
              Content-Length: 100\r\nExpect: 100-continue\r\n\r\n",
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("100 Continue") {
        let n = tokio::time::timeout(PROMPTLY, stream.read(&mut buf))
            .await
            .expect("a 100 Continue in time")
            .unwrap();
        assert!(n > 0, "closed before 100 Continue: {seen:?}");
        seen.extend_from_slice(&buf[..n]);
    }
    stream.write_all(b"in").await.unwrap();
}

#[tokio::test]
async fn with_every_connection_busy_a_new_one_gets_a_json_503() {
    const CAP: usize = 4;
    let config = limits(
        Some(CAP as u32),
        Duration::from_secs(120),
        Duration::from_secs(120),
    );
    let (addr, _stop) = api(config, ApiOptions::default()).await;
    let mut calls = Vec::new();
    for _ in 0..CAP {
        let mut stream = TcpStream::connect(&addr).await.unwrap();
        busy(&mut stream).await;
        calls.push(stream);
    }
    let client = || {
        reqwest::Client::builder()
            .timeout(PROMPTLY)
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
    };
    let refused = client()
        .get(format!("http://{addr}/v1/status"))
        .send()
        .await
        .expect("an answer, not a broken connection");
    assert_eq!(
        refused.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    assert_eq!(error_code(refused, 503).await, "too_many_connections");
    // One call finishes: its connection goes idle, and the next caller is
    // admitted in its place.
    calls[0].write_all(&[b'x'; 98]).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(PROMPTLY, calls[0].read(&mut buf))
        .await
        .expect("the finished call's answer")
        .unwrap();
    assert!(n > 0);
    let status = client()
        .get(format!("http://{addr}/v1/status"))
        .send()
        .await
        .unwrap();
    assert_eq!(status.status(), 200);
    let refusals = metric(
        &addr,
        "fief_api_connections_closed_total{reason=\"refused\"}",
    )
    .await;
    assert!(refusals >= 1.0, "{refusals}");
}

#[tokio::test]
async fn a_head_sent_too_slowly_is_closed_at_the_header_read_timeout() {
    let header_read = Duration::from_secs(2);
    let (addr, _stop) = api(
        limits(None, header_read, Duration::from_secs(120)),
        ApiOptions::default(),
    )
    .await;
    let start = Instant::now();
    // Silent: connects and sends nothing.
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    // Stalled: half a head, then nothing.
    let mut stalled = TcpStream::connect(&addr).await.unwrap();
    stalled
        .write_all(b"GET /v1/status HTTP/1.1\r\nHost: fief\r\n")
        .await
        .unwrap();
    // Dripping: a byte of a header every 200 ms, never finishing; it is
    // never idle, and still closed at the header-read timeout.
    let mut dripping = TcpStream::connect(&addr).await.unwrap();
    dripping
        .write_all(b"GET /v1/status HTTP/1.1\r\nX-Drip: ")
        .await
        .unwrap();
    let (reader, mut writer) = dripping.into_split();
    let drip = tokio::spawn(async move {
        for _ in 0..300 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if writer.write_all(b"a").await.is_err() {
                return;
            }
        }
    });
    // Meanwhile the API serves.
    calls_succeed(&addr, 0).await;
    let bound = Duration::from_secs(40);
    for (name, stream) in [("silent", &mut silent), ("stalled", &mut stalled)] {
        let elapsed = closed_within(stream, start, bound)
            .await
            .unwrap_or_else(|| panic!("the {name} connection was still open after {bound:?}"));
        assert!(
            elapsed >= header_read,
            "the {name} connection was closed after {elapsed:?}, before the header-read timeout"
        );
    }
    let mut reader = reader;
    let mut buf = [0u8; 1024];
    let waited = tokio::time::timeout(bound, async {
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return start.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the dripping connection was still open after {bound:?}"));
    assert!(waited >= header_read, "closed after {waited:?}");
    drip.abort();
}

/// Finding 5, bodies: a client that sends a call's head and then stalls, or
/// dribbles its body a byte every 200 ms, is cut off at the body-read
/// timeout (plus the little its bytes earned), not before; a call with a
/// whole body still succeeds meanwhile, and one past the message size
/// limit gets a JSON `413`.
#[tokio::test]
async fn a_body_that_stalls_or_dribbles_is_cut_off_at_the_body_read_timeout() {
    let body_read = Duration::from_secs(2);
    let config = NodeConfig {
        http_body_read_timeout: body_read,
        ..limits(None, Duration::from_secs(120), Duration::from_secs(120))
    };
    let (addr, _stop) = api(config, ApiOptions::default()).await;
    let head =
        b"POST /v1/keys/counter/bob/call HTTP/1.1\r\nHost: fief\r\nContent-Length: 100\r\n\r\n";
    let start = Instant::now();
    let mut stalled = TcpStream::connect(&addr).await.unwrap();
    stalled.write_all(head).await.unwrap();
    stalled.write_all(b"in").await.unwrap();
    let dribbling = TcpStream::connect(&addr).await.unwrap();
    let (mut reader, mut writer) = dribbling.into_split();
    writer.write_all(head).await.unwrap();
    let drip = tokio::spawn(async move {
        for _ in 0..99 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if writer.write_all(b"a").await.is_err() {
                return;
            }
        }
    });
    // Meanwhile the API serves (the first call of `counter/alice`).
    calls_succeed(&addr, 0).await;
    let bound = Duration::from_secs(40);
    let elapsed = closed_within(&mut stalled, start, bound)
        .await
        .unwrap_or_else(|| panic!("the stalled body was still open after {bound:?}"));
    assert!(
        elapsed >= body_read,
        "cut after {elapsed:?}, before the timeout"
    );
    let mut buf = [0u8; 1024];
    let waited = tokio::time::timeout(bound, async {
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => return start.elapsed(),
                Ok(_) => {}
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("the dribbling body was still open after {bound:?}"));
    assert!(waited >= body_read, "cut after {waited:?}");
    // The whole body takes 19.8 s to dribble: it was cut part way.
    assert!(waited < Duration::from_secs(19), "cut after {waited:?}");
    drip.abort();
    assert!(
        metric(
            &addr,
            "fief_api_connections_closed_total{reason=\"body_timeout\"}"
        )
        .await
            >= 2.0
    );
    calls_succeed(&addr, 1).await;

    // Past the message size limit (1 MiB): a JSON 413, at once.
    let too_big = reqwest::Client::new()
        .post(format!("http://{addr}/v1/keys/counter/alice/call"))
        .body(vec![b'x'; 2 << 20])
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(too_big, 413).await, "message_too_large");
}

#[tokio::test]
async fn a_tls_handshake_that_never_comes_is_closed_at_the_header_read_timeout() {
    let cert = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let tls = fief::tls::server_config(&cert_path, &key_path).unwrap();
    let header_read = Duration::from_secs(2);
    let config = limits(None, header_read, Duration::from_secs(120));
    let options = ApiOptions {
        tls: Some(tls),
        ..ApiOptions::default()
    };
    let (addr, _stop) = api(config, options).await;
    let start = Instant::now();
    let mut silent = TcpStream::connect(&addr).await.unwrap();
    let bound = Duration::from_secs(40);
    let elapsed = closed_within(&mut silent, start, bound)
        .await
        .unwrap_or_else(|| panic!("the connection was still open after {bound:?}"));
    assert!(elapsed >= header_read, "closed after {elapsed:?}");
}

/// Send a `GET /v1/status` on `stream` and read its whole response.
async fn status_on(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET /v1/status HTTP/1.1\r\nHost: fief\r\n\r\n")
        .await
        .unwrap();
    let mut response = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = tokio::time::timeout(PROMPTLY, stream.read(&mut buf))
            .await
            .expect("a response in time")
            .expect("reading the response");
        assert!(n > 0, "the connection closed mid-response: {response:?}");
        response.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&response);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                .and_then(|v| v.trim().parse::<usize>().ok())
                .expect("a content-length");
            if body.len() >= length {
                return text.into_owned();
            }
        }
    }
}

#[tokio::test]
async fn a_kept_alive_connection_is_closed_after_the_idle_timeout_not_the_header_timeout() {
    let (header_read, idle) = (Duration::from_secs(1), Duration::from_secs(5));
    let (addr, _stop) = api(limits(None, header_read, idle), ApiOptions::default()).await;
    let mut stream = TcpStream::connect(&addr).await.unwrap();
    let first = status_on(&mut stream).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // Longer than the header-read timeout, well within the idle one: the
    // kept-alive connection still serves.
    tokio::time::sleep(header_read * 2).await;
    let sent = Instant::now();
    let second = status_on(&mut stream).await;
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    let bound = Duration::from_secs(40);
    let elapsed = closed_within(&mut stream, sent, bound)
        .await
        .unwrap_or_else(|| panic!("the idle connection was still open after {bound:?}"));
    assert!(
        elapsed >= idle,
        "the idle connection was closed {elapsed:?} after its last request, before the idle timeout"
    );
}

/// The JSON error code of a response, asserting its status.
async fn error_code(response: reqwest::Response, status: u16) -> String {
    assert_eq!(response.status(), status);
    let text = response.text().await.unwrap();
    let json: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the {status} answer is not JSON ({e}): {text:?}"));
    assert!(
        json["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{json}"
    );
    json["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn heads_over_the_limits_get_json_414_and_431() {
    let config = limits(None, Duration::from_secs(10), Duration::from_secs(60));
    let (addr, _stop) = api(config, ApiOptions::default()).await;
    let client = reqwest::Client::builder()
        .timeout(PROMPTLY)
        .build()
        .unwrap();
    let long = "a".repeat(fief::http_limits::MAX_REQUEST_LINE_BYTES + 1);
    let response = client
        .get(format!("http://{addr}/v1/status?pad={long}"))
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(response, 414).await, "uri_too_long");

    let big = "b".repeat(fief::http_limits::MAX_HEAD_BYTES + 1);
    let response = client
        .get(format!("http://{addr}/v1/status"))
        .header("x-big", big)
        .send()
        .await
        .unwrap();
    assert_eq!(error_code(response, 431).await, "headers_too_large");

    let mut many = client.get(format!("http://{addr}/v1/status"));
    for i in 0..=fief::http_limits::MAX_HEADER_FIELDS {
        many = many.header(format!("x-field-{i}"), "1");
    }
    let response = many.send().await.unwrap();
    assert_eq!(error_code(response, 431).await, "headers_too_large");

    // Within the limits, the same node answers as always.
    let ok = client
        .get(format!("http://{addr}/v1/status?pad={}", "a".repeat(4000)))
        .header("x-big", "b".repeat(30_000))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

#[test]
fn a_connection_cap_that_does_not_fit_the_open_file_limit_is_refused_at_start() {
    let port = fief_tests::free_port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let out = fief_tests::fief_cli(&[
        "node",
        "--listen",
        &listen,
        "--no-compile-cache",
        "--http-max-connections",
        "4000000000",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the node started: {stderr}");
    assert!(
        stderr.contains("http_max_connections (4000000000)")
            && stderr.contains("open-file limit ("),
        "{stderr}"
    );
    let out = fief_tests::fief_cli(&[
        "node",
        "--listen",
        &listen,
        "--no-compile-cache",
        "--http-max-connections",
        "0",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the node started: {stderr}");
    assert!(stderr.contains("http_max_connections (0)"), "{stderr}");
}
