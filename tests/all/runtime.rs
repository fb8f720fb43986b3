//! The single-node key runtime: activation, ordering, counter semantics.

use fief_tests::{guests, node_with};

#[tokio::test]
async fn counter_counts_per_key() {
    let node = node_with(&[("counter", guests::COUNTER)]).await;
    assert_eq!(
        node.call("counter", "alice", b"incr".to_vec())
            .await
            .unwrap(),
        b"1"
    );
    assert_eq!(
        node.call("counter", "alice", b"incr".to_vec())
            .await
            .unwrap(),
        b"2"
    );
    assert_eq!(
        node.call("counter", "bob", b"get".to_vec()).await.unwrap(),
        b"0"
    );
    node.shutdown().await;
}
