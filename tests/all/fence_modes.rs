//! The three fence modes at the fence (`docs/fencing.md`, the fence-mode
//! page; contract §1 guarantees 1–2, §2 "at the fence point, all at once").
//!
//! Every test fences an embedded node with [`Instance::fence_now`] (as if its
//! lease could not be renewed) and looks at what became of its key
//! processes: `terminate` keys are killed, `continue` keys survive in limbo
//! outside routing, `callback` keys get `handle-fence` and their answer
//! decides. The nodes here run with a long lease ([`steady_config`]) so that
//! they stay fenced for the whole test: after a fence a node rejoins only
//! once the arbiter has judged its old lease expired. Rejoining and reaping
//! are in `limbo.rs`; the timing of the fence is in `self_fencing.rs`.
//!
//! Survivors are read through *local handles*
//! ([`Instance::call_local_handle`]), the fence-mode page's "anything
//! holding their handle can still talk to them"; routed calls never reach
//! them.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fief::core::{OnFence, PartitionCount};
use fief::{Error, Instance, KeyLife, KeyLifeEvent, KeyLifeObserver, LeaseState, ModuleOptions};
use fief::{LimboEntry, NodeConfig};
use fief_tests::{call_text, eventually, eventually_async, guests, is_live, test_config};

/// Real time allowed for anything the tests wait for. Generous: only a
/// broken node takes this long.
pub(crate) const PATIENCE: Duration = Duration::from_secs(20);

/// A node configuration whose node stays fenced for the length of a test:
/// lease TTL 60 s, renewed every 20 s, fence margin 2 s. After a fence the
/// node can rejoin only once the arbiter has expired its old lease (at least
/// 20 s away), and calls wait up to 30 s, so a call that fails here fails
/// because of the fence, not a timeout.
pub(crate) fn steady_config() -> NodeConfig {
    NodeConfig {
        lease_ttl: Duration::from_secs(60),
        renew_interval: Duration::from_secs(20),
        fence_margin: Duration::from_secs(2),
        call_timeout: Duration::from_secs(30),
        ..test_config()
    }
}

/// Module options with `on_fence = mode`.
pub(crate) fn mode(mode: OnFence) -> ModuleOptions {
    ModuleOptions {
        on_fence: mode,
        ..ModuleOptions::default()
    }
}

/// Module options for the `spin` guest: a CPU limit so high that only a
/// kill stops a spinner (never the CPU limit), with `on_fence = mode`.
pub(crate) fn spin_options(on_fence: OnFence) -> ModuleOptions {
    ModuleOptions {
        on_fence,
        cpu_limit: Duration::from_secs(600),
        ..ModuleOptions::default()
    }
}

/// Every key process's start and end on a node (its [`KeyLife`] observer).
#[derive(Clone, Default)]
pub(crate) struct Lives {
    events: Arc<Mutex<Vec<KeyLife>>>,
}

impl Lives {
    /// The observer to install with `InstanceBuilder::observer`.
    pub(crate) fn observer(&self) -> KeyLifeObserver {
        let events = self.events.clone();
        Arc::new(move |life: KeyLife| events.lock().unwrap().push(life))
    }

    /// The life events of `module`/`key`, in the order they were reported.
    pub(crate) fn of(&self, module: &str, key: &str) -> Vec<KeyLifeEvent> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.module == module && e.key == key)
            .map(|e| e.event)
            .collect()
    }

    /// The full records of `module`/`key`, in the order they were reported.
    pub(crate) fn records(&self, module: &str, key: &str) -> Vec<KeyLife> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| e.module == module && e.key == key)
            .cloned()
            .collect()
    }

    /// Whether the process of `module`/`key` that started has ended (its
    /// store was dropped): the last event is `Ended`.
    pub(crate) fn ended(&self, module: &str, key: &str) -> bool {
        self.of(module, key).last() == Some(&KeyLifeEvent::Ended)
    }
}

