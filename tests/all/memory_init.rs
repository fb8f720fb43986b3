//! `memory_init` (docs/operations.md, "Live keys and eviction"): a node set
//! to `copy` gives each key its module's data by copying, so no key maps
//! the module's data image; the default maps it copy-on-write into every
//! live key, from an image built when the module is deployed. Read from the
//! node process's own `/proc/<pid>/maps` and `/proc/<pid>/fd`, so the node
//! runs as a child process (the test process's other nodes map images of
//! their own).

use fief_tests::{NodeProcess, fief_cli, guests};

/// Keys each node activates.
const KEYS: usize = 12;

/// The counter's keys on a node started with `extra`, each called twice
/// (its count, kept in the guest's memory, must read 2), then the node's
/// mappings of a module's data image.
fn image_mappings_of_live_keys(extra: &[&str]) -> usize {
    let deploy = format!("counter={}", guests::COUNTER);
    let mut args = vec!["--no-compile-cache", "--deploy", deploy.as_str()];
    args.extend_from_slice(extra);
    let node = NodeProcess::start(&args);
    for i in 0..KEYS {
        let key = format!("k{i}");
        for expected in ["1", "2"] {
            let output = fief_cli(&["call", "--node", &node.url, "counter", &key, "incr"]);
            assert!(
                output.status.success(),
                "calling {key}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            assert_eq!(String::from_utf8_lossy(&output.stdout).trim(), expected);
        }
    }
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", node.pid()))
        .expect("the node's memory mappings");
    maps.lines()
        .filter(|line| line.contains("wasm-memory-image"))
        .count()
}

#[test]
fn a_node_that_copies_initial_memory_maps_no_data_image_into_its_keys() {
    let mapped = image_mappings_of_live_keys(&[]);
    assert!(
        mapped >= KEYS,
        "by default each of the {KEYS} live keys maps the module's data image: {mapped} mappings"
    );
    let copied = image_mappings_of_live_keys(&["--memory-init", "copy"]);
    assert_eq!(
        copied, 0,
        "with --memory-init copy no key maps a data image: {copied} mappings"
    );
}

/// The node's open files that hold a module's data image (memfds named
/// `wasm-memory-image`).
fn image_files(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the node's open files")
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy().contains("wasm-memory-image"))
        .count()
}

#[test]
fn a_modules_data_image_is_built_at_deploy_not_in_its_first_keys_activation() {
    let deploy = format!("counter={}", guests::COUNTER);
    let node = NodeProcess::start(&["--no-compile-cache", "--deploy", deploy.as_str()]);
    let built = image_files(node.pid());
    assert!(
        built >= 1,
        "the deployed counter's data image exists before any key is activated: {built} image files"
    );
    let copying = NodeProcess::start(&[
        "--no-compile-cache",
        "--deploy",
        deploy.as_str(),
        "--memory-init",
        "copy",
    ]);
    assert_eq!(
        image_files(copying.pid()),
        0,
        "a node that copies initial memory builds no image"
    );
}
