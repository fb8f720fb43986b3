//! WebSocket connections to Python and JavaScript keys (issue 21:
//! connections in every SDK). Every module `scripts/build-guest.sh` builds
//! exports `connection-handler`, as every Rust module `export_key!` makes.
//!
//! - `examples/chat-js` and `examples/chat-py` are the Rust `examples/chat`
//!   in JavaScript and Python: they talk to real WebSocket clients through
//!   the node's HTTP API exactly as the Rust room does (the same transcript,
//!   step for step: `send-text`, `list-connections`, `close`).
//! - All three keep their history alike, so a room survives its module's
//!   rewrite from one language to another (Rust, JavaScript, Python, Rust),
//!   its clients staying connected all along.
//! - The Python and JavaScript probes echo text and binary frames as the
//!   Rust probe does (`send-binary`, which the chat rooms do not use).
//! - A key that does not handle connections (the Python and JavaScript
//!   counters) closes each as it opens, as a Rust one does.

use std::sync::Arc;
use std::time::Duration;

use fief::{Instance, StopReason};
use fief_tests::ws::{self, Client};
use fief_tests::{HttpServer, call_text, eventually, eventually_async, guests, is_live};
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;

use crate::languages::{script_config, script_options};

/// How long a client waits for one frame (a first activation of an
/// interpreter on a loaded machine included).
const PATIENCE: Duration = Duration::from_secs(30);

/// A node serving `modules` (name, component; the script options) over
/// its HTTP API.
async fn node(modules: &[(&str, &str)]) -> (Arc<Instance>, HttpServer) {
    let mut builder = Instance::builder(script_config());
    for (name, path) in modules {
        builder = builder.module(name, guests::bytes(path), script_options());
    }
    let node = Arc::new(builder.start().await.expect("a node"));
    let server = HttpServer::start(node.clone()).await;
    (node, server)
}

async fn connect(server: &HttpServer, module: &str, key: &str) -> Client {
    ws::connect(&server.base, module, key).await
}

async fn next_text(client: &mut Client) -> String {
    ws::next_text(client, PATIENCE).await
}

async fn next_close(client: &mut Client) -> Option<CloseFrame> {
    ws::next_close(client, PATIENCE).await
}

/// The next text or binary frame (pings skipped), within [`PATIENCE`].
async fn next_data(client: &mut Client) -> Message {
    loop {
        let frame = tokio::time::timeout(PATIENCE, client.next())
            .await
            .expect("a frame within the patience")
            .expect("the connection is open")
            .expect("a frame, not an error");
        match frame {
            Message::Ping(_) | Message::Pong(_) => {}
            other => return other,
        }
    }
}

/// Wait until room `key` of `module` says it has `n` connections.
async fn connections_become(node: &Instance, module: &str, key: &str, n: usize) {
    eventually_async(
        PATIENCE,
        &format!("{module}/{key} has {n} connections"),
        || async { call_text(node, module, key, "connections").await == n.to_string() },
    )
    .await;
}

/// Drive room `lobby` of a chat module through real WebSocket clients and
/// calls, and return what every step answered, so the Rust, JavaScript and
/// Python rooms can be compared. Each step goes through the module's
/// connection handler and the connection imports: `send-text` (every frame
/// heard), `list-connections` (`connections`, and whom a message goes to),
/// `close` (the binary frame's 4000).
async fn chat_transcript(node: &Instance, server: &HttpServer, module: &str) -> Vec<String> {
    let mut steps = Vec::new();
    let mut step = |what: &str, answer: String| steps.push(format!("{what} => {answer}"));
    let mut ann = connect(server, module, "lobby").await;
    let mut bob = connect(server, module, "lobby").await;
    connections_become(node, module, "lobby", 2).await;
    step(
        "connections",
        call_text(node, module, "lobby", "connections").await,
    );

    // A client's frame reaches every connection, the sender's included.
    ann.send(Message::text("hello from ann")).await.unwrap();
    step("ann hears", next_text(&mut ann).await);
    step("bob hears", next_text(&mut bob).await);
    bob.send(Message::text("hi from bob")).await.unwrap();
    step("ann hears", next_text(&mut ann).await);
    step("bob hears", next_text(&mut bob).await);
    // A call's message too; the reply counts the connections.
    step(
        "say",
        call_text(node, module, "lobby", "say from http").await,
    );
    step("ann hears", next_text(&mut ann).await);
    step("bob hears", next_text(&mut bob).await);

    // A newcomer gets the history first, in order.
    let mut cid = connect(server, module, "lobby").await;
    for _ in 0..3 {
        step("cid catches up", next_text(&mut cid).await);
    }
    step(
        "connections",
        call_text(node, module, "lobby", "connections").await,
    );
    step("history", call_text(node, module, "lobby", "history").await);

    // A binary frame closes its connection; the others stay.
    cid.send(Message::binary(vec![1, 2, 3])).await.unwrap();
    let close = next_close(&mut cid).await.expect("a close frame");
    step(
        "cid closed",
        format!("{} {}", u16::from(close.code), close.reason),
    );
    connections_become(node, module, "lobby", 2).await;
    // A client that closes is detached.
    ann.close(None).await.unwrap();
    connections_become(node, module, "lobby", 1).await;
    step("say", call_text(node, module, "lobby", "say bye").await);
    step("bob hears", next_text(&mut bob).await);
    drop(bob);

    // A bad call is refused with the same text.
    let refused = node
        .call(module, "lobby", b"bogus".to_vec())
        .await
        .expect_err("bogus is refused");
    step("bogus", refused.to_string());
    // The room keeps its last 100 messages.
    for i in 0..100 {
        call_text(node, module, "hall", &format!("say m{i}")).await;
    }
    let history = call_text(node, module, "hall", "history").await;
    step("hall keeps", history.lines().count().to_string());
    step(
        "say m100, to no connection",
        call_text(node, module, "hall", "say m100").await,
    );
    let history = call_text(node, module, "hall", "history").await;
    step(
        "hall keeps",
        format!(
            "{} from {}",
            history.lines().count(),
            history.lines().next().unwrap_or_default()
        ),
    );
    steps
}

