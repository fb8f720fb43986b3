//! Durable per-key state (`fief:key/storage`, docs/storage.md) on one node:
//! what a key stores survives its process; each key sees only its own
//! state; a callback's writes commit together when it returns, and nothing
//! it sent after a write leaves before the commit (the output gate); a
//! failed commit withholds everything and the caller is told the store is
//! unavailable; the limits are refused with WIT errors; a module built for
//! `fief:key@0.1.0` still runs.

use std::sync::Arc;
use std::time::Duration;

use fief::config::ByteSize;
use fief::{Error, Instance, ModuleOptions, StopReason};
use fief_tests::storage_backend::ControlledBackend;
use fief_tests::{call_text, eventually, eventually_async, guests, is_live, test_config};

/// A node with `backend` as its store and `modules` deployed.
async fn node_on(
    backend: Arc<ControlledBackend>,
    modules: &[(&str, &str, ModuleOptions)],
) -> Instance {
    let node = Instance::builder(test_config())
        .storage(backend)
        .start()
        .await
        .expect("the node starts");
    for (name, path, options) in modules {
        node.deploy(name, &guests::bytes(path), options.clone())
            .await
            .unwrap_or_else(|e| panic!("deploying {name}: {e}"));
    }
    node
}

fn vault() -> (&'static str, &'static str, ModuleOptions) {
    ("vault", guests::VAULT, ModuleOptions::default())
}

#[tokio::test]
async fn a_stored_counter_outlives_its_processes() {
    let backend = ControlledBackend::new();
    let node = node_on(
        backend.clone(),
        &[(
            "counter",
            guests::STORED_COUNTER,
            ModuleOptions {
                idle_timeout: Duration::from_millis(200),
                ..ModuleOptions::default()
            },
        )],
    )
    .await;
    for expected in ["1", "2", "3"] {
        assert_eq!(call_text(&node, "counter", "alice", "incr").await, expected);
    }
    // Killed: the next process loads what was committed.
    assert!(node.kill_key("counter", "alice"));
    eventually(Duration::from_secs(5), "alice's process ends", || {
        !is_live(&node, "counter", "alice")
    })
    .await;
    assert_eq!(call_text(&node, "counter", "alice", "incr").await, "4");
    // Stopped idle: the same.
    eventually(Duration::from_secs(10), "alice retires idle", || {
        !is_live(&node, "counter", "alice")
    })
    .await;
    assert_eq!(call_text(&node, "counter", "alice", "get").await, "4");
    assert_eq!(call_text(&node, "counter", "bob", "get").await, "0");
    node.shutdown().await;

    // A new node on the same store: the count is still there.
    let node = node_on(
        backend,
        &[("counter", guests::STORED_COUNTER, ModuleOptions::default())],
    )
    .await;
    assert_eq!(call_text(&node, "counter", "alice", "incr").await, "5");
    node.shutdown().await;
}

#[tokio::test]
async fn every_storage_import_works_and_reads_see_the_callbacks_own_writes() {
    let node = node_on(ControlledBackend::new(), &[vault()]).await;
    let v = |m: &'static str| call_text(&node, "vault", "k", m);
    assert_eq!(v("get a").await, "-");
    for (name, value) in [
        ("b", "2"),
        ("a", "1"),
        ("c", "3"),
        ("é", "e"),
        ("B", "upper"),
    ] {
        assert_eq!(
            call_text(&node, "vault", "k", &format!("put {name} {value}")).await,
            "ok"
        );
    }
    assert_eq!(v("get a").await, "1");
    // Sorted by bytes: upper case before lower case, é (0xC3 0xA9) last.
    assert_eq!(v("list z - 10").await, "é=e");
    assert_eq!(v("list A - 10").await, "B=upper\na=1\nb=2\nc=3\né=e");
    assert_eq!(v("list a c 10").await, "a=1\nb=2");
    assert_eq!(v("list a - 2").await, "a=1\nb=2");
    assert_eq!(v("del a").await, "true");
    assert_eq!(v("del a").await, "false");
    assert_eq!(v("delrange b d").await, "2");
    assert_eq!(v("list A - 10").await, "B=upper\né=e");
    assert!(
        v("list c a 10").await.starts_with("err:invalid:"),
        "an inverted range is refused"
    );
    assert_eq!(v("incr").await, "1");
    assert_eq!(v("incr").await, "2");
    node.shutdown().await;
}

