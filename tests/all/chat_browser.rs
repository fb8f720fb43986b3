//! The `chat` example in real browsers (issue 21 item 3): two headless
//! Chromium sessions (Debian's `chromium`, driven over WebDriver by
//! `chromedriver` with the `fantoccini` client) open the example's page
//! (`examples/chat/web/index.html`, as a `file://` URL) against a 3-node
//! cluster of real `fief` processes on PostgreSQL, each connected to a node
//! that does *not* own the room, so every frame crosses to the owner and
//! back. The two people type into the page and press Send or Enter; in the
//! middle of the conversation the room's owner leaves gracefully (`fief
//! leave`) while both keep typing; they talk on after it is gone. Then:
//!
//! - each page shows every message sent exactly once, and both show the
//!   same order: the turn-by-turn parts before and after the leave in the
//!   order they were said, and each person's messages in the order typed;
//! - neither page reconnected: its socket opened once and never closed
//!   (the page counts both in its DOM and never reconnects on its own);
//! - the owner left cleanly (the CLI succeeded, the process exited 0) and
//!   the room's two connections are attached to its new owner;
//! - a third page that connects at the end gets the room's whole history
//!   (kept in the key's storage, which moved with it), the same list.
//!
//! Screenshots of both pages before the leave and at the end go to
//! `target/chat-screenshots/`. Every wait polls with a generous deadline;
//! nothing asserts a speed. It fails, rather than skips, without `chromium`
//! and `chromedriver` on the `PATH` (`./scripts/test.sh` installs both), or
//! without PostgreSQL. It takes the process tests' lock
//! (`processes::SERIAL`).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use fantoccini::key::Key;
use fantoccini::{Client, Locator};
use fief::core::PartitionCount;
use fief_tests::multiprocess::{
    ClusterNode, NodeSpec, PG_ADDR, arbiter_url, drop_namespace, test_database, unique_namespace,
};
use fief_tests::{guests, workspace_root};

use crate::browser::Driver;
use crate::processes::{SERIAL, start_nodes, wait_settled};

/// The room the two talk in (a key of the `chat` module).
const ROOM: &str = "lobby";
/// How long a page may take to show what the test waits for: a move,
/// several lease TTLs (5 s), plus a loaded CI machine.
const PAGE_LIMIT: Duration = Duration::from_secs(60);
/// How many of each node's log lines about the room (and warnings) a
/// failure report shows.
const LOG_LINES: usize = 40;
/// Pause between two messages one person types while the owner leaves.
const PACE: Duration = Duration::from_millis(100);
/// At most this many messages per person while the owner leaves (the room
/// keeps 100; the newcomer must get them all).
const MAX_DURING: usize = 30;

/// How a person sends what they typed.
#[derive(Clone, Copy, Debug)]
enum Submit {
    /// Clicks the Send button.
    Click,
    /// Presses Enter in the text field.
    Enter,
}

/// One person's chat page, in its own browser.
struct Page {
    name: &'static str,
    /// The node its page is connected to.
    node_id: String,
    submit: Submit,
    client: Client,
}

/// What a page shows, read from its DOM.
#[derive(Debug, Default, Clone)]
struct Shown {
    /// `connecting`, `open` or `closed`.
    state: String,
    /// The state line as shown (with the close code and reason, if closed).
    label: String,
    /// How often its socket opened, and closed.
    opens: u64,
    closes: u64,
    /// How many messages the page sent.
    sent: u64,
    /// The message list's items' texts, top to bottom.
    messages: Vec<String>,
}

impl Page {
    /// Open the page for `name`, connected to `node`'s HTTP API.
    async fn open(driver: &Driver, name: &'static str, node: &ClusterNode, submit: Submit) -> Page {
        let file = workspace_root().join("examples/chat/web/index.html");
        assert!(file.exists(), "{} is missing", file.display());
        let mut url = reqwest::Url::from_file_path(&file).expect("an absolute path");
        url.query_pairs_mut()
            .append_pair("node", &node.url.replacen("http://", "ws://", 1))
            .append_pair("room", ROOM)
            .append_pair("name", name);
        let client = driver.session_sized(900, 1000).await;
        client
            .goto(url.as_str())
            .await
            .unwrap_or_else(|e| panic!("loading {url} for {name}: {e}"));
        Page {
            name,
            node_id: node.node_id.clone(),
            submit,
            client,
        }
    }