/// Start a node with `config`, recording key lives in `lives`, and deploy
/// `modules` (name, guest path, options) on it.
pub(crate) async fn observed_node(
    config: NodeConfig,
    lives: &Lives,
    modules: &[(&str, &str, ModuleOptions)],
) -> Arc<Instance> {
    let node = Instance::builder(config)
        .observer(lives.observer())
        .start()
        .await
        .expect("the node starts");
    assert_eq!(node.status().lease, LeaseState::Current, "the node joined");
    for (name, path, options) in modules {
        node.deploy(name, &guests::bytes(path), options.clone())
            .await
            .unwrap_or_else(|e| panic!("deploying {name}: {e}"));
    }
    Arc::new(node)
}

/// Call a key through a local handle; the reply as text.
pub(crate) async fn local(
    node: &Instance,
    module: &str,
    key: &str,
    message: &str,
) -> fief::Result<String> {
    node.call_local_handle(module, key, message.as_bytes().to_vec())
        .await
        .map(|reply| String::from_utf8(reply).expect("a UTF-8 reply"))
}

/// Like [`local`], failing the test if the call fails.
pub(crate) async fn local_ok(node: &Instance, module: &str, key: &str, message: &str) -> String {
    local(node, module, key, message)
        .await
        .unwrap_or_else(|e| panic!("local handle {module}/{key} {message:?}: {e}"))
}

/// A routed call; the reply as text.
async fn routed(node: &Instance, module: &str, key: &str, message: &str) -> fief::Result<String> {
    node.call(module, key, message.as_bytes().to_vec())
        .await
        .map(|reply| String::from_utf8(reply).expect("a UTF-8 reply"))
}

/// The survivor of `module`/`key` in the node's limbo, if there is one.
pub(crate) async fn in_limbo(node: &Instance, module: &str, key: &str) -> Option<LimboEntry> {
    node.limbo()
        .await
        .into_iter()
        .find(|e| e.module == module && e.key == key)
}

/// The partition of `key` under `config`.
pub(crate) fn partition_of(config: &NodeConfig, key: &str) -> u32 {
    PartitionCount::new(config.partitions)
        .expect("a valid partition count")
        .of(key)
        .0
}

// ---------------------------------------------------------------------------
// terminate
// ---------------------------------------------------------------------------

/// The page, ":terminate — the default": "Key processes are killed at the
/// fence deadline", and "Routing single-ownership. A fenced node stops
/// accepting key messages". A key of a module deployed with default options
/// is killed at the fence (gone from `keys()`, never in limbo, its life
/// ended), and every routed message to the node is refused with `fenced`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_kills_every_key_at_the_fence_and_the_node_refuses_calls() {
    let lives = Lives::default();
    let node = observed_node(
        steady_config(),
        &lives,
        &[("probe", guests::PROBE, ModuleOptions::default())],
    )
    .await;
    for key in ["a", "b"] {
        assert_eq!(call_text(&node, "probe", key, "ping").await, "pong");
    }
    assert_eq!(node.keys().len(), 2);

    node.fence_now();
    assert_ne!(node.status().lease, LeaseState::Current);
    eventually(PATIENCE, "both keys are killed", || {
        node.keys().is_empty() && lives.ended("probe", "a") && lives.ended("probe", "b")
    })
    .await;
    assert!(
        node.limbo().await.is_empty(),
        "terminate keys never survive"
    );
    for key in ["a", "b", "never-started"] {
        assert_eq!(
            routed(&node, "probe", key, "ping").await,
            Err(Error::Fenced),
            "{key}"
        );
        assert_eq!(
            node.cast("probe", key, b"record x".to_vec()),
            Err(Error::Fenced),
            "{key}"
        );
        assert!(
            local(&node, "probe", key, "ping").await.is_err(),
            "no process of {key} is left to reach"
        );
    }
    assert!(node.keys().is_empty(), "no call activated a key");
    assert_eq!(lives.of("probe", "a").len(), 2, "one life, ended");
}

