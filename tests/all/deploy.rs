//! Cluster-wide deploys (issue "Deploy modules to a running cluster", items 1
//! and 2): the module store in both arbiters, every node following it,
//! versions for new activations while live keys keep theirs, rollback,
//! undeploy everywhere, a restart that loads from the store without
//! recompiling, validation before anything is stored, the streamed upload,
//! and the CLI's `modules`, `rollback`, `undeploy` and deploy progress.

use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Duration;

use fief::arbiter::{
    Arbiter, Bytes, LocalArbiter, NewModuleVersion, PostgresArbiter, StoredModule,
};
use fief::core::PartitionCount;
use fief::{Error, Instance, ModuleOptions, NodeConfig, SteppedClock};
use fief_tests::multiprocess::{PG_ADDR, arbiter_url, test_database, unique_namespace};
use fief_tests::{HttpServer, NodeProcess, eventually_async, fief_cli, guests, test_config};

use crate::cluster::Cluster;

/// Real time a node may take to load a module or stop its keys.
const REACT: Duration = Duration::from_secs(20);

fn version(name: &str, bytes: &[u8], options: ModuleOptions) -> NewModuleVersion {
    NewModuleVersion {
        name: name.to_owned(),
        bytes: Bytes::copy_from_slice(bytes),
        content_hash: fief::compile_cache::content_hash(bytes),
        options,
        deployed_by: "tester".to_owned(),
    }
}

fn listed<'a>(modules: &'a [StoredModule], name: &str) -> &'a StoredModule {
    modules
        .iter()
        .find(|m| m.name == name)
        .unwrap_or_else(|| panic!("{name} is listed: {modules:?}"))
}

