//! Keys in any Wasm language (issue 9): Python (componentize-py) and
//! JavaScript (componentize-js) key modules beside Rust ones, through the
//! same WIT world (`wit/key.wit`) and the thin SDKs in `guest-sdk/python`
//! and `guest-sdk/js`.
//!
//! - The three counters (`examples/counter`, `counter-py`, `counter-js`)
//!   answer the same CLI and HTTP calls with the same bytes, errors
//!   included, and tick alike.
//! - Keys call each other across languages (the `call` host import), both
//!   ways, and errors cross with their kind: a `Reject` is `rejected`, any
//!   other exception is a crash.
//! - Pub/sub crosses languages: `room-js` and the Rust `room` share a topic;
//!   so does the coherent cache, through the Python and JavaScript SDKs.
//! - A restarted node with a compile cache serves Python keys without
//!   recompiling (the `compile_cached` flag of the deploy).
//!
//! Their WebSocket connections (the chat room in each language) are tested
//! in `languages_websockets.rs`; the fence modes and the kill path for a
//! Python key spinning in its interpreter in `languages_fencing.rs`.
//!
//! The Python and JavaScript components are built from source by
//! `tests/build.rs` with `scripts/build-guest.sh`.
//! `per_language_figures` (ignored) prints the figures of
//! `docs/benchmarks.md`, "Guest languages".

use std::time::{Duration, Instant};

use fief::{Error, Instance, ModuleOptions, NodeConfig, StopReason};
use fief_tests::{
    NodeProcess, call_text, eventually, eventually_async, fief_cli, guests, is_live,
    node_with_options, test_config,
};

use crate::cluster::Cluster;
use crate::fence_modes::PATIENCE;

/// Module options for the Python and JavaScript modules (and, where the
/// three languages are compared, for all three): the default memory limit
/// (64 MiB: plenty for an interpreter's snapshot), and a CPU limit per
/// callback with room for an interpreter on a loaded test machine.
pub(crate) fn script_options() -> ModuleOptions {
    ModuleOptions {
        cpu_limit: Duration::from_secs(5),
        ..ModuleOptions::default()
    }
}

/// A compile cache the tests of this module share (and keep between runs,
/// under the target directory): each Python and JavaScript component is
/// compiled once per engine configuration, not once per test. The restart
/// test uses a fresh directory of its own.
pub(crate) fn shared_compile_cache() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("languages-compile-cache")
}

/// A test node configuration with the [`shared_compile_cache`], whose calls
/// wait long enough for a first activation of an interpreter on a loaded
/// machine.
pub(crate) fn script_config() -> NodeConfig {
    NodeConfig {
        call_timeout: Duration::from_secs(30),
        compile_cache: Some(shared_compile_cache()),
        ..test_config()
    }
}

/// The three counters: (module name, component).
const COUNTERS: [(&str, &str); 3] = [
    ("counter", guests::COUNTER),
    ("counter-py", guests::COUNTER_PY),
    ("counter-js", guests::COUNTER_JS),
];

// ---------------------------------------------------------------------------
// The same calls, the same answers
// ---------------------------------------------------------------------------

