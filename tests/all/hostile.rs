//! The hostile-guest suite (contract §5 row 10; issue 5 item 6): the
//! `hostile` guest attacks its node from every callback and through every
//! import — infinite loops in `init`, `handle-call`, `handle-cast`,
//! `handle-info`, `handle-fence` and `terminate`, memory, table-growth
//! (`tests/wat/table-bomb.wat`) and handle-table bombs, deep recursion, huge replies, floods of timers and publications,
//! calls to itself and call cycles, files and sockets it was not granted.
//! Each attack is contained with a clear error, and a well-behaved key of
//! another module (another tenant's) on the same node answers while the
//! attack runs and after it.

use std::sync::Arc;
use std::time::Duration;

use fief::config::ByteSize;
use fief::core::OnFence;
use fief::{Error, Instance, ModuleOptions, NodeConfig};
use fief_tests::{call_text, eventually, eventually_async, guests, is_live, test_config};

use crate::fence_modes::{Lives, PATIENCE, in_limbo, local_ok, observed_node, steady_config};

/// CPU budget of a hostile callback: short, so a looping attack ends soon.
pub(crate) const CPU_LIMIT: Duration = Duration::from_millis(200);

/// The hostile module's options: 16 MiB of memory, 10 timers, 50
/// publications per second, 200 ms of CPU per callback.
pub(crate) fn hostile_options() -> ModuleOptions {
    ModuleOptions {
        memory_limit: ByteSize::mib(16),
        cpu_limit: CPU_LIMIT,
        max_timers_per_key: 10,
        max_publishes_per_second: 50,
        ..ModuleOptions::default()
    }
}

/// A node with `hostile` (with `options`) and a well-behaved `probe`.
pub(crate) async fn node(options: ModuleOptions) -> Arc<Instance> {
    node_with_config(test_config(), options).await
}

/// [`node`], with `config`.
pub(crate) async fn node_with_config(config: NodeConfig, options: ModuleOptions) -> Arc<Instance> {
    let node = fief_tests::node_with_options(
        config,
        &[
            ("hostile", guests::HOSTILE, options),
            ("probe", guests::PROBE, ModuleOptions::default()),
        ],
    )
    .await;
    Arc::new(node)
}

/// Shut the node down once the attack tasks have let go of it.
pub(crate) async fn stop(node: Arc<Instance>) {
    if let Ok(node) = Arc::try_unwrap(node) {
        node.shutdown().await;
    }
}

/// The other tenant's key answers.
pub(crate) async fn bystander_served(node: &Instance) {
    assert_eq!(call_text(node, "probe", "bystander", "ping").await, "pong");
}

/// Run `attack` in a task; while it runs, and after it, the bystander is
/// served. Returns the attack's result.
pub(crate) async fn during<T: Send + 'static>(
    node: &Arc<Instance>,
    attack: impl Future<Output = T> + Send + 'static,
) -> T {
    let attack = tokio::spawn(attack);
    bystander_served(node).await;
    let result = tokio::time::timeout(PATIENCE, attack)
        .await
        .expect("the attack is contained in time")
        .expect("the attack task");
    bystander_served(node).await;
    result
}

/// Call `hostile/key` with `message` during an attack.
async fn attack_call(node: &Arc<Instance>, key: &str, message: &str) -> fief::Result<Vec<u8>> {
    let (n, key, message) = (node.clone(), key.to_owned(), message.as_bytes().to_vec());
    during(node, async move { n.call("hostile", &key, message).await }).await
}

/// `KeyDied`'s text, or a panic naming what came instead.
fn key_died(result: fief::Result<Vec<u8>>) -> String {
    match result {
        Err(Error::KeyDied(why)) => why,
        other => panic!("expected KeyDied, got {:?}", other.map(String::from_utf8)),
    }
}