/// The page: "The kill is a supervision teardown whose completion time does
/// not depend on user code: a slow callback cannot keep a process alive past
/// the fence" (contract §2: the kill flag, the epoch tick, the dropped
/// store). A `spin` key in the middle of a call that never returns dies at
/// the fence and its caller gets an error; so does a `probe` key blocked in
/// a host `call` to another spinning key, and that spinner. The spinners'
/// CPU limit (600 s) is far away: only the fence stops them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminate_kills_keys_in_the_middle_of_a_callback() {
    let lives = Lives::default();
    let node = observed_node(
        steady_config(),
        &lives,
        &[
            ("spin", guests::SPIN, spin_options(OnFence::Terminate)),
            ("probe", guests::PROBE, ModuleOptions::default()),
        ],
    )
    .await;
    // `s` host-calls probe/marker-s, then spins in the same handle-call: once
    // the marker is live, `s` is inside its callback.
    let spinning = tokio::spawn({
        let node = node.clone();
        async move {
            node.call("spin", "s", b"spin-after-call probe marker-s".to_vec())
                .await
        }
    });
    // `caller` host-calls spin/other, which spins: once `other` is live,
    // `caller` is blocked inside its callback, in the host call.
    let blocked = tokio::spawn({
        let node = node.clone();
        async move {
            node.call("probe", "caller", b"call spin other spin".to_vec())
                .await
        }
    });
    eventually(PATIENCE, "s spins and caller waits on other", || {
        is_live(&node, "probe", "marker-s") && is_live(&node, "spin", "other")
    })
    .await;
    assert!(is_live(&node, "spin", "s") && is_live(&node, "probe", "caller"));

    node.fence_now();
    let spun = tokio::time::timeout(PATIENCE, spinning)
        .await
        .expect("the spinner's caller is answered")
        .unwrap();
    assert!(
        matches!(&spun, Err(Error::KeyDied(why)) if why.contains("fenced")),
        "the spinner was killed by the fence: {spun:?}"
    );
    let waited = tokio::time::timeout(PATIENCE, blocked)
        .await
        .expect("the blocked caller's caller is answered")
        .unwrap();
    assert!(
        matches!(&waited, Err(Error::KeyDied(why)) if why.contains("fenced")),
        "the key blocked in a host call was killed by the fence: {waited:?}"
    );
    eventually(PATIENCE, "every key is gone", || {
        node.keys().is_empty()
            && ["s", "other"].iter().all(|k| lives.ended("spin", k))
            && ["caller", "marker-s"]
                .iter()
                .all(|k| lives.ended("probe", k))
    })
    .await;
    assert!(node.limbo().await.is_empty());
}

// ---------------------------------------------------------------------------
// continue
// ---------------------------------------------------------------------------