/// The module store's contract, on one arbiter and namespace.
async fn store_contract(arbiter: &dyn Arbiter, ns: &str, big: usize) {
    assert!(arbiter.modules(ns).await.unwrap().is_empty());
    let one = arbiter
        .put_module(ns, version("m", b"one", ModuleOptions::default()))
        .await
        .unwrap();
    assert_eq!(one.version, 1);
    assert_eq!(one.size_bytes, 3);
    assert_eq!(one.deployed_by, "tester");
    // The same bytes and options again: no new version.
    let again = arbiter
        .put_module(ns, version("m", b"one", ModuleOptions::default()))
        .await
        .unwrap();
    assert_eq!(again, one, "an identical deploy stores nothing");
    // Other options are a new version, as are other bytes.
    let options = ModuleOptions {
        mailbox_depth: 7,
        ..ModuleOptions::default()
    };
    let two = arbiter
        .put_module(ns, version("m", b"one", options.clone()))
        .await
        .unwrap();
    assert_eq!((two.version, &two.options), (2, &options));
    let large: Vec<u8> = (0..big).map(|i| (i % 251) as u8).collect();
    let three = arbiter
        .put_module(ns, version("m", &large, ModuleOptions::default()))
        .await
        .unwrap();
    assert_eq!(three.version, 3);
    assert_eq!(three.size_bytes, big as u64);
    let modules = arbiter.modules(ns).await.unwrap();
    let m = listed(&modules, "m");
    assert_eq!(m.current, 3);
    assert_eq!(
        m.versions.iter().map(|v| v.version).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(m.current_record().unwrap().content_hash, three.content_hash);
    let bytes = arbiter.module_bytes(ns, "m", 3).await.unwrap().unwrap();
    assert!(
        bytes[..] == large[..],
        "the large component comes back whole"
    );
    assert_eq!(
        &arbiter.module_bytes(ns, "m", 1).await.unwrap().unwrap()[..],
        b"one"
    );
    assert_eq!(arbiter.module_bytes(ns, "m", 9).await.unwrap(), None);

    // Rollback.
    let back = arbiter.set_current_module(ns, "m", 1).await.unwrap();
    assert_eq!(back.current, 1);
    let err = arbiter.set_current_module(ns, "m", 9).await.unwrap_err();
    assert!(err.to_string().contains("no version 9"), "{err}");
    let err = arbiter.set_current_module(ns, "nope", 1).await.unwrap_err();
    assert!(err.to_string().contains("nope"), "{err}");

    // Another name has its own numbering.
    let other = arbiter
        .put_module(ns, version("other", b"x", ModuleOptions::default()))
        .await
        .unwrap();
    assert_eq!(other.version, 1);

    // Undeploy: gone with its bytes; the numbering continues afterwards.
    assert!(arbiter.remove_module(ns, "m").await.unwrap());
    assert!(!arbiter.remove_module(ns, "m").await.unwrap());
    let modules = arbiter.modules(ns).await.unwrap();
    assert_eq!(
        modules.iter().map(|m| m.name.as_str()).collect::<Vec<_>>(),
        ["other"]
    );
    assert_eq!(arbiter.module_bytes(ns, "m", 1).await.unwrap(), None);
    let four = arbiter
        .put_module(ns, version("m", b"one", ModuleOptions::default()))
        .await
        .unwrap();
    assert_eq!(four.version, 4, "a version number is never reused");
}

#[tokio::test]
async fn the_local_module_store_keeps_the_contract() {
    let arbiter = LocalArbiter::new(
        Arc::new(SteppedClock::default()),
        PartitionCount::new(8).unwrap(),
    );
    store_contract(&arbiter, "ns", 1 << 20).await;
}

/// The PostgreSQL store against the real server, with a 20 MB component
/// (a Python key module's size) stored and read back whole.
#[tokio::test]
async fn the_postgres_module_store_keeps_the_contract() {
    drop(test_database().await);
    let ns = unique_namespace("module-store");
    let arbiter =
        PostgresArbiter::connect(&arbiter_url(PG_ADDR), &ns, PartitionCount::new(8).unwrap())
            .await
            .unwrap();
    store_contract(&arbiter, &ns, 20 << 20).await;
    // A second connection (another node) sees the same store.
    let other =
        PostgresArbiter::connect(&arbiter_url(PG_ADDR), &ns, PartitionCount::new(8).unwrap())
            .await
            .unwrap();
    let modules = other.modules(&ns).await.unwrap();
    assert_eq!(listed(&modules, "m").current, 4);
}

/// Wait until every running node of `c` has `module` at `version` loaded.
async fn loaded_everywhere(c: &Cluster, nodes: usize, module: &str, version: u64) {
    eventually_async(
        REACT,
        &format!("{module} v{version} loaded everywhere"),
        || async {
            (0..nodes).all(|i| {
                c.node(i)
                    .status()
                    .modules
                    .iter()
                    .any(|m| m.name == module && m.version == version)
            })
        },
    )
    .await;
}

async fn call(node: &Instance, module: &str, key: &str, message: &str) -> Result<String, Error> {
    node.call(module, key, message.as_bytes().to_vec())
        .await
        .map(|r| String::from_utf8(r).expect("UTF-8"))
}

/// Item 1: a deploy on one node is callable from every node (keys owned by
/// each); a new version is used by new activations while a live key keeps
/// its version; a rollback makes the old version current again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deploy_on_one_node_serves_everywhere_and_versions_roll() {
    let c = Cluster::start(3, &[]).await;
    c.stabilize().await;
    let keys: Vec<String> = one_key_per_node(&c).await;

    let info = c
        .node(1)
        .deploy(
            "m",
            &guests::bytes(guests::COUNTER),
            ModuleOptions::default(),
        )
        .await
        .unwrap();
    assert_eq!(info.version, 1);
    loaded_everywhere(&c, 3, "m", 1).await;
    for via in 0..3 {
        for key in &keys {
            let reply = call(c.node(via), "m", key, "incr").await;
            assert!(reply.is_ok(), "via n{via}, {key}: {reply:?}");
        }
    }
    // Each key was incremented three times (once via each node).
    for key in &keys {
        assert_eq!(call(c.node(0), "m", key, "get").await.unwrap(), "3");
    }

    // Version 2 is another component under the same name.
    let info = c
        .node(2)
        .deploy("m", &guests::bytes(guests::PROBE), ModuleOptions::default())
        .await
        .unwrap();
    assert_eq!(info.version, 2);
    loaded_everywhere(&c, 3, "m", 2).await;
    for key in &keys {
        // The live counters keep version 1 (and their counts).
        assert_eq!(call(c.node(0), "m", key, "incr").await.unwrap(), "4");
        // A new key starts on version 2, the probe.
        let fresh = format!("{key}-new");
        assert_eq!(call(c.node(0), "m", &fresh, "ping").await.unwrap(), "pong");
    }

    // Rollback to 1: new activations are counters again; live probes stay.
    let info = c.node(0).rollback("m", 1).await.unwrap();
    assert_eq!(info.version, 1);
    loaded_everywhere(&c, 3, "m", 1).await;
    for key in &keys {
        let newer = format!("{key}-newer");
        assert_eq!(call(c.node(1), "m", &newer, "incr").await.unwrap(), "1");
        let fresh = format!("{key}-new");
        assert_eq!(call(c.node(1), "m", &fresh, "ping").await.unwrap(), "pong");
    }
    let listing = c.node(2).modules().await.unwrap();
    assert_eq!(listing.len(), 1);
    assert_eq!(listing[0].current, 1);
    assert_eq!(listing[0].versions.len(), 2);
    assert_eq!(listing[0].nodes, 3);
    assert_eq!(
        listing[0].loaded_on.values().copied().collect::<Vec<_>>(),
        [1, 1, 1],
        "{listing:?}"
    );
    let err = c.node(0).rollback("m", 7).await.unwrap_err();
    assert_eq!(err.code(), "unknown_module_version", "{err}");
    assert!(err.to_string().contains("1, 2"), "{err}");
    c.check();
}

