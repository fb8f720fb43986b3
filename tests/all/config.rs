//! Node configuration that cannot be safe is refused at start, with an error
//! that names the numbers (contract §2 "Timing model": the fence point must
//! precede the arbiter's expiry; a configuration that does not fit is refused
//! with an error that names the numbers).

use std::time::Duration;

use fief::{Error, Instance, NodeConfig};
use fief_tests::test_config;

async fn refused(config: NodeConfig) -> String {
    match Instance::start_embedded(config).await {
        Err(Error::Config(why)) => why,
        Err(other) => panic!("expected Error::Config, got {other:?}"),
        Ok(_) => panic!("an unsafe configuration was accepted"),
    }
}

#[tokio::test]
async fn a_fence_margin_not_shorter_than_the_ttl_is_refused() {
    let why = refused(NodeConfig {
        lease_ttl: Duration::from_secs(5),
        fence_margin: Duration::from_secs(5),
        ..test_config()
    })
    .await;
    assert!(why.contains("fence_margin (5s)"), "{why}");
    assert!(why.contains("lease_ttl (5s)"), "{why}");
}

#[tokio::test]
async fn a_renew_interval_too_long_for_the_ttl_is_refused() {
    let why = refused(NodeConfig {
        lease_ttl: Duration::from_secs(5),
        fence_margin: Duration::from_secs(1),
        renew_interval: Duration::from_secs(3),
        ..test_config()
    })
    .await;
    assert!(why.contains("renew_interval (3s)"), "{why}");
    assert!(why.contains("lease_ttl"), "{why}");
}

#[tokio::test]
async fn a_zero_ttl_is_refused() {
    let why = refused(NodeConfig {
        lease_ttl: Duration::ZERO,
        ..test_config()
    })
    .await;
    assert!(why.contains("lease_ttl (0ns)"), "{why}");
}

#[tokio::test]
async fn a_fence_margin_too_small_for_clock_drift_is_refused() {
    // 10,000 ppm over a 5 s TTL is 50 ms of drift: more than half of 10 ms.
    let why = refused(NodeConfig {
        fence_margin: Duration::from_millis(10),
        ..test_config()
    })
    .await;
    assert!(why.contains("10000 ppm"), "{why}");
    assert!(why.contains("fence_margin (10ms)"), "{why}");
}

#[tokio::test]
async fn a_fence_margin_too_small_for_the_default_fence_deadline_is_refused() {
    // The drift (50 ms) fits in half of 100 ms, but the default
    // handle_fence_deadline (50 ms) + kill bound (10 ms) + drift does not.
    let why = refused(NodeConfig {
        fence_margin: Duration::from_millis(100),
        ..test_config()
    })
    .await;
    assert!(why.contains("handle_fence_deadline (50ms)"), "{why}");
    assert!(why.contains("fence_margin (100ms)"), "{why}");
}

#[tokio::test]
async fn a_safe_configuration_starts() {
    let node = Instance::start_embedded(NodeConfig {
        lease_ttl: Duration::from_secs(3),
        renew_interval: Duration::from_millis(500),
        fence_margin: Duration::from_millis(500),
        ..test_config()
    })
    .await
    .expect("a safe configuration starts");
    assert_eq!(node.status().lease, fief::LeaseState::Current);
    node.shutdown().await;
}
