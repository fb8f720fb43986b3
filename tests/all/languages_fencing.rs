//! Fence modes and the kill path for Python and JavaScript keys spinning in
//! their interpreter (issue 9): the interpreter never calls the host, so only
//! the epoch deadline can stop it. `terminate` kills it at the fence,
//! `kill_key` and the CPU limit kill it, `callback` asks it and its answer
//! decides. Moved out of `languages.rs` (which keeps the languages' other
//! tests) to keep each file readable.

use std::sync::Arc;
use std::time::Duration;

use fief::core::OnFence;
use fief::{Error, Instance, ModuleOptions, NodeConfig};
use fief_tests::{call_text, eventually, eventually_async, guests, is_live, node_with_options};

use crate::fence_modes::{Lives, PATIENCE, in_limbo, local_ok, observed_node, steady_config};
use crate::languages::{script_config, script_options, shared_compile_cache};
// ---------------------------------------------------------------------------
// Fence modes and the kill path, for a Python key spinning in a loop
// ---------------------------------------------------------------------------

/// `probe-py` options for spinning: a CPU limit so high that only a kill or
/// the fence stops a spinner, with `on_fence`.
fn spin_py_options(on_fence: OnFence) -> ModuleOptions {
    ModuleOptions {
        on_fence,
        cpu_limit: Duration::from_secs(600),
        ..script_options()
    }
}

/// Start `key` of `module` (a Python or JS probe) spinning: it host-calls
/// `probe/marker-<key>`, then loops forever in the same `handle-call`. Once
/// the marker is live, the key is inside its loop (it never calls the host
/// again). Returns the pending call.
async fn start_spinning(
    node: &Arc<Instance>,
    module: &'static str,
    key: &'static str,
) -> tokio::task::JoinHandle<fief::Result<Vec<u8>>> {
    let marker = format!("marker-{key}");
    let message = format!("spin-after-call probe {marker}").into_bytes();
    let task = tokio::spawn({
        let node = node.clone();
        async move { node.call(module, key, message).await }
    });
    eventually(PATIENCE, "the spinner reaches its loop", || {
        is_live(node, "probe", &marker)
    })
    .await;
    task
}

/// The end of a pending call, which must come soon after a kill.
async fn ended(pending: tokio::task::JoinHandle<fief::Result<Vec<u8>>>) -> fief::Result<Vec<u8>> {
    tokio::time::timeout(PATIENCE, pending)
        .await
        .expect("the pending call ends soon after the kill")
        .expect("the calling task does not panic")
}

/// Issue 9, "fence modes work for a Python key (terminate kills a Python key
/// spinning in a loop)": a Python key spinning in the interpreter (it never
/// calls the host) is killed at the fence under `on_fence = terminate`; its
/// caller is told it died of the fence, its process ends, and nothing is
/// left in limbo. The JavaScript probe is killed alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_kills_a_python_key_spinning_in_a_loop_at_the_fence() {
    let lives = Lives::default();
    let node = observed_node(
        NodeConfig {
            call_timeout: Duration::from_secs(60),
            compile_cache: Some(shared_compile_cache()),
            ..steady_config()
        },
        &lives,
        &[
            (
                "probe-py",
                guests::PROBE_PY,
                spin_py_options(OnFence::Terminate),
            ),
            (
                "probe-js",
                guests::PROBE_JS,
                spin_py_options(OnFence::Terminate),
            ),
            ("probe", guests::PROBE, ModuleOptions::default()),
        ],
    )
    .await;
    let python = start_spinning(&node, "probe-py", "s").await;
    let javascript = start_spinning(&node, "probe-js", "t").await;
    assert!(is_live(&node, "probe-py", "s") && is_live(&node, "probe-js", "t"));

    node.fence_now();
    for (module, pending) in [("probe-py", python), ("probe-js", javascript)] {
        let result = ended(pending).await;
        assert!(
            matches!(&result, Err(Error::KeyDied(why)) if why.contains("fenced")),
            "the {module} spinner was killed by the fence: {result:?}"
        );
    }
    eventually(PATIENCE, "the spinners' processes ended", || {
        lives.ended("probe-py", "s") && lives.ended("probe-js", "t") && node.keys().is_empty()
    })
    .await;
    assert!(node.limbo().await.is_empty());
}

/// The kill path for a Python key (contract §2, "the kill does not depend on
/// guest code"): `kill_key` ends a spinning Python key and its caller is
/// told it was killed; a Python key over its CPU limit is killed without
/// help; other keys are served meanwhile, and the next message starts a
/// fresh process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spinning_python_key_is_killed_by_kill_key_and_by_its_cpu_limit() {
    let node = Arc::new(
        node_with_options(
            script_config(),
            &[
                (
                    "probe-py",
                    guests::PROBE_PY,
                    spin_py_options(OnFence::Terminate),
                ),
                (
                    "limited-py",
                    guests::PROBE_PY,
                    ModuleOptions {
                        cpu_limit: Duration::from_millis(500),
                        ..script_options()
                    },
                ),
                ("probe", guests::PROBE, ModuleOptions::default()),
            ],
        )
        .await,
    );
    let spinning = start_spinning(&node, "probe-py", "s").await;
    assert_eq!(call_text(&node, "probe-py", "other", "ping").await, "pong");
    assert!(node.kill_key("probe-py", "s"), "the spinner was live");
    match ended(spinning).await {
        Err(Error::KeyDied(why)) => assert!(why.contains("killed"), "{why}"),
        other => panic!("expected KeyDied, got {other:?}"),
    }
    eventually(PATIENCE, "the killed key is gone", || {
        !is_live(&node, "probe-py", "s")
    })
    .await;
    assert_eq!(call_text(&node, "probe-py", "s", "ping").await, "pong");

    let over = tokio::time::timeout(PATIENCE, node.call("limited-py", "x", b"spin".to_vec()))
        .await
        .expect("the CPU limit ends the call");
    match over {
        Err(Error::KeyDied(why)) => assert!(why.contains("cpu"), "{why}"),
        other => panic!("expected KeyDied over the CPU limit, got {other:?}"),
    }
}

/// `on_fence = callback` for a Python key: `handle-fence` reaches the key
/// with the module's deadline; a key that answers `CONTINUE` survives in
/// limbo (and still answers through a local handle), one that answers
/// `Stop` ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_asks_a_python_key_and_its_answer_decides() {
    let lives = Lives::default();
    let options = ModuleOptions {
        on_fence: OnFence::Callback,
        handle_fence_deadline: Duration::from_millis(500),
        ..script_options()
    };
    let node = observed_node(
        NodeConfig {
            compile_cache: Some(shared_compile_cache()),
            ..steady_config()
        },
        &lives,
        &[("probe-py", guests::PROBE_PY, options)],
    )
    .await;
    assert_eq!(
        call_text(&node, "probe-py", "stays", "on-fence continue").await,
        "ok"
    );
    assert_eq!(
        call_text(&node, "probe-py", "goes", "on-fence stop").await,
        "ok"
    );

    node.fence_now();
    eventually(PATIENCE, "goes ended", || lives.ended("probe-py", "goes")).await;
    eventually_async(PATIENCE, "stays is in limbo", || async {
        in_limbo(&node, "probe-py", "stays").await.is_some()
    })
    .await;
    assert_eq!(
        local_ok(&node, "probe-py", "stays", "events").await,
        "fence:500"
    );
    assert!(!lives.ended("probe-py", "stays"));
}