/// The page, ":continue": "Key processes survive the fence and keep
/// running. Fief's routing to them stops (that much is unconditional), but
/// the processes themselves live on: timers fire, scheduled work runs,
/// anything holding their PID can still talk to them", and "Survivors are
/// enumerable". The survivor leaves `keys()` for `limbo()` (module, key,
/// partition, mode `continue`); routed calls and casts are refused with
/// `fenced`; a timer it armed before the fence fires after it; a local
/// handle reaches it, and it may even arm new timers (the forfeit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_survives_in_limbo_outside_routing_and_its_timers_still_fire() {
    let config = steady_config();
    let lives = Lives::default();
    let node = observed_node(
        config.clone(),
        &lives,
        &[("cache", guests::PROBE, mode(OnFence::Continue))],
    )
    .await;
    assert_eq!(call_text(&node, "cache", "c", "ping").await, "pong");
    // Armed before the fence, fires well after it.
    call_text(&node, "cache", "c", "after 3000 late").await;
    let partition = partition_of(&config, "c");
    assert_eq!(node.keys()[0].partition, partition);

    node.fence_now();
    // Out of the kill tree at once, into limbo.
    assert!(
        !is_live(&node, "cache", "c"),
        "not a routed live key any more"
    );
    let entry = in_limbo(&node, "cache", "c").await.expect("c is in limbo");
    assert_eq!(
        (entry.module.as_str(), entry.key.as_str(), entry.partition),
        ("cache", "c", partition)
    );
    assert_eq!(entry.mode, "continue");
    assert_eq!(node.limbo().await.len(), 1);

    // Routing to it stops: calls and casts are refused, and nothing new is
    // activated for the key.
    assert_eq!(
        routed(&node, "cache", "c", "ping").await,
        Err(Error::Fenced)
    );
    assert_eq!(
        node.cast("cache", "c", b"record x".to_vec()),
        Err(Error::Fenced)
    );
    assert!(node.keys().is_empty());

    // A local handle still reaches it; the timer has not fired yet...
    assert_eq!(local_ok(&node, "cache", "c", "ping").await, "pong");
    assert_eq!(
        local_ok(&node, "cache", "c", "events").await,
        "",
        "the timer fires after the fence, not before"
    );
    // ...and then does, on the survivor.
    eventually_async(PATIENCE, "the pre-fence timer fires", || async {
        local_ok(&node, "cache", "c", "events").await == "timer:late"
    })
    .await;
    // The survivor can still act: it arms a timer after the fence.
    local_ok(&node, "cache", "c", "after 0 post-fence").await;
    eventually_async(PATIENCE, "a timer armed after the fence fires", || async {
        local_ok(&node, "cache", "c", "events").await == "timer:late\ntimer:post-fence"
    })
    .await;
    assert_eq!(lives.of("cache", "c"), vec![KeyLifeEvent::Started]);
    assert!(in_limbo(&node, "cache", "c").await.is_some());
}

/// The page, ":continue", the worst case named precisely: "a :continue
/// survivor that subscribed to PubSub in init keeps acting on every
/// broadcast … while its successor serves the same key on another node — a
/// live split-brain actor". Shown here on purpose: after the fence a
/// survivor subscribed to `T` still receives what another survivor
/// publishes on `T` (pub/sub is per node, and every routed key of a fenced
/// node is gone, so the publisher is a survivor driven through its local
/// handle). In a cluster the key's new owner would be serving at the same
/// time; this is the combination the page says to refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_survivor_with_a_subscription_keeps_acting_after_the_fence() {
    let lives = Lives::default();
    let node = observed_node(
        steady_config(),
        &lives,
        &[("cache", guests::PROBE, mode(OnFence::Continue))],
    )
    .await;
    assert_eq!(
        call_text(&node, "cache", "listener", "subscribe T").await,
        "ok"
    );
    assert_eq!(call_text(&node, "cache", "speaker", "ping").await, "pong");
    assert_eq!(
        call_text(&node, "cache", "speaker", "publish T before").await,
        "1"
    );

    node.fence_now();
    assert_eq!(node.limbo().await.len(), 2);
    assert_eq!(
        routed(&node, "cache", "listener", "events").await,
        Err(Error::Fenced)
    );
    // The survivor still publishes, and the other survivor still acts on it.
    assert_eq!(
        local_ok(&node, "cache", "speaker", "publish T after-fence").await,
        "1"
    );
    eventually_async(PATIENCE, "the listener got the publication", || async {
        local_ok(&node, "cache", "listener", "events").await == "pub:T:before\npub:T:after-fence"
    })
    .await;
    // And acts on it in turn: its own effects still pass the host's gate.
    assert_eq!(
        local_ok(&node, "cache", "listener", "publish T echo").await,
        "1"
    );
    assert_eq!(lives.of("cache", "listener"), vec![KeyLifeEvent::Started]);
}

// ---------------------------------------------------------------------------
// callback
// ---------------------------------------------------------------------------