fn text(reply: fief::Result<Vec<u8>>) -> String {
    String::from_utf8(reply.expect("a reply")).expect("UTF-8")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_in_init_is_killed_at_the_cpu_limit() {
    let node = node(hostile_options()).await;
    let why = key_died(attack_call(&node, "loop-init-1", "ping").await);
    assert!(why.contains("CPU limit exceeded"), "{why}");
    assert!(!is_live(&node, "hostile", "loop-init-1"));
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_in_handle_call_is_killed_at_the_cpu_limit() {
    let node = node(hostile_options()).await;
    let why = key_died(attack_call(&node, "h", "loop").await);
    assert!(why.contains("CPU limit exceeded"), "{why}");
    assert!(why.contains("cpu_limit"), "names the option: {why}");
    assert_eq!(call_text(&node, "hostile", "h", "ping").await, "pong");
    stop(node).await;
}

/// A loop in a callback nobody waits on (`handle-cast`, `handle-info`)
/// kills the key at its CPU limit all the same: the key's process ends
/// without a kill, and the next message starts a fresh one.
async fn loop_without_caller(node: &Arc<Instance>, start: impl FnOnce(&Instance)) {
    assert_eq!(call_text(node, "hostile", "h", "ping").await, "pong");
    start(node);
    let n = node.clone();
    during(node, async move {
        eventually(PATIENCE, "the looping key dies", || {
            !is_live(&n, "hostile", "h")
        })
        .await;
    })
    .await;
    assert_eq!(call_text(node, "hostile", "h", "ping").await, "pong");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_in_handle_cast_is_killed_at_the_cpu_limit() {
    let node = node(hostile_options()).await;
    loop_without_caller(&node, |node| {
        node.cast("hostile", "h", b"loop".to_vec()).unwrap();
    })
    .await;
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_in_handle_info_is_killed_at_the_cpu_limit() {
    let node = node(hostile_options()).await;
    // `loop-timer` arms a 1 ms timer whose `handle-info` loops.
    let n = node.clone();
    loop_without_caller(&node, move |_| {
        tokio::spawn(async move { n.call("hostile", "h", b"loop-timer".to_vec()).await });
    })
    .await;
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_infinite_loop_in_terminate_is_killed_at_the_cpu_limit() {
    let options = ModuleOptions {
        idle_timeout: Duration::from_millis(100),
        ..hostile_options()
    };
    let node = node(options).await;
    assert_eq!(
        call_text(&node, "hostile", "loop-terminate-1", "ping").await,
        "pong"
    );
    // Idle: the node calls `terminate`, which loops until the CPU limit.
    let n = node.clone();
    during(&node, async move {
        eventually(PATIENCE, "the key stopped despite terminate", || {
            !is_live(&n, "hostile", "loop-terminate-1")
        })
        .await;
    })
    .await;
    assert_eq!(
        call_text(&node, "hostile", "loop-terminate-1", "ping").await,
        "pong"
    );
    stop(node).await;
}

/// A `handle-fence` that never returns is killed at its deadline
/// (`handle_fence_deadline`) though its CPU limit is far away; the fence
/// does not wait for it, and a well-behaved key of another module keeps
/// answering through its local handle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_callback_that_never_returns_is_killed_at_its_deadline() {
    let lives = Lives::default();
    let node = observed_node(
        steady_config(),
        &lives,
        &[
            (
                "hostile-fence",
                guests::HOSTILE,
                ModuleOptions {
                    on_fence: OnFence::Callback,
                    cpu_limit: Duration::from_secs(600),
                    ..ModuleOptions::default()
                },
            ),
            (
                "tenant-b",
                guests::PROBE,
                ModuleOptions {
                    on_fence: OnFence::Callback,
                    ..ModuleOptions::default()
                },
            ),
        ],
    )
    .await;
    assert_eq!(call_text(&node, "hostile-fence", "f", "ping").await, "pong");
    assert_eq!(
        call_text(&node, "tenant-b", "ok", "on-fence continue").await,
        "ok"
    );
    node.fence_now();
    eventually(PATIENCE, "the never-returning callback is killed", || {
        lives.ended("hostile-fence", "f")
    })
    .await;
    eventually_async(PATIENCE, "it left limbo", || async {
        in_limbo(&node, "hostile-fence", "f").await.is_none()
    })
    .await;
    assert_eq!(local_ok(&node, "tenant-b", "ok", "ping").await, "pong");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_bomb_is_killed_at_its_memory_limit() {
    let node = node(hostile_options()).await;
    let why = key_died(attack_call(&node, "h", "memory").await);
    assert!(why.contains("memory limit"), "{why}");
    stop(node).await;
}

/// Host resources (here WASI pollables never dropped) live in host memory,
/// outside `memory_limit`: a key is trapped once it holds
/// `MAX_RESOURCES_PER_KEY`, long before its CPU limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_table_bomb_is_stopped_at_the_resource_limit() {
    let node = node(ModuleOptions {
        cpu_limit: Duration::from_secs(30),
        ..hostile_options()
    })
    .await;
    let why = key_died(attack_call(&node, "h", "handles").await);
    assert!(
        !why.contains("CPU limit"),
        "the table limit stopped it: {why}"
    );
    assert!(why.contains("resource table"), "{why}");
    assert_eq!(call_text(&node, "hostile", "h", "ping").await, "pong");
    stop(node).await;
}

/// The hand-written table bomb (`tests/wat/table-bomb.wat`: Rust
/// cannot emit `table.grow`) as a component of the `fief:key/key-module`
/// world, made with wit-component from the repository's WIT.
fn table_bomb_component() -> Vec<u8> {
    let path = fief_tests::workspace_root().join("tests/wat/table-bomb.wat");
    fief_tests::component_from_wat(&std::fs::read_to_string(path).expect("table-bomb.wat"))
}

/// A table growth bomb (`table.grow` in a loop) is trapped where the key's
/// tables reach their bound (100 000 elements per table, and the pool's
/// per-table slot), long before its CPU limit, with an error that says so;
/// the node goes on serving another module's key, and the bomb's next
/// message starts a fresh process that bombs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_growth_bomb_is_trapped_at_the_table_limit() {
    let node = node(hostile_options()).await;
    node.deploy(
        "table-bomb",
        table_bomb_component(),
        ModuleOptions {
            cpu_limit: Duration::from_secs(30),
            ..hostile_options()
        },
    )
    .await
    .expect("the table bomb is a valid key module");
    for _ in 0..2 {
        let (n, message) = (node.clone(), b"grow".to_vec());
        let result = during(
            &node,
            async move { n.call("table-bomb", "t", message).await },
        )
        .await;
        let why = key_died(result);
        assert!(
            !why.contains("CPU limit"),
            "the table limit stopped it: {why}"
        );
        assert!(why.contains("table limit exceeded"), "{why}");
        eprintln!("the table bomb died: {why}");
        bystander_served(&node).await;
    }
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_recursion_traps_only_that_key() {
    let node = node(hostile_options()).await;
    let why = key_died(attack_call(&node, "h", "recurse").await);
    assert!(why.contains("trap"), "{why}");
    assert!(!why.contains("CPU limit"), "the recursion trapped: {why}");
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_reply_is_dropped_at_the_modules_reply_limit() {
    let node = node(ModuleOptions {
        max_reply_size: Some(ByteSize::kib(4)),
        max_message_size: Some(ByteSize::kib(1)),
        ..hostile_options()
    })
    .await;
    let err = attack_call(&node, "h", "reply 1000000").await.unwrap_err();
    assert_eq!(
        err,
        Error::ReplyTooLarge {
            size: 1_000_000,
            limit: 4096
        }
    );
    assert!(err.to_string().contains("max_reply_size"), "{err}");
    assert_eq!(
        text(node.call("hostile", "h", b"reply 4096".to_vec()).await).len(),
        4096
    );
    // The module's message limit, under the node's (1 MiB).
    let err = node
        .call("hostile", "h", vec![b' '; 1025])
        .await
        .unwrap_err();
    assert_eq!(
        err,
        Error::MessageTooLarge {
            size: 1025,
            limit: 1024
        }
    );
    let err = node.cast("hostile", "h", vec![b' '; 1025]).unwrap_err();
    assert!(
        matches!(err, Error::MessageTooLarge { limit: 1024, .. }),
        "{err:?}"
    );
    // Another module is not held to it.
    let reply = text(
        node.call(
            "probe",
            "bystander",
            format!("echo {}", "y".repeat(2000)).into_bytes(),
        )
        .await,
    );
    assert_eq!(reply.len(), 2000);
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_timers_is_refused_at_max_timers_per_key() {
    let node = node(hostile_options()).await;
    let reply = text(attack_call(&node, "h", "timers").await);
    assert!(reply.starts_with("10 "), "{reply}");
    assert!(reply.contains("max_timers_per_key"), "{reply}");
    assert_eq!(call_text(&node, "hostile", "h", "ping").await, "pong");
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_publications_is_refused_at_max_publishes_per_second() {
    let node = node(hostile_options()).await;
    // The bystander listens: it is not drowned.
    assert_eq!(
        call_text(&node, "probe", "listener", "subscribe hostile:flood").await,
        "ok"
    );
    let reply = text(attack_call(&node, "h", "publish-flood").await);
    let (count, why) = reply.split_once(' ').expect("count and error");
    let count: u64 = count.parse().expect("a count");
    // The burst is one second's worth (50); the flood takes far less than a
    // second, so at most a few more tokens came back meanwhile.
    assert!((50..100).contains(&count), "{reply}");
    assert!(why.contains("max_publishes_per_second"), "{why}");
    assert!(why.contains("Limit"), "an effect-error limit: {why}");
    // Refused, not killed.
    assert_eq!(call_text(&node, "hostile", "h", "ping").await, "pong");
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_that_calls_itself_gets_deadlock_at_once() {
    let node = node(hostile_options()).await;
    let reply = text(attack_call(&node, "h", "call-self").await);
    assert!(reply.contains("Deadlock"), "{reply}");
    assert_eq!(call_text(&node, "hostile", "h", "ping").await, "pong");
    stop(node).await;
}

/// A cycle through another key (a calls b, b calls a) is not a self-call:
/// b's call to the busy a times out after its 1 s timeout with a clear
/// error, a gets that as b's reply, and nothing hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cycle_times_out_instead_of_hanging() {
    let node = node(hostile_options()).await;
    let reply = text(attack_call(&node, "a", "call hostile b call hostile a ping").await);
    assert!(reply.starts_with("error: "), "{reply}");
    assert!(
        reply.contains("timed out") || reply.contains("Unavailable"),
        "{reply}"
    );
    assert_eq!(call_text(&node, "hostile", "a", "ping").await, "pong");
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_not_granted_cannot_be_opened() {
    let node = node(hostile_options()).await;
    assert_eq!(text(attack_call(&node, "h", "preopens").await), "0");
    let secret = std::env::temp_dir().join(format!("fief-hostile-secret-{}", std::process::id()));
    std::fs::write(&secret, "secret").unwrap();
    let reply = text(attack_call(&node, "h", &format!("read {}", secret.display())).await);
    assert!(reply.starts_with("error: "), "{reply}");
    let target = std::env::temp_dir().join(format!("fief-hostile-{}", std::process::id()));
    let reply = text(attack_call(&node, "h", &format!("write {} x", target.display())).await);
    assert!(reply.starts_with("error: "), "{reply}");
    assert!(!target.exists(), "the guest wrote to the host");
    std::fs::remove_file(&secret).unwrap();
    stop(node).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sockets_are_refused() {
    let node = node(hostile_options()).await;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let reply = text(attack_call(&node, "h", &format!("tcp {addr}")).await);
    assert!(reply.contains("access-denied"), "{reply}");
    assert!(listener.accept().is_err(), "the guest connected");
    let reply = text(attack_call(&node, "h", "udp").await);
    assert!(reply.contains("access-denied"), "{reply}");
    let reply = text(attack_call(&node, "h", "lookup localhost").await);
    assert!(reply.starts_with("error: "), "{reply}");
    stop(node).await;
}

/// The one capability a module may be granted: a directory, at `/data`,
/// read-only or read-write as the option says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_directory_is_served_with_its_permissions() {
    let dir = std::env::temp_dir().join(format!("fief-hostile-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("given"), "hello").unwrap();
    let with_dir = |mode: &str| ModuleOptions {
        dir: Some(format!("{}:{mode}", dir.display()).parse().unwrap()),
        ..hostile_options()
    };
    let node = fief_tests::node_with_options(
        test_config(),
        &[
            ("ro", guests::HOSTILE, with_dir("ro")),
            ("rw", guests::HOSTILE, with_dir("rw")),
        ],
    )
    .await;
    assert_eq!(call_text(&node, "ro", "k", "preopens").await, "1");
    assert_eq!(
        call_text(&node, "ro", "k", "read /data/given").await,
        "hello"
    );
    let reply = call_text(&node, "ro", "k", "write /data/new x").await;
    assert!(reply.starts_with("error: "), "{reply}");
    assert!(!dir.join("new").exists());
    // Outside /data there is still nothing.
    let reply = call_text(&node, "ro", "k", "read /etc/hostname").await;
    assert!(reply.starts_with("error: "), "{reply}");
    assert_eq!(call_text(&node, "rw", "k", "write /data/new x").await, "ok");
    assert_eq!(std::fs::read_to_string(dir.join("new")).unwrap(), "x");
    node.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_directory_that_does_not_exist_is_refused_at_deploy() {
    let node = Instance::start_embedded(test_config()).await.unwrap();
    let options = ModuleOptions {
        dir: Some("/nonexistent/fief-data:ro".parse().unwrap()),
        ..ModuleOptions::default()
    };
    let err = node
        .deploy("hostile", &guests::bytes(guests::HOSTILE), options)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidOptions(_)), "{err:?}");
    assert!(err.to_string().contains("/nonexistent/fief-data"), "{err}");
    node.shutdown().await;
}