/// stdout (trimmed) of a successful `fief` run.
fn cli_ok(args: &[&str]) -> String {
    let output = fief_cli(args);
    assert!(
        output.status.success(),
        "fief {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap().trim().to_owned()
}

/// stderr (trimmed) of a failing `fief` run.
fn cli_err(args: &[&str]) -> String {
    let output = fief_cli(args);
    assert!(!output.status.success(), "fief {args:?} succeeded");
    String::from_utf8(output.stderr).unwrap().trim().to_owned()
}

/// A `fief node` configuration file for the CLI tests: calls wait up to
/// 30 s (a first activation of an interpreter on a loaded machine).
fn patient_node_config() -> tempfile::NamedTempFile {
    let file = tempfile::Builder::new()
        .suffix(".toml")
        .tempfile()
        .expect("a temporary config file");
    std::fs::write(file.path(), "call_timeout = \"30s\"\n").expect("writing the config");
    file
}

/// Drive one counter module on a `fief node` process through the CLI and
/// the HTTP API and return what it answered, step by step, with the module's
/// name replaced by `M` so that the transcripts of the three languages can
/// be compared.
async fn counter_transcript(url: &str, module: &str) -> Vec<String> {
    let client = reqwest::Client::new();
    let http = async |kind: &str, key: &str, body: &str| -> String {
        let response = client
            .post(format!("{url}/v1/keys/{module}/{key}/{kind}"))
            .body(body.to_owned())
            .send()
            .await
            .unwrap_or_else(|e| panic!("HTTP {kind} {module}/{key} {body:?}: {e}"));
        let status = response.status().as_u16();
        format!("{status} {}", response.text().await.unwrap())
    };
    let get = async |key: &str| -> u64 {
        let reply = http("call", key, "get").await;
        reply
            .strip_prefix("200 ")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{module}/{key} get: {reply}"))
    };
    let mut steps = Vec::new();
    let mut step = |what: &str, answer: String| {
        steps.push(format!("{what} => {}", answer.replace(module, "M")));
    };
    let cli = |args: &[&str]| {
        let mut all = vec![args[0], "--node", url, module];
        all.extend(&args[1..]);
        all.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    let ok = |args: Vec<String>| cli_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let err = |args: Vec<String>| cli_err(&args.iter().map(String::as_str).collect::<Vec<_>>());

    step("cli call alice incr", ok(cli(&["call", "alice", "incr"])));
    step("cli call alice incr", ok(cli(&["call", "alice", "incr"])));
    step("cli call bob get", ok(cli(&["call", "bob", "get"])));
    step("http call alice incr", http("call", "alice", "incr").await);
    step("http call alice get", http("call", "alice", "get").await);
    step(
        "http call alice bogus",
        http("call", "alice", "bogus").await,
    );
    step(
        "cli call alice bogus",
        err(cli(&["call", "alice", "bogus"])),
    );
    step("http call alice get", http("call", "alice", "get").await);
    // A cast the counter ignores (it logs a warning): nothing changes.
    step(
        "http cast alice tick-every 0",
        http("cast", "alice", "tick-every 0").await,
    );
    step("http call alice get", http("call", "alice", "get").await);

    // Ticking: carol adds one every 20 ms until told to stop; after the stop
    // (processed before the next call: one mailbox, in order) the value
    // stays put, even if a timer had already fired (stale ones are ignored).
    step(
        "cli cast carol tick-every 20",
        ok(cli(&["cast", "carol", "tick-every 20"])),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while get("carol").await < 3 {
        assert!(
            Instant::now() < deadline,
            "{module}/carol never ticked 3 times"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    step(
        "http cast carol stop-ticking",
        http("cast", "carol", "stop-ticking").await,
    );
    let stopped = get("carol").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    step(
        "carol unchanged 300 ms after stop-ticking",
        format!("{}", get("carol").await == stopped),
    );
    steps
}

/// Issue 9, "the three counters behave identically through the same CLI and
/// HTTP calls": one `fief node` process; each counter is deployed with
/// `fief deploy` (same options) and driven through the same script of CLI
/// and HTTP calls and casts. The Rust counter's transcript is checked
/// against the values the counter documents; the Python and JavaScript
/// transcripts must equal it byte for byte (module name aside), refusals
/// included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_three_counters_answer_the_same_cli_and_http_calls() {
    let config = patient_node_config();
    let config_path = config.path().to_str().expect("a UTF-8 path").to_owned();
    let cache = shared_compile_cache();
    let cache = cache.to_str().expect("a UTF-8 path");
    let node = NodeProcess::start(&["--config", &config_path, "--compile-cache", cache]);
    let url = node.url.as_str();
    for (module, path) in COUNTERS {
        let out = cli_ok(&[
            "deploy",
            path,
            "--module",
            module,
            "--node",
            url,
            "-o",
            "cpu_limit=5s",
        ]);
        assert!(out.contains(module), "{out}");
    }

    let rust = counter_transcript(url, "counter").await;
    let answers: Vec<&str> = rust
        .iter()
        .map(|step| step.split(" => ").nth(1).unwrap())
        .collect();
    assert_eq!(
        &answers[..5],
        ["1", "2", "0", "200 3", "200 3"],
        "{rust:#?}"
    );
    assert!(
        answers[5].starts_with("422 ")
            && answers[5].contains("unknown message: bogus; expected incr, get"),
        "{rust:#?}"
    );
    assert!(answers[6].contains("unknown message: bogus"), "{rust:#?}");
    assert_eq!(
        &answers[7..10],
        ["200 3", "202 {\"queued\":true}", "200 3"],
        "{rust:#?}"
    );
    assert_eq!(answers.last(), Some(&"true"), "{rust:#?}");

    for module in ["counter-py", "counter-js"] {
        assert_eq!(
            counter_transcript(url, module).await,
            rust,
            "{module} answers like the Rust counter"
        );
    }

    let status: serde_json::Value =
        serde_json::from_str(&cli_ok(&["status", "--json", "--node", url])).expect("JSON status");
    let names: Vec<&str> = status["modules"]
        .as_array()
        .expect("a module list")
        .iter()
        .filter_map(|m| m["name"].as_str())
        .collect();
    for (module, _) in COUNTERS {
        assert!(names.contains(&module), "{module} in {status}");
    }
}

/// The three counters stopped gracefully for a handoff give the same state
/// (their value, decimal text): `handoff` then `terminate`, in every
/// language, through the SDKs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_three_counters_hand_off_the_same_state() {
    let modules: Vec<_> = COUNTERS
        .iter()
        .map(|(name, path)| (*name, *path, script_options()))
        .collect();
    let node = node_with_options(script_config(), &modules).await;
    for (module, _) in COUNTERS {
        for _ in 0..5 {
            call_text(&node, module, "dora", "incr").await;
        }
        let state = node
            .stop_key(module, "dora", StopReason::Handoff)
            .await
            .unwrap_or_else(|e| panic!("stopping {module}/dora: {e}"));
        assert_eq!(state.as_deref(), Some(&b"5"[..]), "{module}");
        eventually(PATIENCE, "the stopped key is gone", || {
            !is_live(&node, module, "dora")
        })
        .await;
        // State lives in the process: a new one starts from zero.
        assert_eq!(
            call_text(&node, module, "dora", "get").await,
            "0",
            "{module}"
        );
    }
}

/// `counter`'s handoff, in Python and JavaScript, through a real move: on an
/// in-process two-node cluster (each language's counter deployed as the
/// module `counter`), the node owning a key leaves gracefully; the key's
/// process hands its value off (`handoff`), the new owner's process starts
/// from it (`init` with the state), and the count goes on where it was.
/// The Rust counter's own move is `cluster_failures::cluster_row8_leave_hands_keys_off_with_no_double_serve`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_and_js_counters_keep_their_count_across_a_graceful_move() {
    for path in [guests::COUNTER_PY, guests::COUNTER_JS] {
        let c = Cluster::start(2, &[("counter", path)]).await;
        c.stabilize().await;
        let key = c.key_owned_by(0).await;
        for n in 1..=5 {
            assert_eq!(c.call(1, &key, "incr").await.unwrap(), n.to_string());
        }
        assert_eq!(c.live_on(&key), vec![0]);
        let leave = c.node(0).leave(Duration::from_secs(60));
        let clock = async {
            for _ in 0..100 {
                c.clock.advance(Duration::from_millis(100));
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        };
        let (left, ()) = tokio::join!(leave, clock);
        left.expect("n0 leaves");
        assert!(c.node(0).keys().is_empty(), "n0 hosts nothing");
        assert_eq!(c.call(1, &key, "incr").await.unwrap(), "6", "{path}");
        assert_eq!(c.live_on(&key), vec![1]);
        c.check();
    }
}

// ---------------------------------------------------------------------------
// Key to key, across languages
// ---------------------------------------------------------------------------

/// Issue 9, "a Rust key calls a Python key and a JS key (key-to-key `call`)
/// and back": the Rust `probe` calls the Python and JavaScript counters and
/// probes; they call Rust keys and each other; replies travel back through
/// every hop, and errors keep their kind across languages (`Reject` →
/// `rejected`, a call to itself → `deadlock`, any other exception → the
/// callee crashed, and its next message starts a fresh process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_python_and_js_keys_call_each_other_and_back() {
    let node = node_with_options(
        script_config(),
        &[
            ("probe", guests::PROBE, ModuleOptions::default()),
            ("counter", guests::COUNTER, ModuleOptions::default()),
            ("probe-py", guests::PROBE_PY, script_options()),
            ("probe-js", guests::PROBE_JS, script_options()),
            ("counter-py", guests::COUNTER_PY, script_options()),
            ("counter-js", guests::COUNTER_JS, script_options()),
        ],
    )
    .await;
    let ask = |module: &'static str, key: &'static str, message: &'static str| {
        let node = &node;
        async move { call_text(node, module, key, message).await }
    };

    // Rust → Python, Rust → JavaScript.
    assert_eq!(ask("probe", "r", "call counter-py c incr").await, "1");
    assert_eq!(ask("probe", "r", "call counter-js c incr").await, "1");
    assert_eq!(ask("probe", "r", "call counter-py c incr").await, "2");
    // Rust → Python → Rust and back; Rust → JavaScript → Rust and back.
    assert_eq!(
        ask("probe", "r", "call probe-py p call probe r2 whoami").await,
        "probe/r2"
    );
    assert_eq!(
        ask("probe", "r", "call probe-js j call probe r2 echo from js").await,
        "from js"
    );
    // Python → JavaScript → Rust, and JavaScript → Python → Rust.
    assert_eq!(
        ask("probe-py", "p", "call probe-js j call counter x incr").await,
        "1"
    );
    assert_eq!(
        ask("probe-js", "j", "call probe-py p call counter x incr").await,
        "2"
    );
    assert_eq!(ask("probe-py", "p", "whoami").await, "probe-py/p");
    assert_eq!(ask("probe-js", "j", "whoami").await, "probe-js/j");

    // Refusals keep their kind. A Python or JS `Reject` reaches the Rust
    // caller as `rejected`, and a Rust `Err` reaches them as `rejected`.
    let reply = ask("probe", "r", "call probe-py p fail no thanks").await;
    assert!(
        reply.contains("Rejected") && reply.contains("no thanks"),
        "{reply}"
    );
    let reply = ask("probe", "r", "call probe-js j fail no thanks").await;
    assert!(
        reply.contains("Rejected") && reply.contains("no thanks"),
        "{reply}"
    );
    assert_eq!(
        ask("probe-py", "p", "call probe r3 fail nope").await,
        "error: rejected: nope"
    );
    assert_eq!(
        ask("probe-js", "j", "call probe r3 fail nope").await,
        "error: rejected: nope"
    );
    // Calling itself is a deadlock; an unknown module is named.
    assert_eq!(
        ask("probe-py", "p", "call probe-py p ping").await,
        "error: deadlock"
    );
    assert_eq!(
        ask("probe-js", "j", "call probe-js j ping").await,
        "error: deadlock"
    );
    assert_eq!(
        ask("probe-js", "j", "call nosuch k ping").await,
        "error: unknown-module: nosuch"
    );
    // A counter's refusal is the same text in every language.
    let from_rust = ask("probe", "r", "call counter c bogus").await;
    let from_py = ask("probe", "r", "call counter-py c bogus").await;
    let from_js = ask("probe", "r", "call counter-js c bogus").await;
    assert!(from_rust.contains("unknown message: bogus"), "{from_rust}");
    assert_eq!((&from_py, &from_js), (&from_rust, &from_rust));

    // Any other exception is a bug: the key process traps, its caller is
    // told it crashed, and the next message starts a fresh process.
    for module in ["probe-py", "probe-js"] {
        let crash = format!("call {module} q crash");
        let reply = call_text(&node, "probe", "r", &crash).await;
        assert!(reply.contains("Crashed"), "{module}: {reply}");
        eventually(PATIENCE, "the crashed key is gone", || {
            !is_live(&node, module, "q")
        })
        .await;
        assert_eq!(call_text(&node, module, "q", "ping").await, "pong");
    }
}

/// The coherent cache through the Python and JavaScript SDKs: what one
/// language writes the others read with the same version, and a
/// compare-and-set with a stale version is a `conflict` in every language.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_js_and_rust_keys_share_the_cache() {
    let node = node_with_options(
        script_config(),
        &[
            ("probe", guests::PROBE, ModuleOptions::default()),
            ("probe-py", guests::PROBE_PY, script_options()),
            ("probe-js", guests::PROBE_JS, script_options()),
        ],
    )
    .await;
    let ask = |module: &'static str, message: String| {
        let node = &node;
        async move { call_text(node, module, "k", &message).await }
    };
    let first: u64 = ask("probe-py", "cache-put shared greeting hello".into())
        .await
        .parse()
        .expect("a version");
    for module in ["probe", "probe-js", "probe-py"] {
        assert_eq!(
            ask(module, "cache-get shared greeting".into()).await,
            format!("{first} hello"),
            "{module} reads what Python wrote"
        );
    }
    let second: u64 = ask("probe-js", format!("cache-cas shared greeting {first} hi"))
        .await
        .parse()
        .expect("a version");
    assert!(second > first);
    for module in ["probe-py", "probe-js"] {
        let stale = ask(module, format!("cache-cas shared greeting {first} stale")).await;
        assert!(
            stale.starts_with(&format!("error: conflict: {second}")),
            "{module}: {stale}"
        );
    }
    assert_eq!(
        ask("probe", "cache-get shared greeting".into()).await,
        format!("{second} hi")
    );
    // 0 means "only if absent".
    assert!(
        ask("probe-js", "cache-cas shared fresh 0 first".into())
            .await
            .parse::<u64>()
            .is_ok()
    );
    let again = ask("probe-py", "cache-cas shared fresh 0 second".into()).await;
    assert!(again.starts_with("error: conflict"), "{again}");
    assert_eq!(
        ask("probe-py", "cache-delete shared greeting".into()).await,
        "True"
    );
    assert_eq!(
        ask("probe-js", "cache-get shared greeting".into()).await,
        "none"
    );
    assert_eq!(
        ask("probe-js", "cache-delete shared greeting".into()).await,
        "false"
    );
}

