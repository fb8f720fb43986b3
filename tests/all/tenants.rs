//! Tenants and API tokens (issue 5, item 4): a tenant's token reaches only
//! its own modules, keys and cache, over HTTP and from inside its guests;
//! missing or bad tokens get `401`; cluster operations need the admin
//! token; no token reaches the log. See docs/security.md.

use std::sync::{Arc, Mutex};

use fief::Instance;
use fief::auth::{Auth, hash_token};
use fief::http::ApiOptions;
use fief_tests::{guests, node_with};

const ADMIN: &str = "admin-token-0123456789abcdef";
const ACME: &str = "acme-token-0123456789abcdef";
const GLOBEX: &str = "globex-token-0123456789abcdef";

/// A tokens file: the admin, `acme` (by digest) and `globex` (plain).
fn tokens() -> Auth {
    let file = format!(
        r#"
        [admin]
        tokens = ["{ADMIN}"]
        [tenants.acme]
        token_sha256 = ["{}"]
        [tenants.globex]
        tokens = ["{GLOBEX}"]
        "#,
        hash_token(ACME)
    );
    Auth::parse(&file, false).expect("the tokens file parses")
}

/// The API of `node` with `auth`, on a real socket.
struct Api {
    base: String,
    client: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Api {
    async fn start(node: Arc<Instance>, auth: Auth) -> Api {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let options = ApiOptions {
            auth: Arc::new(auth),
            tls: None,
        };
        tokio::spawn(fief::http::serve_with(node, listener, options, async {
            let _ = stopped.await;
        }));
        Api {
            base,
            client: reqwest::Client::new(),
            _stop: stop,
        }
    }

    /// `method path` with `token`, returning status and body text.
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
        body: Vec<u8>,
    ) -> (u16, String) {
        let mut request = self
            .client
            .request(method, format!("{}{path}", self.base))
            .body(body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    }

    async fn call(&self, token: &str, module: &str, key: &str, message: &str) -> (u16, String) {
        let path = format!("/v1/keys/{module}/{key}/call");
        self.send(reqwest::Method::POST, &path, Some(token), message.into())
            .await
    }

    async fn deploy(&self, token: &str, module: &str, wasm: &[u8]) -> (u16, String) {
        let path = format!("/v1/modules/{module}");
        self.send(reqwest::Method::PUT, &path, Some(token), wasm.to_vec())
            .await
    }

    async fn get_json(&self, token: &str, path: &str) -> serde_json::Value {
        let (status, body) = self
            .send(reqwest::Method::GET, path, Some(token), Vec::new())
            .await;
        assert_eq!(status, 200, "{path}: {body}");
        serde_json::from_str(&body).unwrap()
    }
}

fn error_code(body: &str) -> String {
    let value: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("{body}"));
    value["error"]["code"].as_str().unwrap_or("").to_owned()
}

async fn tenant_node() -> (Arc<Instance>, Api) {
    let node = Arc::new(node_with(&[]).await);
    let api = Api::start(node.clone(), tokens()).await;
    (node, api)
}

