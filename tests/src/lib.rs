//! Shared helpers for Fief's integration tests: the guest components (built
//! from source by `build.rs`) and small conveniences for starting nodes.

use std::time::Duration;

use fief::{Instance, ModuleOptions, NodeConfig};

/// The guest components, built from source for these tests.
pub mod guests {
    /// `examples/counter`: `incr`, `get`, `tick-every <ms>`.
    pub const COUNTER: &str = env!("FIEF_GUEST_COUNTER");
    /// `examples/room`: pub/sub history.
    pub const ROOM: &str = env!("FIEF_GUEST_ROOM");
    /// `tests/guests/probe`: exercises every host import and export.
    pub const PROBE: &str = env!("FIEF_GUEST_PROBE");
    /// `tests/guests/spin`: infinite loops in callbacks.
    pub const SPIN: &str = env!("FIEF_GUEST_SPIN");
    /// `tests/guests/bomb`: memory, recursion, reply and flood bombs.
    pub const BOMB: &str = env!("FIEF_GUEST_BOMB");

    /// The bytes of a guest component.
    pub fn bytes(path: &str) -> Vec<u8> {
        std::fs::read(path).unwrap_or_else(|e| panic!("reading guest {path}: {e}"))
    }
}

/// A node configuration for tests: a random free port is not needed (the
/// library API does not listen), small pools so engines are cheap.
pub fn test_config() -> NodeConfig {
    NodeConfig {
        max_live_keys: 256,
        max_memory_per_key: fief::config::ByteSize::mib(128),
        ..NodeConfig::default()
    }
}

/// Start an embedded node and deploy `modules` (name, guest path) with
/// default options.
pub async fn node_with(modules: &[(&str, &str)]) -> Instance {
    let node = Instance::start_embedded(test_config())
        .await
        .expect("node starts");
    for (name, path) in modules {
        node.deploy(name, &guests::bytes(path), ModuleOptions::default())
            .await
            .unwrap_or_else(|e| panic!("deploying {name}: {e}"));
    }
    node
}

/// Poll `check` every 10 ms until it is true, failing after `limit`.
pub async fn eventually(limit: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