/// The SDK keeps the values a process read in a cache inside the guest
/// (`guest-sdk/src/read_cache.rs`); every write of the process must update
/// or drop what it holds, so a read after a write sees the write, whatever
/// was cached before it. Each read below follows a read of the same name,
/// so it is served from the cache unless the write in between reached it.
#[tokio::test]
async fn the_guests_read_cache_follows_the_processs_own_writes() {
    let options = ModuleOptions {
        max_storage_value_size: ByteSize::kib(1),
        ..ModuleOptions::default()
    };
    let node = node_on(
        ControlledBackend::new(),
        &[("vault", guests::VAULT, options)],
    )
    .await;
    let v = |m: &'static str| call_text(&node, "vault", "k", m);
    assert_eq!(v("get n").await, "-");
    assert_eq!(v("put n 1").await, "ok");
    assert_eq!(v("get n").await, "1");
    assert_eq!(v("put n 2").await, "ok");
    assert_eq!(v("get n").await, "2", "a put replaces the cached value");
    assert_eq!(v("del n").await, "true");
    assert_eq!(v("get n").await, "-", "a delete forgets the cached value");
    for name in ["a", "b", "c"] {
        assert_eq!(
            call_text(&node, "vault", "k", &format!("put {name} {name}")).await,
            "ok"
        );
        assert_eq!(
            call_text(&node, "vault", "k", &format!("get {name}")).await,
            name
        );
    }
    assert_eq!(v("delrange b c").await, "1");
    assert_eq!(v("get b").await, "-", "a range delete forgets the range");
    assert_eq!(v("get a").await, "a");
    assert_eq!(v("get c").await, "c");
    // A refused write changes nothing, in the store or in the cache.
    assert!(v("big a 1025").await.starts_with("err:invalid:"));
    assert_eq!(v("get a").await, "a");
    assert_eq!(v("get-import a").await, "a");
    // A callback that traps after a write kills the process and its cache:
    // the next process reads what the store has.
    let err = node
        .call("vault", "k", b"put-trap a lost".to_vec())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::KeyDied(_)), "{err}");
    assert_eq!(v("get a").await, "a");
    // With the cache off every read asks the node; the answers are the same.
    assert_eq!(v("cache-limit 0").await, "ok");
    assert_eq!(v("put a 3").await, "ok");
    assert_eq!(v("get a").await, "3");
    node.shutdown().await;
}

#[tokio::test]
async fn each_key_sees_only_its_own_state() {
    let node = node_on(
        ControlledBackend::new(),
        &[vault(), ("other", guests::VAULT, ModuleOptions::default())],
    )
    .await;
    assert_eq!(
        call_text(&node, "vault", "alice", "put secret 1").await,
        "ok"
    );
    assert_eq!(call_text(&node, "vault", "bob", "get secret").await, "-");
    assert_eq!(call_text(&node, "other", "alice", "get secret").await, "-");
    assert_eq!(call_text(&node, "vault", "alice", "get secret").await, "1");
    node.shutdown().await;
}

#[tokio::test]
async fn a_callback_that_traps_commits_none_of_its_writes() {
    let backend = ControlledBackend::new();
    let node = node_on(backend.clone(), &[vault()]).await;
    assert_eq!(call_text(&node, "vault", "k", "put kept 1").await, "ok");
    let commits = backend.commits();
    let err = node
        .call("vault", "k", b"put-trap lost 1".to_vec())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::KeyDied(_)), "{err}");
    assert_eq!(
        backend.commits(),
        commits,
        "a trapped callback sends no commit"
    );
    assert_eq!(call_text(&node, "vault", "k", "get lost").await, "-");
    assert_eq!(call_text(&node, "vault", "k", "get kept").await, "1");
    node.shutdown().await;
}