#[tokio::test]
async fn missing_or_bad_tokens_get_401_and_an_open_node_needs_none() {
    let (_node, api) = tenant_node().await;
    for token in [
        None,
        Some("not-a-token-0123456789"),
        Some(&ACME[..ACME.len() - 1]),
    ] {
        let (status, body) = api
            .send(reqwest::Method::GET, "/v1/status", token, Vec::new())
            .await;
        assert_eq!(
            (status, error_code(&body).as_str()),
            (401, "unauthorized"),
            "{body}"
        );
        assert!(
            body.contains("token"),
            "the error says what to send: {body}"
        );
    }
    let response = api
        .client
        .get(format!("{}/v1/keys", api.base))
        .basic_auth("acme", Some(ACME))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["www-authenticate"], "Bearer");
    // A refused request is traced too: answered in the caller's trace.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let response = api
        .client
        .get(format!("{}/v1/status", api.base))
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    let answered = response.headers()["traceparent"].to_str().unwrap();
    assert!(
        answered.starts_with(&format!("00-{trace_id}-")) && answered.len() == 55,
        "the refusal's traceparent {answered:?} is not one of the caller's trace"
    );
    // With no tokens configured, the API stays open (the quick start).
    let open = Api::start(Arc::new(node_with(&[]).await), Auth::open()).await;
    let (status, _) = open
        .send(reqwest::Method::GET, "/v1/status", None, Vec::new())
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_tenant_cannot_touch_another_tenants_module() {
    let (node, api) = tenant_node().await;
    let counter = guests::bytes(guests::COUNTER);
    // Both tenants deploy a `counter`: two modules, stored apart.
    assert_eq!(api.deploy(ACME, "counter", &counter).await.0, 200);
    assert_eq!(api.deploy(GLOBEX, "counter", &counter).await.0, 200);
    let mut names: Vec<_> = node.status().modules.into_iter().map(|m| m.name).collect();
    names.sort();
    assert_eq!(names, ["acme/counter", "globex/counter"]);
    assert_eq!(
        api.call(ACME, "counter", "alice", "incr").await,
        (200, "1".into())
    );
    assert_eq!(
        api.call(ACME, "counter", "alice", "incr").await,
        (200, "2".into())
    );
    assert_eq!(
        api.call(GLOBEX, "counter", "alice", "incr").await,
        (200, "1".into())
    );

    // globex names acme's module in full: every verb is a 404, as for a
    // module that does not exist.
    let theirs = "acme%2Fcounter";
    let (status, body) = api.call(GLOBEX, theirs, "alice", "incr").await;
    assert_eq!(
        (status, error_code(&body).as_str()),
        (404, "unknown_module"),
        "{body}"
    );
    let (status, body) = api
        .send(
            reqwest::Method::POST,
            &format!("/v1/keys/{theirs}/alice/cast"),
            Some(GLOBEX),
            b"incr".to_vec(),
        )
        .await;
    assert_eq!(status, 404, "cast: {body}");
    let (status, body) = api
        .send(
            reqwest::Method::DELETE,
            &format!("/v1/keys/{theirs}/alice"),
            Some(GLOBEX),
            Vec::new(),
        )
        .await;
    assert_eq!(status, 404, "kill: {body}");
    let (status, body) = api.deploy(GLOBEX, theirs, &counter).await;
    assert_eq!(status, 404, "deploy over it: {body}");
    // Nothing of acme's changed: the key was neither killed nor bumped,
    // and its module is still version 1.
    assert_eq!(
        api.call(ACME, "counter", "alice", "get").await,
        (200, "2".into())
    );
    let acme = node
        .status()
        .modules
        .into_iter()
        .find(|m| m.name == "acme/counter")
        .unwrap();
    assert_eq!(acme.version, 1);

    // Listings show each tenant its own, under the names it uses.
    let keys = api.get_json(GLOBEX, "/v1/keys").await;
    let keys = keys.as_array().unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(keys[0]["module"], "counter");
    let status = api.get_json(ACME, "/v1/status").await;
    let modules = status["modules"].as_array().unwrap();
    assert_eq!(modules.len(), 1, "{modules:?}");
    assert_eq!(modules[0]["name"], "counter");
    assert!(
        api.get_json(ACME, "/v1/limbo")
            .await
            .as_array()
            .unwrap()
            .is_empty()
    );

    // The admin sees and reaches everything, by full name.
    assert_eq!(
        api.call(ADMIN, theirs, "alice", "get").await,
        (200, "2".into())
    );
    let all = api.get_json(ADMIN, "/v1/keys").await;
    assert_eq!(all.as_array().unwrap().len(), 2, "{all}");
}