/// The Rust `chat`'s transcript (module `chat` on `node`), checked answer by
/// answer: the reference the other languages' rooms are compared with.
async fn rust_transcript(node: &Instance, server: &HttpServer) -> Vec<String> {
    let rust = chat_transcript(node, server, "chat").await;
    let answers: Vec<&str> = rust
        .iter()
        .map(|step| step.split_once(" => ").unwrap().1)
        .collect();
    assert_eq!(
        &answers[..14],
        [
            "2",
            "hello from ann",
            "hello from ann",
            "hi from bob",
            "hi from bob",
            "2",
            "from http",
            "from http",
            "hello from ann",
            "hi from bob",
            "from http",
            "3",
            "hello from ann\nhi from bob\nfrom http",
            "4000 chat: text frames only",
        ],
        "{rust:#?}"
    );
    assert_eq!(&answers[14..16], ["1", "bye"], "{rust:#?}");
    assert!(
        answers[16].contains("unknown message: bogus; expected history, connections, say <text>"),
        "{rust:#?}"
    );
    assert_eq!(&answers[17..], ["100", "0", "100 from m1"], "{rust:#?}");
    rust
}

/// Issue 21 (connections in every SDK): clients connected to a room of
/// `chat-js` talk through it as through the Rust `chat` on the same node
/// and HTTP API: every frame reaches every connection, a call's message
/// too, a newcomer gets the history first, `connections` and `history`
/// answer alike, a binary frame closes its connection with 4000, and
/// the last 100 messages are kept. The two transcripts are equal, step
/// for step.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_javascript_chat_room_talks_like_the_rust_one() {
    let (node, server) = node(&[("chat", guests::CHAT), ("chat-js", guests::CHAT_JS)]).await;
    let rust = rust_transcript(&node, &server).await;
    let javascript = chat_transcript(&node, &server, "chat-js").await;
    assert_eq!(javascript, rust, "chat-js answers like the Rust chat");
    eventually(PATIENCE, "every socket closed", || {
        node.status().sockets == 0
    })
    .await;
}

/// Issue 21, the Python SDK's connections: clients connected to a room of
/// `chat-py` talk through it as through the Rust `chat`, the transcript
/// equal step for step, so the SDK's `ConnectionHandler` passes every event
/// (opened, text, binary, closed) to the key and its `connections.send_text`,
/// `connections.list` and `connections.close` act as the Rust SDK's do.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_python_chat_room_talks_like_the_rust_one() {
    let (node, server) = node(&[("chat", guests::CHAT), ("chat-py", guests::CHAT_PY)]).await;
    let rust = rust_transcript(&node, &server).await;
    let python = chat_transcript(&node, &server, "chat-py").await;
    assert_eq!(python, rust, "chat-py answers like the Rust chat");
    eventually(PATIENCE, "every socket closed", || {
        node.status().sockets == 0
    })
    .await;
}

