//! Compile bombs within the static limits (issue "Hostile tenants cannot
//! hurt the node or each other", finding 4: a 4.4 MB component of 400 000
//! functions took 30 s of both cores and 2.2 GB of the node's memory, and
//! never returned). `fief node` compiles in a worker process of its own
//! binary (`compile_worker`), capped at `compile_memory_limit` and killed at
//! `compile_timeout`: a bomb is refused with the limit named, its compile
//! slot is free at once, the node's memory does not grow, and other keys
//! answer throughout. See docs/security.md.
//!
//! Real processes: `fief node` started by `NodeProcess`, deploys through
//! `fief deploy`.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fief_tests::{NodeProcess, fief_cli, guests};

/// A key module (`tests/wat/table-bomb.wat`) with `functions` extra
/// functions of about `body_bytes` bytes of code each, which cost the
/// compiler far more per byte than any real module: each loads a value from
/// each of `body_bytes / 8` distinct addresses before it adds them all up,
/// so every value is live at once (the register allocator's worst case).
/// Each function stays under `MAX_FUNCTION_BYTES`.
fn bomb(functions: usize, body_bytes: usize) -> Vec<u8> {
    // 8 bytes of code per value: `local.get 0` (2), `i64.load` with a
    // 3-byte offset (5), `i64.add` (1).
    let values = body_bytes / 8;
    assert!(values * 8 < fief::module::MAX_FUNCTION_BYTES);
    let mut body = String::with_capacity(values * 45);
    for i in 0..values {
        body.push_str(&format!("local.get 0 i64.load offset={} ", 16384 + i * 8));
    }
    body.push_str(&"i64.add ".repeat(values - 1));
    body.push_str("local.set 1");
    let wat =
        std::fs::read_to_string(fief_tests::workspace_root().join("tests/wat/table-bomb.wat"))
            .expect("table-bomb.wat");
    let anchor = "(table $t 1 funcref)";
    assert!(wat.contains(anchor));
    // In the table, so no compiler may skip them as unreachable.
    let mut extra = String::with_capacity((body.len() + 40) * functions + 100);
    extra.push_str(&format!("(table $t {} funcref)", functions + 1));
    extra.push_str("(elem (table $t) (i32.const 1) func");
    for i in 0..functions {
        extra.push_str(&format!(" $bomb{i}"));
    }
    extra.push(')');
    for i in 0..functions {
        extra.push_str(&format!("(func $bomb{i} (param i32) (local i64) {body})"));
    }
    fief_tests::component_from_wat(&wat.replace(anchor, &extra))
}

/// The node's peak resident memory (`VmHWM`), in KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc status")
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may hold spaces, not `)`.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u32>().ok());
        if ppid == Some(pid) {
            found.push(child);
        }
    }
    found
}