/// Durable state through the Python and JavaScript SDKs: each key stores,
/// reads, lists and deletes its own entries, and what it stored outlives its
/// process (killed, then loaded again by the next one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_and_js_keys_keep_durable_state() {
    let node = node_with_options(
        script_config(),
        &[
            ("probe-py", guests::PROBE_PY, script_options()),
            ("probe-js", guests::PROBE_JS, script_options()),
        ],
    )
    .await;
    for (module, yes, no) in [("probe-py", "True", "False"), ("probe-js", "true", "false")] {
        let ask = |message: &'static str| call_text(&node, module, "k", message);
        assert_eq!(ask("store-get a").await, "none", "{module}");
        assert_eq!(ask("store-put b two words").await, "ok", "{module}");
        assert_eq!(ask("store-put a 1").await, "ok", "{module}");
        assert_eq!(ask("store-list ").await, "a=1,b=two words", "{module}");
        assert!(node.kill_key(module, "k"));
        eventually(Duration::from_secs(10), "the key's process ends", || {
            !is_live(&node, module, "k")
        })
        .await;
        assert_eq!(
            ask("store-get b").await,
            "two words",
            "{module}: outlives its process"
        );
        assert_eq!(ask("store-del a").await, yes, "{module}");
        assert_eq!(ask("store-del a").await, no, "{module}");
        let refused = ask("store-get ").await;
        assert!(refused.starts_with("error: invalid"), "{module}: {refused}");
        assert_eq!(
            call_text(&node, module, "other", "store-get b").await,
            "none",
            "{module}: another key's state"
        );
    }
    node.shutdown().await;
}