/// The three rooms keep their history under the same storage entry, in the
/// same JSON: a module `rooms` deployed as the Rust `chat`, then redeployed
/// as `chat-js`, then as `chat-py`, then as `chat` again, keeps its room's
/// history through every rewrite, and a client connected all along stays
/// attached to the room (the connection is the node's, not a process's):
/// it hears the processes of every language, and its frames reach the
/// Python process, which finds it with `list-connections` though it never
/// saw it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chat_room_keeps_its_history_and_clients_across_a_rewrite_in_another_language() {
    let (node, server) = node(&[("rooms", guests::CHAT)]).await;
    let mut ann = connect(&server, "rooms", "den").await;
    ann.send(Message::text("said in Rust")).await.unwrap();
    assert_eq!(next_text(&mut ann).await, "said in Rust");

    let rewrite = async |path: &str, said: &str| {
        node.deploy("rooms", guests::bytes(path), script_options())
            .await
            .expect("redeploying rooms");
        // The live process finishes on its version: stop it, so the
        // next message starts one of the new version.
        node.stop_key("rooms", "den", StopReason::Idle)
            .await
            .expect("stopping rooms/den");
        eventually(PATIENCE, "the old process is gone", || {
            !is_live(&node, "rooms", "den")
        })
        .await;
        assert_eq!(call_text(&node, "rooms", "den", "connections").await, "1");
        assert_eq!(
            call_text(&node, "rooms", "den", &format!("say {said}")).await,
            "1"
        );
    };
    rewrite(guests::CHAT_JS, "said in JavaScript").await;
    assert_eq!(next_text(&mut ann).await, "said in JavaScript");
    assert_eq!(
        call_text(&node, "rooms", "den", "history").await,
        "said in Rust\nsaid in JavaScript"
    );
    // A client of the JavaScript room gets the history Rust kept.
    let mut bob = connect(&server, "rooms", "den").await;
    assert_eq!(next_text(&mut bob).await, "said in Rust");
    assert_eq!(next_text(&mut bob).await, "said in JavaScript");
    bob.send(Message::text("bob, to JavaScript")).await.unwrap();
    assert_eq!(next_text(&mut bob).await, "bob, to JavaScript");
    assert_eq!(next_text(&mut ann).await, "bob, to JavaScript");
    drop(bob);
    connections_become(&node, "rooms", "den", 1).await;

    rewrite(guests::CHAT_PY, "said in Python").await;
    assert_eq!(next_text(&mut ann).await, "said in Python");
    // A frame of the client connected since Rust reaches the Python room.
    ann.send(Message::text("ann, to Python")).await.unwrap();
    assert_eq!(next_text(&mut ann).await, "ann, to Python");
    // A client of the Python room gets the history Rust and JavaScript kept.
    let mut cid = connect(&server, "rooms", "den").await;
    for said in [
        "said in Rust",
        "said in JavaScript",
        "bob, to JavaScript",
        "said in Python",
        "ann, to Python",
    ] {
        assert_eq!(next_text(&mut cid).await, said);
    }
    drop(cid);
    connections_become(&node, "rooms", "den", 1).await;

    rewrite(guests::CHAT, "said in Rust again").await;
    assert_eq!(next_text(&mut ann).await, "said in Rust again");
    assert_eq!(
        call_text(&node, "rooms", "den", "history").await,
        "said in Rust\nsaid in JavaScript\nbob, to JavaScript\nsaid in Python\n\
         ann, to Python\nsaid in Rust again"
    );
}

/// `send-binary` from Python and JavaScript (the chat rooms send only
/// text): the probes `probe-py` and `probe-js` echo each frame as the Rust
/// `probe` does, a text frame as text and a binary frame as binary, byte
/// for byte (every byte value, and bytes that are no UTF-8); a client's
/// close detaches its connection, and the keys serve calls on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_and_javascript_keys_send_binary_frames_as_a_rust_key_does() {
    let modules = [
        ("probe", guests::PROBE),
        ("probe-py", guests::PROBE_PY),
        ("probe-js", guests::PROBE_JS),
    ];
    let (node, server) = node(&modules).await;
    let data: Vec<u8> = (0..=255).chain([0xc3, 0x28, 0xff]).collect();
    for (module, _) in modules {
        let mut client = connect(&server, module, "echo").await;
        client.send(Message::text("héllo ✓")).await.unwrap();
        assert_eq!(
            next_data(&mut client).await,
            Message::text("héllo ✓"),
            "{module}"
        );
        client.send(Message::binary(data.clone())).await.unwrap();
        assert_eq!(
            next_data(&mut client).await,
            Message::binary(data.clone()),
            "{module}"
        );
        client.send(Message::binary(Vec::new())).await.unwrap();
        assert_eq!(
            next_data(&mut client).await,
            Message::binary(Vec::new()),
            "{module}"
        );
        client.close(None).await.unwrap();
        assert_eq!(
            call_text(&node, module, "echo", "ping").await,
            "pong",
            "{module}"
        );
    }
    eventually(PATIENCE, "no connection is left attached", || {
        node.status().attached_connections == 0
    })
    .await;
}

/// A Python or JavaScript key that does not handle connections (its
/// `Key` keeps the default `handle_connection` / `handleConnection`)
/// closes each connection as it opens, with 1000 and "this key takes no
/// WebSocket connections", as a Rust key does: the modules are
/// connectable (build-guest.sh exports the SDK's `connection-handler`),
/// not refused with 409. The keys serve on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn python_and_javascript_keys_without_a_handler_close_connections() {
    let modules = [
        ("counter", guests::COUNTER),
        ("counter-py", guests::COUNTER_PY),
        ("counter-js", guests::COUNTER_JS),
    ];
    let (node, server) = node(&modules).await;
    for (module, _) in modules {
        let mut client = connect(&server, module, "c").await;
        let close = next_close(&mut client).await.expect("a close frame");
        assert_eq!(u16::from(close.code), 1000, "{module}: {close:?}");
        assert_eq!(
            close.reason.as_str(),
            "this key takes no WebSocket connections",
            "{module}"
        );
        assert_eq!(call_text(&node, module, "c", "incr").await, "1", "{module}");
    }
    eventually(PATIENCE, "no connection is left attached", || {
        node.status().attached_connections == 0
    })
    .await;
}
