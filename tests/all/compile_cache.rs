//! The compilation cache (issue "Deploy modules to a running cluster", item
//! 3): a restarted node loads its modules' compiled code from disk instead of
//! compiling again, and a bad cache entry costs a compile, never a deploy.

use std::path::Path;

use fief::{Instance, ModuleInfo, ModuleOptions, NodeConfig};
use fief_tests::{call_text, guests, test_config};

fn config_with_cache(dir: &Path) -> NodeConfig {
    NodeConfig {
        compile_cache: Some(dir.to_owned()),
        ..test_config()
    }
}

async fn deploy_counter(node: &Instance) -> ModuleInfo {
    node.deploy(
        "counter",
        &guests::bytes(guests::COUNTER),
        ModuleOptions::default(),
    )
    .await
    .expect("counter deploys")
}

fn cache_entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("the cache directory exists")
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cwasm"))
        .collect();
    entries.sort();
    entries
}

#[tokio::test]
async fn a_restarted_node_loads_its_modules_without_recompiling() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let first = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node starts");
    let info = deploy_counter(&first).await;
    assert!(!info.compile_cached, "the first deploy compiles: {info:?}");
    assert_eq!(info.content_hash.len(), 64, "{info:?}");
    assert_eq!(call_text(&first, "counter", "alice", "incr").await, "1");
    first.shutdown().await;
    let entries = cache_entries(dir.path());
    assert_eq!(entries.len(), 1, "one artifact was written: {entries:?}");
    assert!(
        entries[0]
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(&info.content_hash),
        "the entry is keyed by the content hash: {entries:?}"
    );

    let second = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node restarts");
    let again = deploy_counter(&second).await;
    assert!(
        again.compile_cached,
        "the restart loads from the cache: {again:?}"
    );
    assert_eq!(again.content_hash, info.content_hash);
    assert_eq!(call_text(&second, "counter", "alice", "incr").await, "1");
    assert_eq!(call_text(&second, "counter", "alice", "incr").await, "2");
    second.shutdown().await;
}

#[tokio::test]
async fn different_bytes_are_compiled_and_cached_separately() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let node = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node starts");
    let counter = deploy_counter(&node).await;
    let probe = node
        .deploy(
            "probe",
            &guests::bytes(guests::PROBE),
            ModuleOptions::default(),
        )
        .await
        .expect("probe deploys");
    assert!(!probe.compile_cached, "other bytes are compiled: {probe:?}");
    assert_ne!(probe.content_hash, counter.content_hash);
    assert_eq!(cache_entries(dir.path()).len(), 2);
    node.shutdown().await;
}

#[tokio::test]
async fn a_corrupt_cache_entry_is_recompiled_and_replaced() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let node = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node starts");
    deploy_counter(&node).await;
    node.shutdown().await;
    let entries = cache_entries(dir.path());
    std::fs::write(&entries[0], b"not a compiled component").expect("corrupting the entry");

    let node = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node restarts");
    let info = deploy_counter(&node).await;
    assert!(
        !info.compile_cached,
        "a corrupt entry is not used: {info:?}"
    );
    assert_eq!(call_text(&node, "counter", "bob", "incr").await, "1");
    node.shutdown().await;
    let bytes = std::fs::read(&entries[0]).expect("the entry was rewritten");
    assert_ne!(bytes, b"not a compiled component", "the entry was replaced");

    let node = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node restarts");
    assert!(deploy_counter(&node).await.compile_cached);
    node.shutdown().await;
}

#[tokio::test]
async fn a_refused_component_leaves_nothing_in_the_cache() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let node = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node starts");
    // The WASI command adapter's shape without the fief:key exports: a
    // component that compiles but does not implement the world.
    let not_a_key = b"\0asm\x0d\0\x01\0";
    let err = node
        .deploy("empty", not_a_key, ModuleOptions::default())
        .await
        .expect_err("an empty component is refused");
    assert!(err.to_string().contains("fief:key"), "{err}");
    assert!(cache_entries(dir.path()).is_empty());
    node.shutdown().await;
}