#[tokio::test]
async fn cluster_operations_need_the_admin_token() {
    let (node, api) = tenant_node().await;
    let (status, body) = api
        .send(reqwest::Method::POST, "/v1/leave", Some(ACME), Vec::new())
        .await;
    assert_eq!(
        (status, error_code(&body).as_str()),
        (403, "forbidden"),
        "{body}"
    );
    assert!(!node.status().leaving);
    let (status, body) = api
        .send(reqwest::Method::POST, "/v1/leave", Some(ADMIN), Vec::new())
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test]
async fn the_cache_is_scoped_per_tenant_over_http_and_in_guests() {
    let (node, api) = tenant_node().await;
    let probe = guests::bytes(guests::PROBE);
    let counter = guests::bytes(guests::COUNTER);
    assert_eq!(api.deploy(ACME, "probe", &probe).await.0, 200);
    assert_eq!(api.deploy(GLOBEX, "counter", &counter).await.0, 200);

    // acme writes over HTTP; its guest reads the same namespace.
    let (status, _) = api
        .send(
            reqwest::Method::PUT,
            "/v1/cache/sessions/k",
            Some(ACME),
            b"acme-value".to_vec(),
        )
        .await;
    assert_eq!(status, 200);
    let (_, read) = api.call(ACME, "probe", "p", "cache-get sessions k").await;
    assert!(read.ends_with(" acme-value"), "{read}");
    // globex's `sessions` is another namespace; acme's is out of its reach.
    let (status, _) = api
        .send(
            reqwest::Method::GET,
            "/v1/cache/sessions/k",
            Some(GLOBEX),
            Vec::new(),
        )
        .await;
    assert_eq!(status, 404);
    let (status, body) = api
        .send(
            reqwest::Method::PUT,
            "/v1/cache/acme%2Fsessions/k",
            Some(GLOBEX),
            b"x".to_vec(),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    // The admin names it in full.
    let (status, value) = api
        .send(
            reqwest::Method::GET,
            "/v1/cache/acme%2Fsessions/k",
            Some(ADMIN),
            Vec::new(),
        )
        .await;
    assert_eq!((status, value.as_str()), (200, "acme-value"));

    // acme's guest cannot call globex's module, neither by its own name
    // (that is acme/counter, which does not exist) nor by globex's full name.
    for target in ["counter", "globex/counter"] {
        let (_, reply) = api
            .call(ACME, "probe", "p", &format!("call {target} alice incr"))
            .await;
        assert!(reply.starts_with("error:"), "{target}: {reply}");
    }
    assert!(node.keys().iter().all(|k| k.module != "globex/counter"));
    // Within its tenant, the guest's calls work.
    assert_eq!(api.deploy(ACME, "counter", &counter).await.0, 200);
    let (_, reply) = api
        .call(ACME, "probe", "p", "call counter alice incr")
        .await;
    assert_eq!(reply, "1");
}

/// Issue 22 item 5: the dashboard's snapshot takes any token and shows the
/// caller what it may see: a tenant only its own modules (no other
/// tenant's name anywhere in it, no node-wide history), the admin
/// everything; a wrong token is `401`; the page itself needs none.
#[tokio::test]
async fn a_tenants_cluster_view_shows_only_its_own_modules() {
    let (_node, api) = tenant_node().await;
    let counter = guests::bytes(guests::COUNTER);
    assert_eq!(api.deploy(ACME, "counter", &counter).await.0, 200);
    assert_eq!(api.deploy(GLOBEX, "ledger", &counter).await.0, 200);
    assert_eq!(api.call(ACME, "counter", "alice", "incr").await.0, 200);
    assert_eq!(api.call(GLOBEX, "ledger", "bob", "incr").await.0, 200);

    for path in ["/v1/cluster", "/v1/cluster/events"] {
        for token in [None, Some("not-a-token-0123456789")] {
            let (status, body) = api
                .send(reqwest::Method::GET, path, token, Vec::new())
                .await;
            assert_eq!(
                (status, error_code(&body).as_str()),
                (401, "unauthorized"),
                "{path}: {body}"
            );
        }
    }
    for path in ["/", "/dashboard.js", "/dashboard.css"] {
        let (status, _) = api.send(reqwest::Method::GET, path, None, Vec::new()).await;
        assert_eq!(status, 200, "{path} needs no token");
    }

    let (status, body) = api
        .send(reqwest::Method::GET, "/v1/cluster", Some(ACME), Vec::new())
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(
        !body.contains("globex") && !body.contains("ledger"),
        "another tenant's module shows in acme's view: {}",
        &body[body.find("\"limbo\"").unwrap_or(0)..]
    );
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(view["viewer"], "tenant:acme");
    let names: Vec<&str> = view["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["counter"], "{view}");
    assert_eq!(view["history"], serde_json::json!([]), "{view}");
    assert!(!view["owners"].as_array().unwrap().is_empty());

    // The event stream filters the same way: its first snapshot.
    let mut events = api
        .client
        .get(format!("{}/v1/cluster/events", api.base))
        .bearer_auth(GLOBEX)
        .send()
        .await
        .unwrap();
    assert_eq!(events.status(), 200);
    let mut text = String::new();
    while !text.contains("\n\n") {
        let chunk = events.chunk().await.unwrap().expect("a snapshot event");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.contains("ledger") && !text.contains("acme"), "{text}");

    let admin = api.get_json(ADMIN, "/v1/cluster").await;
    assert_eq!(admin["viewer"], "admin");
    let mut names: Vec<&str> = admin["modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["name"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["acme/counter", "globex/ledger"], "{admin}");
    assert_eq!(admin["history"].as_array().unwrap().len(), 1, "{admin}");
}

/// A writer for the captured log.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn tokens_never_reach_the_log() {
    // Everything at TRACE, from every crate, for the whole test (the test
    // runtime is single-threaded, so the node's tasks log here too).
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let auth = tokens();
    tracing::info!(auth = ?auth, "tokens loaded");
    let (_node, api) = {
        let node = Arc::new(node_with(&[]).await);
        let api = Api::start(node.clone(), auth).await;
        (node, api)
    };
    let counter = guests::bytes(guests::COUNTER);
    assert_eq!(api.deploy(ACME, "counter", &counter).await.0, 200);
    assert_eq!(api.call(ACME, "counter", "alice", "incr").await.0, 200);
    let wrong = "wrong-token-0123456789abcdef";
    assert_eq!(api.call(wrong, "counter", "alice", "incr").await.0, 401);
    assert_eq!(api.call(GLOBEX, "acme%2Fcounter", "a", "incr").await.0, 404);

    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(log.contains("tokens loaded"), "the capture works: {log}");
    assert!(log.contains("refused an API request"), "{log}");
    for secret in [ADMIN, ACME, GLOBEX, wrong, &hash_token(ACME)] {
        assert!(!log.contains(secret), "{secret} is in the log:\n{log}");
    }
}

#[tokio::test]
async fn the_module_store_is_scoped_per_tenant_and_records_who_deployed() {
    let (node, api) = tenant_node().await;
    let counter = guests::bytes(guests::COUNTER);
    assert_eq!(api.deploy(ACME, "counter", &counter).await.0, 200);
    assert_eq!(api.deploy(GLOBEX, "other", &counter).await.0, 200);

    // Each tenant lists its own modules, under its own names.
    let listing = api.get_json(ACME, "/v1/modules").await;
    let listing = listing.as_array().unwrap();
    assert_eq!(listing.len(), 1, "{listing:?}");
    assert_eq!(listing[0]["name"], "counter");
    assert_eq!(listing[0]["versions"][0]["deployed_by"], "tenant:acme");
    let one = api.get_json(ACME, "/v1/modules/counter").await;
    assert_eq!(one["current"], 1);
    let all = api.get_json(ADMIN, "/v1/modules").await;
    assert_eq!(all.as_array().unwrap().len(), 2, "{all}");

    // globex can neither read, roll back nor undeploy acme's module.
    let theirs = "/v1/modules/acme%2Fcounter";
    for (method, path) in [
        (reqwest::Method::GET, theirs.to_owned()),
        (
            reqwest::Method::POST,
            format!("{theirs}/rollback?version=1"),
        ),
        (reqwest::Method::DELETE, theirs.to_owned()),
    ] {
        let (status, body) = api
            .send(method.clone(), &path, Some(GLOBEX), Vec::new())
            .await;
        assert_eq!(
            (status, error_code(&body).as_str()),
            (404, "unknown_module"),
            "{method} {path}: {body}"
        );
    }
    assert_eq!(
        api.call(ACME, "counter", "alice", "incr").await,
        (200, "1".into())
    );
    assert!(
        node.status()
            .modules
            .iter()
            .any(|m| m.name == "acme/counter" && m.version == 1)
    );

    // acme undeploys its own.
    let (status, body) = api
        .send(
            reqwest::Method::DELETE,
            "/v1/modules/counter",
            Some(ACME),
            Vec::new(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, _) = api.call(ACME, "counter", "alice", "get").await;
    assert_eq!(status, 404);
}

/// Issue 5, item 5: a tenant's caps from the tokens file bound its deploys.
/// An option over a cap is refused, naming the option and the cap, and
/// nothing is stored; options left unset take the tenant's defaults (the
/// node's, lowered to the caps); a directory outside the tenant's
/// `allowed_dirs` is refused; the admin is bound by the node's limits only.
#[tokio::test]
async fn a_tenants_caps_from_the_tokens_file_bound_its_deploys() {
    let file = format!(
        r#"
        [admin]
        tokens = ["{ADMIN}"]
        [tenants.acme]
        tokens = ["{ACME}"]
        [tenants.acme.limits]
        memory_limit = "16MiB"
        max_live_keys = 10
        "#
    );
    let auth = Auth::parse(&file, false).expect("the tokens file parses");
    let caps = auth.deploy_caps(&fief::auth::Identity::Tenant("acme".into()));
    let caps = caps.0.expect("acme has caps");
    let node = Arc::new(node_with(&[]).await);
    let api = Api::start(node.clone(), auth).await;
    let counter = guests::bytes(guests::COUNTER);

    for (query, option) in [
        ("memory_limit=64MiB", "memory_limit"),
        ("max_live_keys=11", "max_live_keys"),
    ] {
        let (status, body) = api
            .deploy(ACME, &format!("counter?{query}"), &counter)
            .await;
        assert_eq!(
            (status, error_code(&body).as_str()),
            (400, "invalid_options"),
            "{query}: {body}"
        );
        assert!(
            body.contains(option) && body.contains("cap"),
            "the refusal names the option and the cap: {body}"
        );
    }
    let grant = std::env::temp_dir().display().to_string();
    let (status, body) = api
        .deploy(ACME, &format!("counter?dir={grant}:rw"), &counter)
        .await;
    assert_eq!(status, 400, "a directory acme was not allowed: {body}");
    assert!(
        node.modules().await.unwrap().is_empty(),
        "refused deploys store nothing"
    );

    let (status, body) = api.deploy(ACME, "counter", &counter).await;
    assert_eq!(status, 200, "{body}");
    let info: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        info["options"]["memory_limit"],
        serde_json::to_value(caps.memory_limit.unwrap()).unwrap(),
        "unset options take the tenant's defaults: {info}"
    );
    assert_eq!(info["options"]["max_live_keys"], 10, "{info}");
    assert_eq!(
        api.call(ACME, "counter", "alice", "incr").await,
        (200, "1".into())
    );

    // The admin is held to the node's limits only.
    let (status, body) = api.deploy(ADMIN, "big?memory_limit=64MiB", &counter).await;
    assert_eq!(status, 200, "{body}");
}