/// Deploy `path` as `module` with `fief deploy` while another thread calls
/// `counter` every 100 ms: the deploy's (success, output), and how many
/// calls answered during it (every one must).
async fn deploy_while_calling(url: &str, module: &str, path: &Path) -> (bool, String, usize) {
    let done = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let caller = {
        let (url, done, answered) = (url.to_owned(), done.clone(), answered.clone());
        tokio::spawn(async move {
            let client = reqwest::Client::new();
            let mut expected = 0;
            while !done.load(Ordering::Relaxed) {
                let reply = client
                    .post(format!("{url}/v1/keys/counter/alice/call"))
                    .body("incr")
                    .timeout(Duration::from_secs(20))
                    .send()
                    .await
                    .expect("a call during the compile answers");
                assert_eq!(reply.status(), 200, "a call during the compile succeeds");
                expected += 1;
                assert_eq!(reply.text().await.unwrap(), expected.to_string());
                answered.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let (url, module, path) = (url.to_owned(), module.to_owned(), path.to_owned());
    let out = tokio::task::spawn_blocking(move || {
        fief_cli(&[
            "deploy",
            path.to_str().unwrap(),
            "--module",
            &module,
            "--node",
            &url,
        ])
    })
    .await
    .unwrap();
    done.store(true, Ordering::Relaxed);
    caller.await.expect("the caller saw every call answer");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text, answered.load(Ordering::Relaxed))
}

fn write_bomb(dir: &Path, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join("bomb.wasm");
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A compile needing more memory than `compile_memory_limit` is refused
/// with the limit named; the node's own peak memory does not grow, no
/// worker is left, other keys answer, and a small module deploys next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compile_bomb_over_the_memory_limit_is_refused_and_the_node_serves() {
    let node = NodeProcess::start(&[
        "--no-compile-cache",
        "--compile-memory-limit",
        "512MiB",
        "--deploy",
        &format!("counter={}", guests::COUNTER),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let path = write_bomb(dir.path(), &bomb(MEMORY_BOMB.0, MEMORY_BOMB.1));
    let before = peak_rss_kib(node.pid());
    let (ok, text, answered) = deploy_while_calling(&node.url, "bomb", &path).await;
    assert!(!ok, "the bomb was refused: {text}");
    assert!(
        text.contains("the compile needed more than 512.0 MiB of memory")
            && text.contains("compile_memory_limit"),
        "{text}"
    );
    assert!(answered >= 1, "calls answered during the compile");
    let grew = peak_rss_kib(node.pid()).saturating_sub(before);
    assert!(
        grew < 100 * 1024,
        "the node's peak memory grew by {grew} KiB during the bomb's compile"
    );
    assert!(children(node.pid()).is_empty(), "no worker is left");
    let (ok, text) = deploy(&node.url, "probe", Path::new(guests::PROBE));
    assert!(ok, "a small module deploys after the bomb: {text}");
}

/// A compile past `compile_timeout` is stopped there: the worker is killed
/// (no child process is left), its slot is free at once (the next deploy
/// does not wait for the bomb), and other keys answered throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compile_past_the_timeout_is_killed_and_frees_its_slot() {
    let node = NodeProcess::start(&[
        "--no-compile-cache",
        "--compile-timeout",
        "2s",
        "--compile-memory-limit",
        "64GiB",
        "--deploy",
        &format!("counter={}", guests::COUNTER),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let path = write_bomb(dir.path(), &bomb(TIME_BOMB.0, TIME_BOMB.1));
    let started = Instant::now();
    let (ok, text, answered) = deploy_while_calling(&node.url, "bomb", &path).await;
    assert!(!ok, "the bomb was refused: {text}");
    assert!(
        text.contains("took longer than this node's compile_timeout (2s)")
            && text.contains("stopped"),
        "{text}"
    );
    assert!(answered >= 1, "calls answered during the compile");
    eprintln!("the bomb was refused after {:?}", started.elapsed());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !children(node.pid()).is_empty() {
        assert!(Instant::now() < deadline, "the worker was not killed");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The slot is free: with the bomb's compile still running (as an
    // in-process compile would be) this deploy would wait for it, minutes.
    let started = Instant::now();
    let (ok, text) = deploy(&node.url, "probe", Path::new(guests::PROBE));
    assert!(ok, "a small module deploys after the bomb: {text}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the next deploy waited {:?}",
        started.elapsed()
    );
}

/// `fief deploy` of `path` as `module`: (success, output).
fn deploy(url: &str, module: &str, path: &Path) -> (bool, String) {
    let out = fief_cli(&[
        "deploy",
        path.to_str().unwrap(),
        "--module",
        module,
        "--node",
        url,
    ]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// (functions, bytes of code each) of the bomb that runs out of 512 MiB:
/// one such function alone took 6.8 s and 450 MiB resident to compile.
const MEMORY_BOMB: (usize, usize) = (2, 1_000_000);
/// (functions, bytes of code each) of the bomb that outlasts 2 s: about a
/// minute on two cores when compiled to the end.
const TIME_BOMB: (usize, usize) = (16, 1_000_000);