// ---------------------------------------------------------------------------
// Pub/sub across languages: room-js beside the Rust room
// ---------------------------------------------------------------------------

/// `examples/room-js` is the Rust `room` in JavaScript: key `lobby` of both
/// modules subscribes to `room:lobby`, so what one says the other keeps, in
/// the order the node delivered it; so do the members `lobby/<member>` of
/// either module; a refusal names the commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn room_js_and_the_rust_room_share_a_topic() {
    let node = node_with_options(
        script_config(),
        &[
            ("room", guests::ROOM, ModuleOptions::default()),
            ("room-js", guests::ROOM_JS, script_options()),
        ],
    )
    .await;
    // Start both rooms (each subscribes in `init`).
    assert_eq!(call_text(&node, "room", "lobby", "get").await, "");
    assert_eq!(call_text(&node, "room-js", "lobby", "get").await, "");
    assert_eq!(call_text(&node, "room-js", "lobby", "say hello").await, "2");
    assert_eq!(call_text(&node, "room", "lobby", "say hi back").await, "2");
    for module in ["room", "room-js"] {
        eventually_async(PATIENCE, "both rooms got both messages", || async {
            call_text(&node, module, "lobby", "get").await == "hello\nhi back"
        })
        .await;
    }
    // A JS room of another name hears nothing.
    assert_eq!(call_text(&node, "room-js", "attic", "get").await, "");
    // Members `<room>/<member>` of either language are in the room too.
    assert_eq!(call_text(&node, "room-js", "lobby/zoe", "get").await, "");
    assert_eq!(call_text(&node, "room", "lobby/ann", "get").await, "");
    assert_eq!(
        call_text(&node, "room-js", "lobby/zoe", "say welcome").await,
        "4"
    );
    for (module, key, kept) in [
        ("room", "lobby", "hello\nhi back\nwelcome"),
        ("room-js", "lobby", "hello\nhi back\nwelcome"),
        ("room", "lobby/ann", "welcome"),
        ("room-js", "lobby/zoe", "welcome"),
    ] {
        eventually_async(PATIENCE, "every member got the welcome", || async {
            call_text(&node, module, key, "get").await == kept
        })
        .await;
    }
    assert_eq!(call_text(&node, "room-js", "attic", "get").await, "");
    match node.call("room-js", "lobby", b"shout".to_vec()).await {
        Err(Error::Rejected(why)) => {
            assert!(why.contains("expected get, say <text>"), "{why}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------
// The compile cache: a restarted node does not recompile Python keys
// ---------------------------------------------------------------------------

/// Issue 9, "show that a node restart serves Python keys without
/// recompiling": `fief node --compile-cache DIR --deploy counter-py=...`
/// compiles the component (its status says `compile_cached: false`) and
/// stores the compiled artifact; the same command after the node was killed
/// loads it instead (`compile_cached: true`) and serves the Python keys.
#[test]
fn a_restarted_node_serves_python_keys_without_recompiling() {
    let cache = tempfile::tempdir().expect("a temporary cache directory");
    let cache_dir = cache.path().to_str().expect("a UTF-8 path").to_owned();
    let deploy = format!("counter-py={}", guests::COUNTER_PY);
    let config = patient_node_config();
    let config_path = config.path().to_str().expect("a UTF-8 path").to_owned();
    let args = [
        "--config",
        config_path.as_str(),
        "--compile-cache",
        cache_dir.as_str(),
        "--deploy",
        deploy.as_str(),
    ];
    let cached_flag = |url: &str| -> serde_json::Value {
        let status: serde_json::Value =
            serde_json::from_str(&cli_ok(&["status", "--json", "--node", url]))
                .expect("JSON status");
        let module = status["modules"]
            .as_array()
            .and_then(|m| m.iter().find(|m| m["name"] == "counter-py"))
            .unwrap_or_else(|| panic!("counter-py in {status}"))
            .clone();
        module["compile_cached"].clone()
    };

    let first = NodeProcess::start(&args);
    assert_eq!(cached_flag(&first.url), false, "the first node compiled");
    assert_eq!(
        cli_ok(&["call", "--node", &first.url, "counter-py", "alice", "incr"]),
        "1"
    );
    drop(first);

    let second = NodeProcess::start(&args);
    assert_eq!(
        cached_flag(&second.url),
        true,
        "the restarted node loaded the compiled component from the cache"
    );
    for expected in ["1", "2"] {
        assert_eq!(
            cli_ok(&["call", "--node", &second.url, "counter-py", "bob", "incr"]),
            expected
        );
    }
}

/// A node whose instance pool is too small for an interpreter's keys says so
/// (a 429 `too_many_keys` naming the pool), instead of reporting the key as
/// dead, and goes on serving keys that fit. The pool sets aside 4 core
/// instances per slot (the keys of `max_live_keys` and the reserve for keys
/// retiring, `docs/eviction.md`); a componentize-py key needs 14, so on a
/// node with `max_live_keys = 1` (a pool of 2 slots) not one Python key fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_instance_pool_is_a_clear_refusal_not_a_dead_key() {
    let node = Instance::start_embedded(NodeConfig {
        max_live_keys: 1,
        ..script_config()
    })
    .await
    .expect("a node");
    node.deploy(
        "counter-py",
        guests::bytes(guests::COUNTER_PY),
        script_options(),
    )
    .await
    .expect("deploy counter-py");
    node.deploy(
        "counter",
        guests::bytes(guests::COUNTER),
        ModuleOptions::default(),
    )
    .await
    .expect("deploy counter");
    let refused = node
        .call("counter-py", "alice", b"incr".to_vec())
        .await
        .expect_err("no Python key fits this pool");
    assert_eq!(refused.code(), "too_many_keys", "{refused}");
    assert_eq!(refused.http_status(), 429, "{refused}");
    let text = refused.to_string();
    assert!(
        text.contains("instance pool is full") && text.contains("max_live_keys"),
        "the refusal says what ran out and what to do: {text}"
    );
    assert_eq!(
        node.call("counter", "bob", b"incr".to_vec()).await.unwrap(),
        b"1"
    );
    assert!(node.keys().iter().all(|k| k.module != "counter-py"));
}

// ---------------------------------------------------------------------------
// The figures of docs/benchmarks.md, "Guest languages"
// ---------------------------------------------------------------------------

/// This process's resident set size, bytes (Linux `/proc/self/statm`).
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("reading /proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("statm's resident field");
    pages * 4096
}

/// Prints the per-language table of `docs/benchmarks.md` ("Guest
/// languages"); measures, asserts nothing about time. Run it with the
/// release profile on an idle machine:
/// `cargo test --release -p fief-tests --test all languages::per_language_figures -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "prints figures; run by hand (see docs/benchmarks.md)"]
async fn per_language_figures() {
    const KEYS: usize = 50;
    const WARM_CALLS: u32 = 2000;
    println!(
        "| language | component size | compile | deploy from the compile cache | cold activation (first call, new key) | warm call | memory per live key (RSS) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (module, path) in COUNTERS {
        let cache = tempfile::tempdir().expect("a temporary cache directory");
        let config = NodeConfig {
            max_live_keys: 256,
            compile_cache: Some(cache.path().to_owned()),
            ..NodeConfig::default()
        };
        let bytes = guests::bytes(path);
        let node = Instance::start_embedded(config.clone())
            .await
            .expect("a node");
        let compiled = node
            .deploy(module, &bytes, script_options())
            .await
            .expect("deploy");
        assert!(!compiled.compile_cached);
        // Cold activation: a call to a new key each time.
        let rss_before = rss_bytes();
        let mut cold = Duration::ZERO;
        for i in 0..KEYS {
            let key = format!("k{i}");
            let start = Instant::now();
            node.call(module, &key, b"incr".to_vec())
                .await
                .expect("a cold call");
            cold += start.elapsed();
        }
        let per_key = rss_bytes().saturating_sub(rss_before) / KEYS as u64;
        // Warm calls on one live key.
        let start = Instant::now();
        for _ in 0..WARM_CALLS {
            node.call(module, "k0", b"incr".to_vec())
                .await
                .expect("a warm call");
        }
        let warm = start.elapsed() / WARM_CALLS;
        node.shutdown().await;
        // A restarted node: the same deploy, loaded from the cache.
        let restarted = Instance::start_embedded(config).await.expect("a node");
        let loaded = restarted
            .deploy(module, &bytes, script_options())
            .await
            .expect("deploy");
        assert!(loaded.compile_cached);
        restarted.shutdown().await;
        let language = match module {
            "counter" => "Rust",
            "counter-py" => "Python",
            _ => "JavaScript",
        };
        println!(
            "| {language} (`{module}`) | {:.1} MB | {:.2} s | {:.3} s | {:.0} µs | {:.1} µs | {:.1} MiB |",
            compiled.size_bytes as f64 / 1e6,
            compiled.compile_ms as f64 / 1000.0,
            loaded.compile_ms as f64 / 1000.0,
            cold.as_secs_f64() * 1e6 / KEYS as f64,
            warm.as_secs_f64() * 1e6,
            per_key as f64 / (1024.0 * 1024.0),
        );
    }
}