#[tokio::test]
async fn an_unusable_cache_directory_is_a_clear_start_error() {
    let file = tempfile::NamedTempFile::new().expect("a temp file");
    let err = Instance::start_embedded(config_with_cache(&file.path().join("cache")))
        .await
        .err()
        .expect("a cache directory under a file cannot be created");
    let text = err.to_string();
    assert!(text.contains("compile cache"), "{text}");
    assert!(text.contains("--compile-cache"), "{text}");
}

/// The names of the cache's entries, as the content hashes they hold.
fn cached_hashes(dir: &Path) -> Vec<String> {
    let mut hashes: Vec<String> = cache_entries(dir)
        .iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.split('-').next().unwrap().to_owned()
        })
        .collect();
    hashes.sort();
    hashes
}

fn sorted(mut hashes: Vec<String>) -> Vec<String> {
    hashes.sort();
    hashes
}

/// Issue "Hostile tenants cannot hurt the node or each other", finding 4: a
/// bomb's 86 MB compiled-cache file stayed on disk after its undeploy. Now
/// undeploy, a redeploy and a rollback remove the entries of components no
/// module's current version (nor this node) uses any more, and keep the
/// others; a rollback compiles its version again.
#[tokio::test]
async fn undeploy_redeploy_and_rollback_remove_unused_cache_entries() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let node = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node starts");
    let deploy = |name: &'static str, guest: &'static str| {
        let node = &node;
        async move {
            node.deploy(name, &guests::bytes(guest), ModuleOptions::default())
                .await
                .unwrap_or_else(|e| panic!("{name} deploys: {e}"))
                .content_hash
        }
    };
    let counter = deploy("a", guests::COUNTER).await;
    let probe = deploy("b", guests::PROBE).await;
    assert_eq!(
        cached_hashes(dir.path()),
        sorted(vec![counter.clone(), probe.clone()])
    );

    // A redeploy of `a` leaves its first version's component unused.
    let quiet = deploy("a", guests::QUIET).await;
    node.sync_modules().await.unwrap();
    assert_eq!(
        cached_hashes(dir.path()),
        sorted(vec![probe.clone(), quiet.clone()]),
        "the redeploy dropped the counter's entry"
    );

    // A rollback past version 2 leaves that version's component unused,
    // and compiles version 1 again.
    let back = node.rollback("a", 1).await.unwrap();
    assert_eq!(back.content_hash, counter);
    assert_eq!(
        cached_hashes(dir.path()),
        sorted(vec![counter.clone(), probe.clone()]),
        "the rollback dropped quiet's entry and cached the counter again"
    );
    assert_eq!(call_text(&node, "a", "k", "incr").await, "1");

    node.undeploy("b").await.unwrap();
    assert_eq!(cached_hashes(dir.path()), vec![counter.clone()]);
    node.undeploy("a").await.unwrap();
    assert!(
        cached_hashes(dir.path()).is_empty(),
        "nothing left after undeploying everything: {:?}",
        cache_entries(dir.path())
    );
    node.shutdown().await;
}

/// A module used by two names keeps its entry while either uses it.
#[tokio::test]
async fn an_entry_shared_by_two_modules_stays_until_both_are_gone() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let node = Instance::start_embedded(config_with_cache(dir.path()))
        .await
        .expect("node starts");
    let bytes = guests::bytes(guests::COUNTER);
    node.deploy("one", &bytes, ModuleOptions::default())
        .await
        .unwrap();
    let two = node
        .deploy("two", &bytes, ModuleOptions::default())
        .await
        .unwrap();
    assert!(two.compile_cached, "the second name shares the entry");
    node.undeploy("one").await.unwrap();
    assert_eq!(cached_hashes(dir.path()), vec![two.content_hash.clone()]);
    assert_eq!(call_text(&node, "two", "k", "incr").await, "1");
    node.undeploy("two").await.unwrap();
    assert!(cached_hashes(dir.path()).is_empty());
    node.shutdown().await;
}