/// One key owned by each of the three nodes.
async fn one_key_per_node(c: &Cluster) -> Vec<String> {
    let mut keys = Vec::new();
    for i in 0..3 {
        keys.push(c.key_owned_by(i).await);
    }
    keys
}

/// Item 1: an undeploy through one node stops the module's keys on every
/// node and removes it; calls then fail with `unknown_module`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeploy_stops_the_keys_everywhere() {
    let c = Cluster::start(3, &[]).await;
    c.stabilize().await;
    let keys = one_key_per_node(&c).await;
    c.node(0)
        .deploy(
            "m",
            &guests::bytes(guests::COUNTER),
            ModuleOptions::default(),
        )
        .await
        .unwrap();
    loaded_everywhere(&c, 3, "m", 1).await;
    for key in &keys {
        assert_eq!(call(c.node(0), "m", key, "incr").await.unwrap(), "1");
    }
    let live: usize = (0..3).map(|i| c.node(i).keys().len()).sum();
    assert_eq!(live, 3, "one live key on each node");

    c.node(1).undeploy("m").await.unwrap();
    eventually_async(REACT, "no node has the module or its keys", || async {
        (0..3).all(|i| c.node(i).keys().is_empty() && c.node(i).status().modules.is_empty())
    })
    .await;
    for key in &keys {
        let err = call(c.node(2), "m", key, "incr").await.unwrap_err();
        assert!(
            err.code() == "unknown_module" || err.to_string().contains("unknown module"),
            "{err}"
        );
    }
    let err = c.node(2).undeploy("m").await.unwrap_err();
    assert_eq!(err.code(), "unknown_module");
    assert!(c.node(0).modules().await.unwrap().is_empty());
    c.check();
}

fn cached_config(dir: &std::path::Path) -> NodeConfig {
    NodeConfig {
        compile_cache: Some(dir.to_owned()),
        ..test_config()
    }
}

/// Item 1: a node started later loads every module from the store before
/// it serves, from the compile cache (no recompile).
#[tokio::test]
async fn a_restarted_node_loads_its_modules_from_the_store_without_recompiling() {
    let cache = tempfile::tempdir().unwrap();
    let arbiter: Arc<dyn Arbiter> = Arc::new(LocalArbiter::new(
        Arc::new(fief::TokioClock::new()),
        PartitionCount::new(test_config().partitions).unwrap(),
    ));
    let first = Instance::builder(cached_config(cache.path()))
        .arbiter(arbiter.clone())
        .start()
        .await
        .unwrap();
    let info = first
        .deploy(
            "counter",
            &guests::bytes(guests::COUNTER),
            ModuleOptions::default(),
        )
        .await
        .unwrap();
    assert!(!info.compile_cached);
    // Give the lease back, so the restarted node (same id) joins at once.
    first.leave(Duration::from_secs(10)).await.unwrap();
    first.shutdown().await;

    let second = Instance::builder(cached_config(cache.path()))
        .arbiter(arbiter.clone())
        .start()
        .await
        .unwrap();
    let modules = second.status().modules;
    assert_eq!(modules.len(), 1, "loaded at start: {modules:?}");
    assert_eq!(modules[0].version, 1);
    assert_eq!(modules[0].content_hash, info.content_hash);
    assert!(modules[0].compile_cached, "no recompile: {modules:?}");
    assert_eq!(call(&second, "counter", "k", "incr").await.unwrap(), "1");
    second.shutdown().await;
}