/// A node's embedded arbiter starts afresh at every node start, but its
/// durable store does not: an earlier run may have raised the store's fence
/// tokens past the tokens a fresh table starts with (a fence and rejoin, a
/// move, a run of another node id). The arbiter numbers its tables after
/// the store's highest fence token, so the restarted node's loads are not
/// refused as stale and its keys run, with their state.
#[tokio::test]
async fn a_restarted_embedded_node_grants_tokens_above_what_its_store_has_seen() {
    use fief::storage::{Backend, Commit, EmbeddedBackend, Fence, KeyScope, Load, Round, Write};
    let dir = tempfile::tempdir().expect("a data directory");
    let mut config = test_config();
    config.data_dir = Some(dir.path().to_owned());
    config.storage = Some("embedded".to_owned());
    // The earlier run: every partition was last loaded under token 7, and
    // counter/alice committed 41 under it.
    {
        let store = EmbeddedBackend::open(&dir.path().join("state.redb")).expect("the store");
        let alice = KeyScope {
            module: "counter".to_owned(),
            key: "alice".to_owned(),
        };
        let at = |partition: u32| Fence {
            partition,
            token: 7,
        };
        let partitions = config.partition_count();
        let loads = partitions
            .iter()
            .map(|p| Load {
                scope: alice.clone(),
                fence: at(p.0),
            })
            .collect();
        let commit = Commit {
            scope: alice.clone(),
            fence: at(partitions.of("alice").0),
            writes: vec![Write::Put {
                name: "count".to_owned(),
                value: b"41".to_vec(),
            }],
            bytes_delta: 7,
        };
        for round in [
            Round {
                loads,
                ..Round::default()
            },
            Round {
                commits: vec![commit],
                ..Round::default()
            },
        ] {
            store.round(round).await.expect("the earlier run's round");
        }
    }
    let node = fief_tests::node_with_options(
        config,
        &[
            ("counter", guests::STORED_COUNTER, ModuleOptions::default()),
            ("probe", guests::PROBE, ModuleOptions::default()),
        ],
    )
    .await;
    assert_eq!(call_text(&node, "counter", "alice", "incr").await, "42");
    let token: u64 = call_text(&node, "probe", "p", "token")
        .await
        .parse()
        .expect("a token");
    assert!(
        token > 7,
        "the fresh arbiter's tokens start above 7: {token}"
    );
    node.shutdown().await;
}

/// The output gate: a reply, a cast, a publication and a timer that follow
/// a write leave only once the write is committed.
#[tokio::test]
async fn nothing_a_callback_sends_after_a_write_leaves_before_its_commit() {
    let backend = ControlledBackend::new();
    let node = Arc::new(node_on(backend.clone(), &[vault()]).await);
    // The listener subscribes (its `pub` entry records publications). Every
    // key loads its state before the store is held.
    assert_eq!(
        call_text(&node, "vault", "listener", "subscribe news").await,
        "ok"
    );
    for key in ["listener", "target", "writer"] {
        assert_eq!(call_text(&node, "vault", key, "get x").await, "-");
    }
    for (command, check) in [
        (
            "put-cast a 1 vault target put got cast",
            ("target", "get got", "cast"),
        ),
        (
            "put-publish b 2 news hello",
            ("listener", "get pub", "hello"),
        ),
        ("put-timer c 3 0", ("writer", "get timer", "3")),
    ] {
        backend.set_held(true);
        let commits = backend.commits();
        let call = {
            let node = node.clone();
            tokio::spawn(async move {
                node.call("vault", "writer", command.as_bytes().to_vec())
                    .await
            })
        };
        // The writer's commit reached the store and waits there.
        eventually(
            Duration::from_secs(5),
            "the commit reaches the store",
            || backend.commits() > commits,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !call.is_finished(),
            "{command}: the reply waits for the commit"
        );
        // Had the cast or the publication left, its receiver would have
        // written (and committed) it by now.
        assert_eq!(
            backend.commits(),
            commits + 1,
            "{command}: only the writer's commit"
        );
        backend.set_held(false);
        call.await
            .unwrap()
            .unwrap_or_else(|e| panic!("{command}: {e}"));
        let (key, read, expected) = check;
        eventually_async(Duration::from_secs(5), command, || {
            let node = node.clone();
            async move { call_text(&node, "vault", key, read).await == expected }
        })
        .await;
    }
    Arc::try_unwrap(node)
        .ok()
        .expect("one owner")
        .shutdown()
        .await;
}