/// The page, ":callback": "At the fence, handle_fence/2 is fanned out to
/// the key module's processes, carrying the advisory's deadline". Three keys
/// of a callback module (deadline 80 ms) each record `fence:80`, and each
/// answered `continue`, so each is in limbo with mode `callback`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_fans_handle_fence_out_to_every_key_with_the_deadline() {
    let options = ModuleOptions {
        handle_fence_deadline: Duration::from_millis(80),
        ..mode(OnFence::Callback)
    };
    let lives = Lives::default();
    let node = observed_node(steady_config(), &lives, &[("cb", guests::PROBE, options)]).await;
    let keys = ["k1", "k2", "k3"];
    for key in keys {
        assert_eq!(call_text(&node, "cb", key, "on-fence continue").await, "ok");
    }

    node.fence_now();
    for key in keys {
        eventually_async(PATIENCE, &format!("{key} ran handle-fence"), || async {
            local_ok(&node, "cb", key, "events").await == "fence:80"
        })
        .await;
    }
    let limbo = node.limbo().await;
    assert_eq!(
        limbo.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(),
        keys
    );
    assert!(
        limbo
            .iter()
            .all(|e| e.module == "cb" && e.mode == "callback")
    );
    assert!(node.keys().is_empty());
    for key in keys {
        assert_eq!(lives.of("cb", key), vec![KeyLifeEvent::Started]);
        assert_eq!(routed(&node, "cb", key, "events").await, Err(Error::Fenced));
    }
}

/// The page, ":callback": "{:stop, reason} stops the process;
/// {:continue, state} keeps it alive with the same survivor semantics as
/// :continue above". Of two keys of one callback module, the one answering
/// `stop` (probe's default) ends and leaves limbo; the one answering
/// `continue` stays in limbo, mode `callback`, reachable by local handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_stop_ends_the_key_and_continue_keeps_it_in_limbo() {
    let lives = Lives::default();
    let node = observed_node(
        steady_config(),
        &lives,
        &[("cb", guests::PROBE, mode(OnFence::Callback))],
    )
    .await;
    assert_eq!(call_text(&node, "cb", "stopper", "ping").await, "pong");
    assert_eq!(
        call_text(&node, "cb", "stayer", "on-fence continue").await,
        "ok"
    );

    node.fence_now();
    eventually(PATIENCE, "the stopper ended", || {
        lives.ended("cb", "stopper")
    })
    .await;
    eventually_async(PATIENCE, "only the stayer is in limbo", || async {
        let limbo = node.limbo().await;
        limbo.len() == 1 && limbo[0].key == "stayer"
    })
    .await;
    let stayer = in_limbo(&node, "cb", "stayer").await.unwrap();
    assert_eq!(stayer.mode, "callback");
    assert_eq!(local_ok(&node, "cb", "stayer", "events").await, "fence:50");
    assert!(local(&node, "cb", "stopper", "events").await.is_err());
    assert_eq!(lives.of("cb", "stayer"), vec![KeyLifeEvent::Started]);
    assert_eq!(
        lives.of("cb", "stopper"),
        vec![KeyLifeEvent::Started, KeyLifeEvent::Ended]
    );
}