/// `InstanceBuilder::module` deploys through the store: nodes started with
/// the same module share one version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_modules_go_through_the_store_once() {
    let c = Cluster::start(3, &[("counter", guests::COUNTER)]).await;
    let listing = c.node(0).modules().await.unwrap();
    assert_eq!(listing.len(), 1);
    assert_eq!(listing[0].current, 1);
    assert_eq!(listing[0].versions.len(), 1, "{listing:?}");
    c.check();
}

// ---------------------------------------------------------------------------
// Validation before anything is stored (item 2)
// ---------------------------------------------------------------------------

/// A component that imports one instance named `name` and exports nothing.
fn component_importing(name: &str) -> Vec<u8> {
    let mut bytes = b"\0asm\x0d\0\x01\0".to_vec();
    // Type section: one instance type with no declarations.
    bytes.extend([0x07, 0x03, 0x01, 0x42, 0x00]);
    // Import section: one import of that instance type.
    let mut section = vec![0x01, 0x00, name.len() as u8];
    section.extend(name.as_bytes());
    section.extend([0x05, 0x00]);
    bytes.push(0x0a);
    bytes.push(section.len() as u8);
    bytes.extend(section);
    bytes
}

async fn refused(node: &Instance, name: &str, wasm: &[u8], options: ModuleOptions) -> Error {
    let err = node
        .deploy(name, wasm, options)
        .await
        .expect_err("the deploy is refused");
    assert!(
        node.modules().await.unwrap().is_empty(),
        "nothing was stored after: {err}"
    );
    err
}

#[tokio::test]
async fn each_validation_failure_is_named_and_stores_nothing() {
    let node = Instance::start_embedded(test_config()).await.unwrap();

    let err = refused(&node, "m", b"\0asm\x01\0\0\0", ModuleOptions::default()).await;
    assert_eq!(err.code(), "invalid_module");
    assert!(err.to_string().contains("core WebAssembly module"), "{err}");

    let err = refused(&node, "m", b"hello", ModuleOptions::default()).await;
    assert!(
        err.to_string().contains("not a WebAssembly binary"),
        "{err}"
    );

    let mut huge = guests::bytes(guests::COUNTER);
    huge.resize(fief::module::MAX_MODULE_BYTES + 1, 0);
    let err = refused(&node, "m", &huge, ModuleOptions::default()).await;
    assert!(err.to_string().contains("over the limit"), "{err}");

    let err = refused(
        &node,
        "m",
        &component_importing("wasi:http/outgoing-handler@0.2.0"),
        ModuleOptions::default(),
    )
    .await;
    let text = err.to_string();
    assert!(
        text.contains("`wasi:http/outgoing-handler@0.2.0`"),
        "{text}"
    );
    assert!(text.contains("may not import"), "{text}");

    let err = refused(
        &node,
        "m",
        &component_importing("evil:host/escape@1.0.0"),
        ModuleOptions::default(),
    )
    .await;
    assert!(err.to_string().contains("evil:host/escape"), "{err}");

    // Only granted imports, but no lifecycle export: not a key module.
    let err = refused(
        &node,
        "m",
        &component_importing("wasi:clocks/monotonic-clock@0.2.0"),
        ModuleOptions::default(),
    )
    .await;
    let text = err.to_string();
    assert!(text.contains("fief:key/lifecycle@0.1.0"), "{text}");
    assert!(text.contains("exports nothing"), "{text}");

    let too_much = ModuleOptions {
        memory_limit: fief::config::ByteSize::gib(64),
        ..ModuleOptions::default()
    };
    let err = refused(&node, "m", &guests::bytes(guests::COUNTER), too_much).await;
    assert_eq!(err.code(), "invalid_options", "{err}");

    let err = refused(
        &node,
        "bad name!",
        &guests::bytes(guests::COUNTER),
        ModuleOptions::default(),
    )
    .await;
    assert_eq!(err.code(), "invalid_module_name", "{err}");
    node.shutdown().await;
}

/// Send a raw HTTP request head plus `body_start` and read the answer,
/// without sending the rest of the declared body.
fn raw_put(base: &str, path: &str, declared: u64, body_start: &[u8]) -> String {
    let addr = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    write!(
        stream,
        "PUT {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {declared}\r\n\r\n"
    )
    .unwrap();
    stream.write_all(body_start).unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    // Read until the JSON error body is complete (the server answers
    // without waiting for the rest of the body).
    while !String::from_utf8_lossy(&answer).contains("\"}}") {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => answer.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&answer).into_owned()
}