/// A commit that fails: the caller is told the store is unavailable (not
/// a reply for writes that may not have landed), every output that waited
/// is dropped, and the process ends; the next one loads what was committed.
#[tokio::test]
async fn a_failed_commit_withholds_every_output_and_the_caller_learns_it() {
    let backend = ControlledBackend::new();
    let node = node_on(backend.clone(), &[vault()]).await;
    assert_eq!(
        call_text(&node, "vault", "writer", "put before 1").await,
        "ok"
    );
    assert_eq!(call_text(&node, "vault", "target", "get got").await, "-");
    backend.set_failing(true);
    let err = node
        .call(
            "vault",
            "writer",
            b"put-cast after 2 vault target put got cast".to_vec(),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::StorageUnavailable(_)), "{err}");
    assert_eq!(err.code(), "storage_unavailable");
    assert_eq!(err.http_status(), 503);
    let text = err.to_string();
    assert!(
        text.contains("the test store is down") && text.contains("nothing that waited"),
        "{text}"
    );
    eventually(Duration::from_secs(5), "the writer's process ends", || {
        !is_live(&node, "vault", "writer")
    })
    .await;
    backend.set_failing(false);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        call_text(&node, "vault", "target", "get got").await,
        "-",
        "the cast never left"
    );
    assert_eq!(call_text(&node, "vault", "writer", "get before").await, "1");
    assert_eq!(call_text(&node, "vault", "writer", "get after").await, "-");
    node.shutdown().await;
}

/// A load the store cannot serve is a WIT `unavailable` the guest sees;
/// the node serves on.
#[tokio::test]
async fn a_load_the_store_cannot_serve_is_an_error_the_guest_sees() {
    let backend = ControlledBackend::new();
    let node = node_on(backend.clone(), &[vault()]).await;
    backend.set_failing(true);
    let reply = call_text(&node, "vault", "k", "get a").await;
    assert!(
        reply.starts_with("err:unavailable:") && reply.contains("the test store is down"),
        "{reply}"
    );
    backend.set_failing(false);
    // The next call loads afresh.
    assert_eq!(call_text(&node, "vault", "k", "put a 1").await, "ok");
    assert_eq!(call_text(&node, "vault", "k", "get a").await, "1");
    node.shutdown().await;
}

/// A process loads its key's state before its first callback, so its
/// storage imports never wait on the store: a key that has not touched its
/// storage yet reads it from memory even once the store has gone down (and
/// only its next commit finds out).
#[tokio::test]
async fn a_process_loads_its_state_before_its_first_callback() {
    let backend = ControlledBackend::new();
    let node = node_on(backend.clone(), &[vault()]).await;
    assert_eq!(call_text(&node, "vault", "k", "put a 1").await, "ok");
    node.stop_key("vault", "k", StopReason::Handoff)
        .await
        .expect("stopping the key");
    // A new process, whose callbacks have not used storage yet.
    assert!(!call_text(&node, "vault", "k", "token").await.is_empty());
    backend.set_failing(true);
    assert_eq!(
        call_text(&node, "vault", "k", "get a").await,
        "1",
        "loaded before the first callback, read from memory"
    );
    backend.set_failing(false);
    node.shutdown().await;
}

/// A `call` after a write commits the write first: the callee may act on it.
#[tokio::test]
async fn a_call_after_a_write_commits_the_write_first() {
    let backend = ControlledBackend::new();
    let node = node_on(backend.clone(), &[vault()]).await;
    assert_eq!(call_text(&node, "vault", "a", "get x").await, "-");
    let commits = backend.commits();
    assert_eq!(
        call_text(&node, "vault", "a", "put-call x 1 vault b get y").await,
        "-"
    );
    assert_eq!(
        backend.commits(),
        commits + 1,
        "one commit, before the call"
    );
    assert_eq!(call_text(&node, "vault", "a", "get x").await, "1");
    node.shutdown().await;
}