/// The page, ":callback": "The callback runs under a deadline … the
/// deadline is advisory, the fence is not. A callback that overruns doesn't
/// delay the fence" (contract §2: "A callback that overruns is killed at its
/// deadline; the fence never waits for it"; row 10 "slow handle-fence").
/// `spin` deployed with `on_fence = callback` never returns from
/// `handle-fence`: `fence_now` returns anyway, with the node fenced and its
/// terminate keys killed; the spinner is killed at its deadline (its CPU
/// limit is 600 s, so nothing else stops it) and leaves limbo, while a
/// well-behaved callback key of another module survives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_that_overruns_its_deadline_is_killed_and_never_delays_the_fence() {
    let lives = Lives::default();
    let node = observed_node(
        steady_config(),
        &lives,
        &[
            ("slow", guests::SPIN, spin_options(OnFence::Callback)),
            ("cb", guests::PROBE, mode(OnFence::Callback)),
            ("probe", guests::PROBE, ModuleOptions::default()),
        ],
    )
    .await;
    assert_eq!(call_text(&node, "slow", "s", "ping").await, "pong");
    assert_eq!(
        call_text(&node, "cb", "ok", "on-fence continue").await,
        "ok"
    );
    assert_eq!(call_text(&node, "probe", "t", "ping").await, "pong");

    // Returns: the fence does not wait for any handle-fence.
    node.fence_now();
    assert_ne!(node.status().lease, LeaseState::Current);
    assert_eq!(
        routed(&node, "probe", "t", "ping").await,
        Err(Error::Fenced)
    );

    eventually(PATIENCE, "the overrunning callback is killed", || {
        lives.ended("slow", "s")
    })
    .await;
    eventually_async(PATIENCE, "it left limbo", || async {
        in_limbo(&node, "slow", "s").await.is_none()
    })
    .await;
    assert!(local(&node, "slow", "s", "ping").await.is_err());
    eventually(PATIENCE, "the terminate key is killed", || {
        lives.ended("probe", "t")
    })
    .await;
    // The well-behaved callback key is unaffected.
    assert_eq!(local_ok(&node, "cb", "ok", "events").await, "fence:50");
    assert_eq!(in_limbo(&node, "cb", "ok").await.unwrap().mode, "callback");
}

/// The page, ":callback", first workload: "A key that subscribed to PubSub
/// … unsubscribes / demotes itself to read-only in handle_fence and answers
/// {:continue, state} — keeping its state warm for local readers without
/// becoming the split-brain actor described under :continue. This is the
/// sanctioned pairing". The `quiet` guest (callback mode) subscribes to
/// `room:q` in `init` and unsubscribes in `handle-fence`: after the fence a
/// survivor's publication on `room:q` reaches a `continue` listener on the
/// same topic but not `q`, which stays readable through its local handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_key_that_unsubscribes_in_handle_fence_goes_quiet() {
    let lives = Lives::default();
    let node = observed_node(
        steady_config(),
        &lives,
        &[
            ("quiet", guests::QUIET, mode(OnFence::Callback)),
            ("loud", guests::PROBE, mode(OnFence::Continue)),
        ],
    )
    .await;
    assert_eq!(call_text(&node, "quiet", "q", "state").await, "subscribed");
    assert_eq!(
        call_text(&node, "loud", "listener", "subscribe room:q").await,
        "ok"
    );
    assert_eq!(
        call_text(&node, "loud", "speaker", "publish room:q before").await,
        "2"
    );
    // Let q take the publication in before the fence: one still queued in
    // its mailbox at the fence would be delivered after handle-fence.
    eventually_async(PATIENCE, "q received the publication", || async {
        call_text(&node, "quiet", "q", "get").await == "pub:before"
    })
    .await;

    node.fence_now();
    eventually_async(PATIENCE, "q ran handle-fence", || async {
        local_ok(&node, "quiet", "q", "state").await == "quiet"
    })
    .await;
    assert_eq!(
        local_ok(&node, "quiet", "q", "get").await,
        "pub:before\nfence:50"
    );
    assert_eq!(
        in_limbo(&node, "quiet", "q").await.unwrap().mode,
        "callback"
    );

    // A survivor publishes after the fence: only the continue listener,
    // still subscribed, gets it.
    assert_eq!(
        local_ok(&node, "loud", "speaker", "publish room:q after").await,
        "1"
    );
    eventually_async(PATIENCE, "the continue listener got it", || async {
        local_ok(&node, "loud", "listener", "events").await == "pub:room:q:before\npub:room:q:after"
    })
    .await;
    assert_eq!(
        local_ok(&node, "quiet", "q", "get").await,
        "pub:before\nfence:50",
        "q went quiet and kept its state for local readers"
    );
    assert_eq!(lives.of("quiet", "q"), vec![KeyLifeEvent::Started]);
}