/// Item 1 (large uploads stream): an upload declared over the limit is
/// refused before its body is read, and one that does not start like a
/// component is refused after its first bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_are_refused_early_when_too_large_or_not_a_component() {
    let node = Arc::new(Instance::start_embedded(test_config()).await.unwrap());
    let server = HttpServer::start(node.clone()).await;
    let base = server.url("");
    let declared = fief::module::MAX_MODULE_BYTES as u64 + 1;
    let answer = tokio::task::spawn_blocking({
        let base = base.clone();
        move || raw_put(&base, "/v1/modules/big", declared, b"")
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 422"), "{answer}");
    assert!(answer.contains("over the limit"), "{answer}");

    let answer = tokio::task::spawn_blocking({
        let base = base.clone();
        move || raw_put(&base, "/v1/modules/core", 10_000_000, b"\0asm\x01\0\0\0")
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 422"), "{answer}");
    assert!(answer.contains("core WebAssembly module"), "{answer}");
    assert!(node.modules().await.unwrap().is_empty());

    // A whole upload goes through and is listed.
    let client = reqwest::Client::new();
    let response = client
        .put(server.url("/v1/modules/counter"))
        .body(guests::bytes(guests::COUNTER))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let listing: serde_json::Value = client
        .get(server.url("/v1/modules"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listing[0]["name"], "counter", "{listing}");
    assert_eq!(listing[0]["current"], 1, "{listing}");
    assert_eq!(listing[0]["versions"][0]["deployed_by"], "anonymous");
    drop(server);
    if let Ok(node) = Arc::try_unwrap(node) {
        node.shutdown().await;
    }
}

// ---------------------------------------------------------------------------
// The CLI
// ---------------------------------------------------------------------------

fn cli(args: &[&str]) -> (bool, String, String) {
    let out = fief_cli(args);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `fief deploy` shows its phases, `fief modules` lists versions,
/// `fief rollback` and `fief undeploy` act on the cluster.
#[test]
fn cli_deploy_progress_modules_rollback_undeploy() {
    let node = NodeProcess::start(&["--no-compile-cache"]);
    let url = node.url.as_str();

    let (ok, out, err) = cli(&["deploy", guests::COUNTER, "--module", "m", "--node", url]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("deployed m version 1"), "{out}");
    assert!(out.contains("loaded on 1/1 nodes"), "{out}");
    for phase in [
        "uploading",
        "uploaded",
        "validated and compiled",
        "stored as version 1",
        "loaded on 1/1 nodes",
    ] {
        assert!(err.contains(phase), "stderr shows {phase:?}: {err}");
    }
    let (ok, out, err) = cli(&["deploy", guests::PROBE, "--module", "m", "--node", url]);
    assert!(ok && out.contains("version 2"), "{out}{err}");

    let (ok, out, err) = cli(&["modules", "--node", url]);
    assert!(ok, "{err}");
    assert!(out.contains("m  current v2"), "{out}");
    assert!(out.contains("v1 v2*"), "{out}");
    let (ok, out, _) = cli(&["modules", "--verbose", "--node", url]);
    assert!(ok && out.contains("by anonymous"), "{out}");

    let (ok, out, err) = cli(&["rollback", "m", "1", "--node", url]);
    assert!(ok, "{err}");
    assert!(out.contains("version 1"), "{out}");
    let (ok, out, _) = cli(&["modules", "--json", "--node", url]);
    let listing: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(ok && listing[0]["current"] == 1, "{listing}");
    let (ok, _, err) = cli(&["rollback", "m", "9", "--node", url]);
    assert!(!ok && err.contains("no version 9"), "{err}");

    let (ok, out, err) = cli(&["undeploy", "m", "--node", url]);
    assert!(ok, "{err}");
    assert!(out.contains("undeployed m"), "{out}");
    let (ok, out, _) = cli(&["modules", "--node", url]);
    assert!(ok && out.contains("no modules are deployed"), "{out}");
    let (ok, _, err) = cli(&["call", "--node", url, "m", "k", "incr"]);
    assert!(!ok && err.contains("unknown module"), "{err}");
    let (ok, _, err) = cli(&["undeploy", "m", "--node", url]);
    assert!(!ok && err.contains("unknown module"), "{err}");
}
