//! The `fief:key/host` imports (contract §4 "Imports `host`"): identity,
//! ownership token, timers, pub/sub, key-to-key calls and casts, logging —
//! each driven through the `probe` guest, plus the `room` example.

use std::time::Duration;

use fief_tests::{call_text, eventually_async, guests, node_with};

#[tokio::test]
async fn a_key_knows_its_module_and_name() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert_eq!(
        call_text(&node, "probe", "alice", "whoami").await,
        "probe/alice"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn a_key_reads_a_positive_ownership_token() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let token: u64 = call_text(&node, "probe", "alice", "token")
        .await
        .parse()
        .expect("the token is a number");
    assert!(token > 0, "token {token}");
    node.shutdown().await;
}

/// Design.md "Ownership token": the token a key reads strictly increases
/// each time its partition's ownership changes. One node fences twice and
/// rejoins each time (every partition is then assigned anew); the key reads
/// its token before the first fence and after each rejoin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_ownership_token_strictly_increases_when_its_owner_changes() {
    let config = fief::NodeConfig {
        lease_ttl: Duration::from_secs(3),
        renew_interval: Duration::from_millis(500),
        fence_margin: Duration::from_secs(1),
        ..fief_tests::test_config()
    };
    let node = std::sync::Arc::new(
        fief_tests::node_with_options(
            config,
            &[("probe", guests::PROBE, fief::ModuleOptions::default())],
        )
        .await,
    );
    // The token, once the node serves the key (after a rejoin, within 30 s).
    let token = || async {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(reply) = node.call("probe", "alice", b"token".to_vec()).await {
                return String::from_utf8(reply)
                    .expect("UTF-8")
                    .parse::<u64>()
                    .expect("the token is a number");
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the node did not serve again"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let mut tokens = vec![token().await];
    for _ in 0..2 {
        node.fence_now();
        tokens.push(token().await);
    }
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "the tokens across two owner changes: {tokens:?}"
    );
    if let Ok(node) = std::sync::Arc::try_unwrap(node) {
        node.shutdown().await;
    }
}

#[tokio::test]
async fn a_timer_fires_with_its_tag() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let id = call_text(&node, "probe", "k", "after 50 t").await;
    id.parse::<u64>()
        .unwrap_or_else(|_| panic!("a timer id, got {id:?}"));
    eventually_async(Duration::from_secs(5), "the timer fires", || async {
        call_text(&node, "probe", "k", "events").await == "timer:t"
    })
    .await;
    node.shutdown().await;
}

#[tokio::test]
async fn a_cancelled_timer_never_fires() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let id = call_text(&node, "probe", "k", "after 100 cancelled").await;
    assert_eq!(
        call_text(&node, "probe", "k", &format!("cancel {id}")).await,
        "true"
    );
    // A later timer that is not cancelled: once it has fired, the cancelled
    // one (due 300 ms earlier) would have fired too.
    call_text(&node, "probe", "k", "after 400 control").await;
    eventually_async(
        Duration::from_secs(5),
        "the control timer fires",
        || async {
            call_text(&node, "probe", "k", "events")
                .await
                .contains("timer:control")
        },
    )
    .await;
    assert_eq!(
        call_text(&node, "probe", "k", "events").await,
        "timer:control"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn a_publication_reaches_a_subscriber_of_another_key() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert_eq!(
        call_text(&node, "probe", "reader", "subscribe news").await,
        "ok"
    );
    assert_eq!(
        call_text(&node, "probe", "writer", "publish news hello").await,
        "1",
        "delivered to one subscriber"
    );
    // The publication is in the reader's mailbox before this call.
    assert_eq!(
        call_text(&node, "probe", "reader", "events").await,
        "pub:news:hello"
    );
    assert_eq!(
        call_text(&node, "probe", "writer", "events").await,
        "",
        "not subscribed"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn an_unsubscribed_key_gets_nothing() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    call_text(&node, "probe", "reader", "subscribe news").await;
    assert_eq!(
        call_text(&node, "probe", "reader", "unsubscribe news").await,
        "ok"
    );
    assert_eq!(
        call_text(&node, "probe", "writer", "publish news hello").await,
        "0"
    );
    assert_eq!(call_text(&node, "probe", "reader", "events").await, "");
    node.shutdown().await;
}

#[tokio::test]
async fn a_key_calls_another_key() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert_eq!(
        call_text(&node, "probe", "a", "call probe b ping").await,
        "pong"
    );
    assert_eq!(
        call_text(&node, "probe", "a", "call probe b whoami").await,
        "probe/b"
    );
    node.shutdown().await;
}