    async fn shown(&self) -> Shown {
        let value = self
            .client
            .execute(
                r##"
                const b = document.body.dataset;
                return {
                  state: b.state || "",
                  label: document.getElementById("state").textContent +
                         (b.closedAt ? ` (at ${b.closedAt})` : ""),
                  opens: Number(b.opens || 0),
                  closes: Number(b.closes || 0),
                  sent: Number(b.sent || 0),
                  messages: Array.from(document.querySelectorAll("#messages li.message"),
                                       (li) => li.textContent),
                };
                "##,
                vec![],
            )
            .await
            .unwrap_or_else(|e| panic!("reading {}'s page: {e}", self.name));
        Shown {
            state: value["state"].as_str().unwrap_or_default().to_owned(),
            label: value["label"].as_str().unwrap_or_default().to_owned(),
            opens: value["opens"].as_u64().unwrap_or(0),
            closes: value["closes"].as_u64().unwrap_or(0),
            sent: value["sent"].as_u64().unwrap_or(0),
            messages: value["messages"]
                .as_array()
                .map(|items| {
                    items
                        .iter()
                        .map(|m| m.as_str().unwrap_or_default().to_owned())
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// Type `text` into the page and send it; returns the frame the page
    /// sends (`name: text`).
    async fn say(&self, text: &str) -> String {
        let typed = async {
            let field = self.client.find(Locator::Css("#text")).await?;
            field.send_keys(text).await?;
            match self.submit {
                Submit::Enter => field.send_keys(&Key::Enter.to_string()).await,
                Submit::Click => self.client.find(Locator::Css("#send")).await?.click().await,
            }
        };
        if let Err(e) = typed.await {
            panic!(
                "{} could not type {text:?} ({e}); the page shows {:#?}",
                self.name,
                self.shown().await
            );
        }
        format!("{}: {text}", self.name)
    }

    async fn screenshot(&self, name: &str) -> PathBuf {
        let dir = workspace_root().join("target").join("chat-screenshots");
        std::fs::create_dir_all(&dir).expect("creating the screenshot directory");
        let png = self.client.screenshot().await.expect("a screenshot");
        let path = dir.join(name);
        std::fs::write(&path, png).expect("writing the screenshot");
        path
    }
}

/// Poll `pages` until `check` passes on each (at most [`PAGE_LIMIT`]); what
/// they show then. On the deadline, panic with each page's last complaint
/// and what it shows, and what `nodes` report.
async fn wait_pages(
    pages: &[&Page],
    nodes: &[&ClusterNode],
    what: &str,
    check: impl Fn(&Shown) -> Result<(), String>,
) -> Vec<Shown> {
    let deadline = Instant::now() + PAGE_LIMIT;
    loop {
        let mut shown = Vec::new();
        let mut complaints = Vec::new();
        for page in pages {
            let now = page.shown().await;
            if let Err(why) = check(&now) {
                complaints.push(format!("- {}'s page: {why}", page.name));
            }
            shown.push(now);
        }
        if complaints.is_empty() {
            return shown;
        }
        if Instant::now() >= deadline {
            let mut report = format!(
                "the pages did not show {what} within {PAGE_LIMIT:?}:\n{}\n",
                complaints.join("\n")
            );
            for (page, now) in pages.iter().zip(&shown) {
                report += &format!(
                    "{}'s page (connected to {}) shows {now:#?}\n",
                    page.name, page.node_id
                );
            }
            report += &cluster_report(nodes).await;
            for page in pages {
                let path = page.screenshot(&format!("failed-{}.png", page.name)).await;
                report += &format!("screenshot: {}\n", path.display());
            }
            panic!("{report}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What `nodes` say of themselves and of the room, for a failure message.
async fn cluster_report(nodes: &[&ClusterNode]) -> String {
    let mut report = String::new();
    for node in nodes {
        let status = node.status().await.unwrap_or_default();
        let fields: Vec<String> = [
            "lease",
            "epoch",
            "fences",
            "partitions_owned",
            "partitions_moving",
            "live_keys",
            "sockets",
            "attached_connections",
        ]
        .iter()
        .map(|f| format!("{f}={}", status[*f]))
        .collect();
        report += &format!("{} ({}): {}\n", node.node_id, node.url, fields.join(" "));
        for message in ["connections", "history"] {
            let answer = node
                .call_within("chat", ROOM, message, Duration::from_secs(2))
                .await;
            report += &format!(
                "  chat/{ROOM} {message:?} via {}: {answer:?}\n",
                node.node_id
            );
        }
        report += &format!("  log: {}\n", node.log.display());
        // What the node said of the room and of its lease: CI keeps only
        // the end of a failed run's output, which this report is.
        let log = std::fs::read_to_string(&node.log).unwrap_or_default();
        let said: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(ROOM) || l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        for line in &said[said.len().saturating_sub(LOG_LINES)..] {
            report += &format!("    {line}\n");
        }
    }
    report
}

/// The page is open, its socket opened once and never closed.
fn connected_once(shown: &Shown) -> Result<(), String> {
    if shown.state == "open" && shown.opens == 1 && shown.closes == 0 {
        Ok(())
    } else {
        Err(format!(
            "expected one open socket and no close; state {:?} ({}), opened {}, closed {}",
            shown.state, shown.label, shown.opens, shown.closes
        ))
    }
}

/// `messages` holds each of `expected` exactly once and nothing else.
fn each_once(messages: &[String], expected: &[String]) -> Result<(), String> {
    let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
    for m in expected {
        *counts.entry(m).or_default() += 1;
    }
    for m in messages {
        *counts.entry(m).or_default() -= 1;
    }
    let missing: Vec<&str> = counts
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(m, _)| *m)
        .collect();
    let extra: Vec<&str> = counts
        .iter()
        .filter(|(_, n)| **n < 0)
        .map(|(m, _)| *m)
        .collect();
    if missing.is_empty() && extra.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} of {} messages shown; missing {missing:?}; duplicated or unexpected {extra:?}",
            messages.len(),
            expected.len()
        ))
    }
}

/// Connected once, and the list is exactly `expected`, in that order.
fn shows_exactly(expected: &[String]) -> impl Fn(&Shown) -> Result<(), String> + '_ {
    move |shown| {
        connected_once(shown)?;
        if shown.messages == expected {
            Ok(())
        } else {
            Err(format!("the list is not {expected:#?}"))
        }
    }
}

/// The owner of `key`'s partition per the arbiter.
async fn owner_of(db: &tokio_postgres::Client, namespace: &str, key: &str) -> String {
    let partition = i32::try_from(PartitionCount::default().of(key).0).expect("a partition id");
    db.query_one(
        "SELECT node_id FROM fief_partitions WHERE namespace = $1 AND partition = $2",
        &[&namespace, &partition],
    )
    .await
    .expect("reading fief_partitions")
    .get::<_, Option<String>>(0)
    .unwrap_or_else(|| panic!("{key}'s partition has no owner"))
}

/// Ask the room, through `via`, until it answers `want` (at most
/// [`PAGE_LIMIT`]); returns its last answer.
async fn room_answers(via: &ClusterNode, message: &str, want: &str) -> String {
    let deadline = Instant::now() + PAGE_LIMIT;
    loop {
        let answer = via.call_settled("chat", ROOM, message).await;
        if answer.as_deref() == Ok(want) {
            return want.to_owned();
        }
        assert!(
            Instant::now() < deadline,
            "chat/{ROOM} {message:?} via {} answered {answer:?}, not {want:?}, for {PAGE_LIMIT:?}",
            via.node_id
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A conversation in turns: each line is said once the one before it is
/// on both pages, so both must show them in exactly this order.
async fn take_turns(
    pages: &[&Page; 2],
    nodes: &[&ClusterNode],
    lines: &[(usize, &str)],
    said: &mut Vec<String>,
) {
    for (who, text) in lines {
        said.push(pages[*who].say(text).await);
        let what = "the conversation so far, in order";
        wait_pages(pages, nodes, what, shows_exactly(said)).await;
    }
}

/// One person typing while the owner leaves, until `done` (at least three
/// messages, at most [`MAX_DURING`]); the frames their page sent, and when
/// each was sent.
async fn keep_typing(page: &Page, done: &AtomicBool) -> (Vec<String>, Vec<Instant>) {
    let (mut said, mut at) = (Vec::new(), Vec::new());
    while said.len() < MAX_DURING && (said.len() < 3 || !done.load(Ordering::SeqCst)) {
        said.push(
            page.say(&format!("while it moves #{}", said.len() + 1))
                .await,
        );
        at.push(Instant::now());
        tokio::time::sleep(PACE).await;
    }
    (said, at)
}

/// When each message typed while the owner left was sent, against the
/// leave (`began`, at wall-clock `began_wall`) and the owner's exit
/// (`ended`), in milliseconds and UTC (to match the nodes' logs).
fn timeline(
    typed: &[(&[String], &[Instant])],
    began: Instant,
    began_wall: SystemTime,
    ended: Instant,
) -> String {
    let wall = |at: Instant| {
        let t = if at >= began {
            began_wall + (at - began)
        } else {
            began_wall - (began - at)
        };
        humantime::format_rfc3339_millis(t).to_string()
    };
    let offset = |at: Instant| {
        if at >= began {
            format!("+{}", (at - began).as_millis())
        } else {
            format!("-{}", (began - at).as_millis())
        }
    };
    let mut events: Vec<(Instant, String)> = vec![
        (began, "`fief leave` began".to_owned()),
        (ended, "the owner exited".to_owned()),
    ];
    for (said, at) in typed {
        for (m, t) in said.iter().zip(*at) {
            events.push((*t, format!("sent {m:?}")));
        }
    }
    events.sort_by_key(|(t, _)| *t);
    events
        .iter()
        .map(|(t, what)| format!("  {:>6} ms  {}  {what}", offset(*t), wall(*t)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// How many of `times` fall before `began`, between it and `ended`, and
/// after `ended`.
fn split(times: &[Instant], began: Instant, ended: Instant) -> [usize; 3] {
    let before = times.iter().filter(|t| **t < began).count();
    let after = times.iter().filter(|t| **t > ended).count();
    [before, times.len() - before - after, after]
}

/// Issue 21 item 3 ("a browser test: two pages chat through a room on a
/// 3-node cluster; the room's owner leaves mid-conversation; every message
/// once, in order, no reconnect; screenshots").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_browsers_chat_through_a_room_whose_owner_leaves() {
    let _serial = SERIAL.lock().await;
    let started = Instant::now();
    let db = test_database().await;
    let namespace = unique_namespace("chat-browser");
    let specs: Vec<NodeSpec> = (1..=3)
        .map(|i| NodeSpec {
            node_id: format!("n{i}"),
            namespace: namespace.clone(),
            arbiter: arbiter_url(PG_ADDR),
            deploy: vec![("chat".to_owned(), guests::CHAT.to_owned())],
            // The default lease timings (5 s TTL, renewed every second), not
            // the fast ones: nothing here waits for an expiry, and on a
            // loaded machine a 2 s lease can run out (a slow arbiter) and
            // fence a node, whose sockets then close with 1012, as they
            // should, which is not what this test is about.
            extra_args: Vec::new(),
        })
        .collect();
    let mut nodes = start_nodes(&specs).await;
    let owner_id = owner_of(&db, &namespace, ROOM).await;
    let o = nodes
        .iter()
        .position(|n| n.node_id == owner_id)
        .expect("the room's owner is one of ours");
    let mut owner = nodes.remove(o);
    let stayers = nodes;
    let cluster_ready = started.elapsed();

    // Each person on a node that does not own the room.
    let driver = Driver::start("chat browser");
    let ann = Page::open(&driver, "ann", &stayers[0], Submit::Click).await;
    let bob = Page::open(&driver, "bob", &stayers[1], Submit::Enter).await;
    let pages = [&ann, &bob];
    wait_pages(
        &pages,
        &[&stayers[0], &stayers[1], &owner],
        "an open socket",
        connected_once,
    )
    .await;
    // Both connections attached at the owner before anyone speaks (else
    // one could miss the first message, or get it as history: still once,
    // but not the point here).
    room_answers(&owner, "connections", "2").await;

    let mut said = Vec::new();
    let o = owner_id.as_str();
    let (a, b) = (stayers[0].node_id.as_str(), stayers[1].node_id.as_str());
    take_turns(
        &pages,
        &[&stayers[0], &stayers[1], &owner],
        &[
            (0, &format!("hi bob, I am on {a}")),
            (1, &format!("hi ann, I am on {b}")),
            (0, &format!("our room lives on {o}")),
            (1, &format!("{o} is about to leave the cluster")),
            (0, "let's keep talking while it does"),
        ],
        &mut said,
    )
    .await;
    let before = said.len();
    let mut screenshots = vec![
        ann.screenshot("1-ann-before-leave.png").await,
        bob.screenshot("1-bob-before-leave.png").await,
    ];

    // The owner leaves while both type.
    let done = AtomicBool::new(false);
    let leave = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (began, began_wall) = (Instant::now(), SystemTime::now());
        owner.leave_and_exit(Duration::from_secs(15)).await;
        let ended = Instant::now();
        // Typing goes on a while with the owner gone.
        tokio::time::sleep(Duration::from_secs(1)).await;
        done.store(true, Ordering::SeqCst);
        (began, began_wall, ended)
    };
    let ((began, began_wall, ended), (ann_during, ann_at), (bob_during, bob_at)) =
        tokio::join!(leave, keep_typing(&ann, &done), keep_typing(&bob, &done));
    let log = owner.log_text();
    assert!(
        log.contains("partitions handed off") && log.contains("left the cluster"),
        "{owner_id}'s log shows no handoff and leave:\n{}",
        owner.log_tail(30)
    );
    said.extend(ann_during.iter().cloned());
    said.extend(bob_during.iter().cloned());
    let remaining = [&stayers[0], &stayers[1]];
    let what = format!(
        "every message said while the owner left, once; they were sent:\n{}\n",
        timeline(
            &[(&ann_during, &ann_at), (&bob_during, &bob_at)],
            began,
            began_wall,
            ended
        )
    );
    wait_pages(&pages, &remaining, &what, |s| {
        connected_once(s)?;
        each_once(&s.messages, &said)
    })
    .await;
    wait_settled(&stayers).await;
    let new_owner = owner_of(&db, &namespace, ROOM).await;
    assert!(
        stayers.iter().any(|n| n.node_id == new_owner),
        "the room's partition is on {new_owner}, not a remaining node"
    );
    // Both connections followed the room to its new owner.
    room_answers(&stayers[0], "connections", "2").await;

    // The order so far, as ann's page shows it; bob's must be the same.
    let mut order = ann.shown().await.messages;
    take_turns(
        &pages,
        &remaining,
        &[
            (1, &format!("{o} is gone and we are still here")),
            (0, &format!("the room moved to {new_owner}")),
            (1, "and neither of us reconnected"),
            (0, "bye!"),
        ],
        &mut order,
    )
    .await;
    let after = order.len() - said.len();
    said.extend(order[order.len() - after..].iter().cloned());
    screenshots.push(ann.screenshot("2-ann-after-leave.png").await);
    screenshots.push(bob.screenshot("2-bob-after-leave.png").await);

    // Nothing more arrives late (a duplicate, say).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ann_end = ann.shown().await;
    let bob_end = bob.shown().await;
    for (page, end, typed) in [(&ann, &ann_end, &ann_during), (&bob, &bob_end, &bob_during)] {
        connected_once(end).unwrap_or_else(|e| panic!("{}: {e}", page.name));
        each_once(&end.messages, &said).unwrap_or_else(|e| panic!("{}'s page: {e}", page.name));
        assert_eq!(
            end.messages, order,
            "{}'s page shows another order than ann's",
            page.name
        );
        // Each person's messages in the order typed.
        let theirs: Vec<&String> = end.messages.iter().filter(|m| typed.contains(m)).collect();
        assert_eq!(
            theirs,
            typed.iter().collect::<Vec<_>>(),
            "{}'s messages while the owner left are out of order",
            page.name
        );
        let expected_sent = said
            .iter()
            .filter(|m| m.starts_with(&format!("{}: ", page.name)))
            .count() as u64;
        assert_eq!(end.sent, expected_sent, "{}'s page sent count", page.name);
    }
    assert_eq!(
        &order[..before],
        &said[..before],
        "the turns before the leave"
    );

    // A newcomer gets the room's whole history: the same list.
    assert!(order.len() <= 100, "more messages than the room keeps");
    let cid = Page::open(&driver, "cid", &stayers[1], Submit::Enter).await;
    let what = "the room's history";
    wait_pages(&[&cid], &remaining, what, shows_exactly(&order)).await;

    eprintln!(
        "chat browser test: {owner_id} owned {ROOM} and left (fief leave to exit {:?}); ann on \
         {a}, bob on {b}; {} messages ({before} in turns before; while typing freely, ann sent \
         {:?} and bob {:?} [before the leave began, between it and the owner's exit, after]; \
         {after} in turns after), each once and in one order on both pages, no reconnect; room \
         now on {new_owner}; cluster up in {cluster_ready:?}, whole test {:?}",
        ended - began,
        order.len(),
        split(&ann_at, began, ended),
        split(&bob_at, began, ended),
        started.elapsed()
    );
    eprintln!("chat screenshots:");
    for path in &screenshots {
        eprintln!("  {}", path.display());
    }
    for page in [ann, bob, cid] {
        page.client
            .close()
            .await
            .expect("closing the browser session");
    }
    drop(owner);
    drop(stayers);
    drop_namespace(&db, &namespace).await;
}