#[tokio::test]
async fn storage_limits_are_refused_with_their_names() {
    let options = ModuleOptions {
        max_storage_value_size: ByteSize::kib(1),
        max_storage_bytes_per_key: ByteSize::kib(4),
        max_storage_writes_per_callback: 10,
        ..ModuleOptions::default()
    };
    let node = node_on(
        ControlledBackend::new(),
        &[("vault", guests::VAULT, options)],
    )
    .await;
    let v = |m: String| {
        let node = &node;
        async move { call_text(node, "vault", "k", &m).await }
    };
    let reply = v("big a 1025".into()).await;
    assert!(
        reply.starts_with("err:invalid:") && reply.contains("max_storage_value_size"),
        "{reply}"
    );
    // 4 × (2 + 1,000) bytes fit in 4 KiB; a fifth does not.
    for i in 0..4 {
        assert_eq!(v(format!("big v{i} 1000")).await, "ok");
    }
    let reply = v("big v4 1000".into()).await;
    assert!(
        reply.starts_with("err:limit:") && reply.contains("max_storage_bytes_per_key"),
        "{reply}"
    );
    let reply = v("many 11".into()).await;
    assert!(
        reply.starts_with("err:limit:") && reply.contains("max_storage_writes_per_callback"),
        "{reply}"
    );
    let long = "n".repeat(fief::storage::MAX_NAME_BYTES + 1);
    let reply = v(format!("put {long} 1")).await;
    assert!(reply.starts_with("err:invalid:"), "{reply}");
    // The writes before the refusals landed; the key serves on.
    assert_eq!(v("get v2".into()).await.len(), 1000);
    // Options past the node's ceilings are refused at deploy.
    let err = node
        .deploy(
            "greedy",
            &guests::bytes(guests::VAULT),
            ModuleOptions {
                max_storage_value_size: ByteSize::mib(2),
                max_storage_bytes_per_key: ByteSize::mib(4),
                ..ModuleOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("max_storage_value_size"), "{err}");
    node.shutdown().await;
}

/// Modules built against `fief:key@0.1.0` (before `storage`) deploy and run.
#[tokio::test]
async fn a_module_built_for_fief_key_0_1_0_still_runs() {
    let node = node_on(
        ControlledBackend::new(),
        &[("legacy", guests::LEGACY, ModuleOptions::default())],
    )
    .await;
    assert_eq!(call_text(&node, "legacy", "k", "incr").await, "1");
    assert_eq!(call_text(&node, "legacy", "k", "incr").await, "2");
    assert_eq!(call_text(&node, "legacy", "k", "whoami").await, "legacy/k");
    node.shutdown().await;
}

/// The commit metrics count what happened.
#[tokio::test]
async fn commits_and_loads_are_counted() {
    let backend = ControlledBackend::new();
    let node = node_on(backend.clone(), &[vault()]).await;
    assert_eq!(call_text(&node, "vault", "k", "put a 1").await, "ok");
    assert_eq!(call_text(&node, "vault", "k", "put b 22").await, "ok");
    let text = node.metrics_text().await;
    let value = |series: &str| fief_tests::metric_value(&text, series).unwrap_or(0.0);
    assert_eq!(
        value("fief_storage_commits_total{outcome=\"ok\"}"),
        2.0,
        "{text}"
    );
    assert_eq!(value("fief_storage_loads_total{outcome=\"ok\"}"), 1.0);
    assert_eq!(value("fief_storage_tenant_bytes{tenant=\"\"}"), 5.0);
    node.shutdown().await;
}

/// Issue 19 item 3 and docs/fencing.md: a survivor of a fence (`continue`,
/// or `callback` answered `continue`) keeps running, but its ownership has
/// ended, so its writes are refused before they reach the store: the
/// caller learns it, and after the node rejoins the key's next process
/// loads what was committed before the fence. Without the refusal the
/// survivor's commit would land, since no new owner has raised the
/// partition's fence token yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continue_survivors_writes_are_refused_after_the_fence() {
    use crate::fence_modes::{PATIENCE, in_limbo, local, mode};
    use fief::LeaseState;
    use fief::core::OnFence;
    let config = fief::NodeConfig {
        lease_ttl: Duration::from_secs(3),
        renew_interval: Duration::from_millis(500),
        fence_margin: Duration::from_secs(1),
        call_timeout: Duration::from_secs(30),
        ..test_config()
    };
    let node = Instance::builder(config)
        .storage(ControlledBackend::new())
        .start()
        .await
        .expect("the node starts");
    node.deploy(
        "vault",
        &guests::bytes(guests::VAULT),
        mode(OnFence::Continue),
    )
    .await
    .expect("vault deploys");
    assert_eq!(call_text(&node, "vault", "k", "put x 1").await, "ok");

    node.inject_coordination_crash();
    eventually(PATIENCE, "the node fences", || node.status().fences >= 1).await;
    eventually_async(PATIENCE, "k is a survivor in limbo", || async {
        in_limbo(&node, "vault", "k").await.is_some()
    })
    .await;
    // The survivor still runs and reads its memory, but cannot write.
    assert_eq!(
        local(&node, "vault", "k", "get x").await.as_deref(),
        Ok("1")
    );
    let refused = local(&node, "vault", "k", "put x 2").await;
    let error = refused.expect_err("a survivor's write is refused");
    assert!(
        error.to_string().contains("ownership of the key has ended"),
        "the caller is told why: {error}"
    );

    eventually_async(Duration::from_secs(30), "the node serves again", || async {
        node.status().lease == LeaseState::Current
            && node.call("vault", "k", b"get x".to_vec()).await == Ok(b"1".to_vec())
    })
    .await;
    node.shutdown().await;
}