#[tokio::test]
async fn a_key_calling_itself_gets_deadlock() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert_eq!(
        call_text(&node, "probe", "a", "call probe a ping").await,
        "error: CallError::Deadlock"
    );
    // The key is still healthy.
    assert_eq!(call_text(&node, "probe", "a", "ping").await, "pong");
    node.shutdown().await;
}

#[tokio::test]
async fn a_key_calling_an_unknown_module_gets_an_error() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let reply = call_text(&node, "probe", "a", "call nosuch k ping").await;
    assert!(
        reply.starts_with("error: CallError::UnknownModule"),
        "{reply}"
    );
    assert!(reply.contains("nosuch"), "{reply}");
    node.shutdown().await;
}

#[tokio::test]
async fn a_key_casts_to_another_key() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert_eq!(
        call_text(&node, "probe", "a", "cast probe b hi").await,
        "ok"
    );
    // The cast is in b's mailbox before a replies.
    assert_eq!(call_text(&node, "probe", "b", "events").await, "cast:hi");
    node.shutdown().await;
}

#[tokio::test]
async fn a_cast_to_an_unknown_module_is_an_error_reply() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    let reply = call_text(&node, "probe", "a", "cast nosuch k hi").await;
    assert!(reply.starts_with("error: "), "{reply}");
    assert!(reply.contains("nosuch"), "{reply}");
    node.shutdown().await;
}

#[tokio::test]
async fn log_and_print_do_not_disturb_the_key() {
    let node = node_with(&[("probe", guests::PROBE)]).await;
    assert_eq!(
        call_text(&node, "probe", "a", "log hello from the log").await,
        "ok"
    );
    assert_eq!(
        call_text(&node, "probe", "a", "print hello from stdout").await,
        "ok"
    );
    assert_eq!(call_text(&node, "probe", "a", "ping").await, "pong");
    node.shutdown().await;
}

#[tokio::test]
async fn a_room_keeps_what_was_said() {
    let node = node_with(&[("room", guests::ROOM)]).await;
    assert_eq!(call_text(&node, "room", "lobby", "say hello").await, "1");
    assert_eq!(call_text(&node, "room", "lobby", "say world").await, "1");
    assert_eq!(
        call_text(&node, "room", "lobby", "get").await,
        "hello\nworld"
    );
    assert_eq!(
        call_text(&node, "room", "other", "get").await,
        "",
        "rooms are separate"
    );
    node.shutdown().await;
}

/// `room` keys `<room>/<member>` are members of the room `<room>`, as is
/// the key `<room>` itself (a key with no `/`): a member hears what the
/// others of its room say, and a member of another room hears nothing.
#[tokio::test]
async fn room_members_hear_their_room() {
    let node = node_with(&[("room", guests::ROOM)]).await;
    // Start the members: each subscribes in `init`.
    for key in ["lobby/ann", "lobby/bob", "attic/ann"] {
        assert_eq!(call_text(&node, "room", key, "get").await, "", "{key}");
    }
    assert_eq!(
        call_text(&node, "room", "lobby/ann", "say hi bob").await,
        "2"
    );
    // The key `lobby` starts (and joins its room) with this call.
    assert_eq!(call_text(&node, "room", "lobby", "say hi all").await, "3");
    assert_eq!(
        call_text(&node, "room", "lobby/bob", "get").await,
        "hi bob\nhi all"
    );
    assert_eq!(
        call_text(&node, "room", "lobby/ann", "get").await,
        "hi bob\nhi all"
    );
    assert_eq!(call_text(&node, "room", "lobby", "get").await, "hi all");
    assert_eq!(
        call_text(&node, "room", "attic/ann", "get").await,
        "",
        "another room hears nothing"
    );
    node.shutdown().await;
}
