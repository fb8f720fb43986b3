//! The API's workers shared fairly between tenants' requests (issue 17, the
//! publish flood over HTTP; design.md "The API's workers, shared between
//! tenants' requests"; `host/src/request_turns.rs`).
//!
//! Over real HTTP, four clients of tenant `mallory` flood a module with
//! calls that each end at once. Alone, none of their requests ever waits
//! for a turn: one tenant is never held back. Beside another tenant's
//! client calling all along, `mallory` takes more than its share of the
//! requests' time on the node's two busy workers, and its requests are
//! served a turn at a time (counted in
//! `fief_tenant_requests_waited_total`); the other tenant's never wait, and
//! `mallory` is still served. Counted, not timed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use fief::{Instance, ModuleOptions};
use fief_tests::{guests, node_with_options, test_config};

use crate::fair_cpu::one_cpu_test_at_a_time;

/// `tenant`'s requests that waited for a turn so far.
async fn waited(node: &Instance, tenant: &str) -> u64 {
    let series = format!("fief_tenant_requests_waited_total{{tenant=\"{tenant}\"}}");
    fief_tests::metric_value(&node.metrics_text().await, &series).unwrap_or(0.0) as u64
}

/// The tokens: the admin, and tenant `mallory`.
const ADMIN: &str = "admin-token-0123456789abcdef";
const MALLORY: &str = "mallory-token-0123456789abcdef";

/// Serve `node`'s API with the tokens above on a real socket until the
/// sender returned is dropped; its base URL.
async fn serve(node: Arc<Instance>) -> (String, tokio::sync::oneshot::Sender<()>) {
    let tokens =
        format!("[admin]\ntokens = [\"{ADMIN}\"]\n[tenants.mallory]\ntokens = [\"{MALLORY}\"]\n");
    let options = fief::http::ApiOptions {
        auth: Arc::new(fief::auth::Auth::parse(&tokens, false).expect("the tokens parse")),
        tls: None,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binding 127.0.0.1:0");
    let base = format!("http://{}", listener.local_addr().expect("its address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(fief::http::serve_with(node, listener, options, async {
        let _ = stopped.await;
    }));
    (base, stop)
}

/// Keep POSTing `incr` to `url` with `token` on a connection of its own
/// until `stop`, counting the answers (every one must be a 200) in `calls`.
fn keep_calling(
    (url, token): (String, &'static str),
    stop: &Arc<AtomicBool>,
    calls: &Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    let (stop, calls) = (stop.clone(), calls.clone());
    tokio::spawn(async move {
        let client = reqwest::Client::new();
        while !stop.load(Ordering::Relaxed) {
            let response = client
                .post(&url)
                .bearer_auth(token)
                .body("incr")
                .send()
                .await
                .expect("the request goes through");
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            assert_eq!(status, 200, "{url}: {body}");
            calls.fetch_add(1, Ordering::Relaxed);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_flooding_the_api_is_served_a_turn_at_a_time_beside_another() {
    let _alone = one_cpu_test_at_a_time().await;
    let node = Arc::new(
        node_with_options(
            test_config(),
            &[
                ("mallory/counter", guests::COUNTER, ModuleOptions::default()),
                ("counter", guests::COUNTER, ModuleOptions::default()),
            ],
        )
        .await,
    );
    let (base, _server) = serve(node.clone()).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (floods, victim_calls) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));

    // Alone: four clients, never held back.
    let mut tasks: Vec<_> = (0..4)
        .map(|i| {
            let url = format!("{base}/v1/keys/counter/flood-{i}/call");
            keep_calling((url, MALLORY), &stop, &floods)
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let alone = floods.load(Ordering::Relaxed);
    let waited_alone = waited(&node, "mallory").await;

    // Beside a client of modules of no tenant.
    let victim_url = format!("{base}/v1/keys/counter/victim/call");
    tasks.push(keep_calling((victim_url, ADMIN), &stop, &victim_calls));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (floods_0, victim_0) = (
        floods.load(Ordering::Relaxed),
        victim_calls.load(Ordering::Relaxed),
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let (shared, victim) = (
        floods.load(Ordering::Relaxed) - floods_0,
        victim_calls.load(Ordering::Relaxed) - victim_0,
    );
    let (waited_beside, victim_waited) = (waited(&node, "mallory").await, waited(&node, "").await);
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a client");
    }
    eprintln!(
        "alone: {alone} mallory calls, {waited_alone} waited; beside the victim: {shared} \
         mallory calls ({} waited in all), {victim} victim calls ({victim_waited} waited)",
        waited_beside - waited_alone
    );
    assert!(alone > 0 && shared > 0 && victim > 0);
    assert_eq!(
        waited_alone, 0,
        "alone, mallory's requests waited for turns"
    );
    assert!(
        waited_beside > waited_alone,
        "beside another tenant's client, none of mallory's {shared} requests waited for a turn"
    );
    assert_eq!(
        victim_waited, 0,
        "the other tenant's requests waited for turns"
    );
}
