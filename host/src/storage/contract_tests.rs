//! The contract of `crate::storage` as tests, one generic async function
//! per rule, each run against every backend: embedded in memory, embedded
//! on a file, and PostgreSQL on 127.0.0.1:5432 (user `postgres`, database
//! `fief_test`, a fresh namespace per test). PostgreSQL must be running:
//! its tests fail with a clear message rather than skip. It owns these
//! tests only; it must not hold backend code.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{
    Backend, Commit, EmbeddedBackend, Fence, KeyScope, Load, Loaded, Outcome, PostgresBackend,
    Round, Write,
};

mod alarms;
use alarms::*;

/// The database the PostgreSQL tests use (created if missing).
const TEST_DATABASE: &str = "fief_test";

/// A name unique to this test run and call.
fn unique(what: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    format!(
        "{what}-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A backend under test, and the directory to remove after it.
struct Subject {
    backend: Box<dyn Backend>,
    dir: Option<PathBuf>,
}

impl Drop for Subject {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn temp_dir() -> PathBuf {
    std::env::temp_dir().join(unique("fief-storage"))
}

async fn in_memory() -> Subject {
    Subject {
        backend: Box::new(EmbeddedBackend::in_memory().expect("an in-memory store")),
        dir: None,
    }
}

async fn on_file() -> Subject {
    let dir = temp_dir();
    let backend = EmbeddedBackend::open(&dir.join("state.redb")).expect("opening the store");
    Subject {
        backend: Box::new(backend),
        dir: Some(dir),
    }
}

fn pg_url(dbname: &str) -> String {
    format!("postgres://postgres@127.0.0.1:5432/{dbname}")
}

/// The test database exists (created on first use); panics with a clear
/// message when PostgreSQL cannot be reached.
async fn test_database() {
    static CREATED: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();
    CREATED
        .get_or_init(|| async {
            let (admin, connection) =
                tokio_postgres::connect(&pg_url("postgres"), tokio_postgres::NoTls)
                    .await
                    .unwrap_or_else(|e| {
                        panic!(
                            "PostgreSQL is not reachable at 127.0.0.1:5432 as user postgres ({e}); \
                         the storage contract tests need it running (trust auth); CI starts it"
                        )
                    });
            tokio::spawn(connection);
            if let Err(e) = admin
                .batch_execute(&format!("CREATE DATABASE {TEST_DATABASE}"))
                .await
            {
                // 42P04 duplicate_database; 23505 when two creates race.
                let code = e.as_db_error().map(|d| d.code().code().to_owned());
                assert!(
                    matches!(code.as_deref(), Some("42P04" | "23505")),
                    "creating the database {TEST_DATABASE}: {e:?}"
                );
            }
        })
        .await;
}

async fn postgres_on(namespace: &str) -> PostgresBackend {
    test_database().await;
    PostgresBackend::connect(&pg_url(TEST_DATABASE), namespace)
        .await
        .unwrap_or_else(|e| panic!("connecting the storage to PostgreSQL: {e}"))
}

async fn postgres() -> Subject {
    Subject {
        backend: Box::new(postgres_on(&unique("contract")).await),
        dir: None,
    }
}

fn scope(module: &str, key: &str) -> KeyScope {
    KeyScope {
        module: module.to_owned(),
        key: key.to_owned(),
    }
}

fn fence(partition: u32, token: u64) -> Fence {
    Fence { partition, token }
}

fn put(name: &str, value: &[u8]) -> Write {
    Write::Put {
        name: name.to_owned(),
        value: value.to_vec(),
    }
}

fn delete(name: &str) -> Write {
    Write::Delete {
        name: name.to_owned(),
    }
}

fn delete_range(start: &str, end: Option<&str>) -> Write {
    Write::DeleteRange {
        start: start.to_owned(),
        end: end.map(str::to_owned),
    }
}

fn commit(scope: &KeyScope, fence: Fence, writes: Vec<Write>, bytes_delta: i64) -> Commit {
    Commit {
        scope: scope.clone(),
        fence,
        writes,
        bytes_delta,
    }
}

fn entries(pairs: &[(&str, &[u8])]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v.to_vec()))
        .collect()
}

/// Run `round`, which must land.
async fn round(b: &dyn Backend, commits: Vec<Commit>, loads: Vec<Load>) -> super::RoundResult {
    let round = Round {
        commits,
        loads,
        ..Round::default()
    };
    b.round(round).await.expect("the round lands")
}

/// Load one key alone.
async fn load(b: &dyn Backend, scope: &KeyScope, fence: Fence) -> Outcome<Loaded> {
    let load = Load {
        scope: scope.clone(),
        fence,
    };
    round(b, vec![], vec![load]).await.loads.remove(0)
}

/// Load one key alone, which must be served: its entries.
async fn entries_of(b: &dyn Backend, scope: &KeyScope, fence: Fence) -> Vec<(String, Vec<u8>)> {
    match load(b, scope, fence).await {
        Outcome::Done(loaded) => loaded.entries,
        stale => panic!("the load of {scope:?} was refused: {stale:?}"),
    }
}

/// Land one commit alone: its outcome.
async fn commit_one(b: &dyn Backend, commit: Commit) -> Outcome<u64> {
    round(b, vec![commit], vec![]).await.commits.remove(0)
}

// ---------------------------------------------------------------------------
// The rules.

async fn put_then_get_round_trips(b: &dyn Backend) {
    let s = scope("acme/counter", "k1");
    assert_eq!(entries_of(b, &s, fence(1, 1)).await, vec![]);
    let c = commit(&s, fence(1, 1), vec![put("a", b"1"), put("b", b"22")], 5);
    assert_eq!(commit_one(b, c).await, Outcome::Done(5));
    assert_eq!(
        entries_of(b, &s, fence(1, 1)).await,
        entries(&[("a", b"1"), ("b", b"22")])
    );
    let c = commit(&s, fence(1, 1), vec![put("a", b"")], -1);
    assert_eq!(commit_one(b, c).await, Outcome::Done(4));
    assert_eq!(
        entries_of(b, &s, fence(1, 1)).await,
        entries(&[("a", b""), ("b", b"22")])
    );
}

async fn delete_removes_one_name(b: &dyn Backend) {
    let s = scope("acme/counter", "k1");
    load(b, &s, fence(0, 1)).await;
    let c = commit(&s, fence(0, 1), vec![put("a", b"1"), put("b", b"2")], 4);
    commit_one(b, c).await;
    let c = commit(&s, fence(0, 1), vec![delete("a"), delete("absent")], -2);
    assert_eq!(commit_one(b, c).await, Outcome::Done(2));
    assert_eq!(
        entries_of(b, &s, fence(0, 1)).await,
        entries(&[("b", b"2")])
    );
}

async fn delete_range_with_and_without_end(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    // Keys that sort right after `k` must survive a range without end.
    let neighbours = [
        scope("acme/m", "k/x"),
        scope("acme/m", "kk"),
        scope("acme/n", "k"),
    ];
    load(b, &s, fence(3, 1)).await;
    let names = ["a", "b", "c", "d", "e"].map(|n| put(n, n.as_bytes()));
    let mut commits = vec![commit(&s, fence(3, 1), names.to_vec(), 10)];
    for n in &neighbours {
        commits.push(commit(n, fence(3, 1), vec![put("z", b"z")], 2));
    }
    round(b, commits, vec![]).await;
    let c = commit(&s, fence(3, 1), vec![delete_range("b", Some("d"))], -4);
    commit_one(b, c).await;
    assert_eq!(
        entries_of(b, &s, fence(3, 1)).await,
        entries(&[("a", b"a"), ("d", b"d"), ("e", b"e")])
    );
    let c = commit(&s, fence(3, 1), vec![delete_range("d", None)], -4);
    commit_one(b, c).await;
    assert_eq!(
        entries_of(b, &s, fence(3, 1)).await,
        entries(&[("a", b"a")])
    );
    // An empty or inverted range removes nothing.
    let c = commit(&s, fence(3, 1), vec![delete_range("z", Some("a"))], 0);
    commit_one(b, c).await;
    assert_eq!(
        entries_of(b, &s, fence(3, 1)).await,
        entries(&[("a", b"a")])
    );
    for n in &neighbours {
        assert_eq!(
            entries_of(b, n, fence(3, 1)).await,
            entries(&[("z", b"z")]),
            "{n:?}"
        );
    }
}

async fn writes_of_a_commit_apply_in_order(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(2, 7)).await;
    commit_one(b, commit(&s, fence(2, 7), vec![put("d", b"old")], 4)).await;
    let writes = vec![
        put("a", b"1"),
        delete("a"),
        put("a", b"2"),
        put("b", b"1"),
        delete_range("b", None),
        put("c", b"3"),
        put("e", b"4"),
        delete("e"),
    ];
    commit_one(b, commit(&s, fence(2, 7), writes, 0)).await;
    assert_eq!(
        entries_of(b, &s, fence(2, 7)).await,
        entries(&[("a", b"2"), ("c", b"3")])
    );
}

async fn commits_of_one_key_in_one_round_apply_in_order(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(2, 7)).await;
    commit_one(b, commit(&s, fence(2, 7), vec![put("c", b"old")], 4)).await;
    let commits = vec![
        commit(&s, fence(2, 7), vec![put("a", b"1"), put("b", b"1")], 4),
        commit(&s, fence(2, 7), vec![delete("a"), put("b", b"2")], -2),
        commit(
            &s,
            fence(2, 7),
            vec![put("a", b"3"), delete_range("b", Some("d"))],
            -2,
        ),
        commit(&s, fence(2, 7), vec![put("b", b"4")], 2),
    ];
    let result = round(b, commits, vec![]).await;
    let done = [8, 6, 4, 6].map(Outcome::Done).to_vec();
    assert_eq!(result.commits, done);
    assert_eq!(
        entries_of(b, &s, fence(2, 7)).await,
        entries(&[("a", b"3"), ("b", b"4")])
    );
}

async fn a_load_sees_the_commits_of_its_round(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(4, 2)).await;
    let c = commit(&s, fence(4, 2), vec![put("a", b"1")], 2);
    let l = Load {
        scope: s.clone(),
        fence: fence(4, 3),
    };
    let result = round(b, vec![c], vec![l]).await;
    assert_eq!(result.commits, vec![Outcome::Done(2)]);
    let loaded = Loaded {
        entries: entries(&[("a", b"1")]),
        alarms: vec![],
        tenant_bytes: 2,
    };
    assert_eq!(result.loads, vec![Outcome::Done(loaded)]);
}

async fn a_stale_commit_writes_nothing_while_others_land(b: &dyn Backend) {
    let (s1, s2) = (scope("acme/m", "one"), scope("acme/m", "two"));
    load(b, &s1, fence(1, 2)).await;
    load(b, &s2, fence(2, 1)).await;
    let commits = vec![
        commit(&s2, fence(2, 1), vec![put("a", b"1")], 2),
        commit(
            &s1,
            fence(1, 1),
            vec![put("stale", b"x"), delete_range("", None)],
            100,
        ),
        commit(&s1, fence(1, 2), vec![put("b", b"2")], 2),
        // Never loaded under any token: the fence is 0.
        commit(&s1, fence(9, 5), vec![put("never", b"x")], 100),
    ];
    let result = round(b, commits, vec![]).await;
    assert_eq!(
        result.commits,
        vec![
            Outcome::Done(2),
            Outcome::Stale { current: 2 },
            Outcome::Done(4),
            Outcome::Stale { current: 0 },
        ]
    );
    assert_eq!(
        entries_of(b, &s1, fence(1, 2)).await,
        entries(&[("b", b"2")])
    );
    assert_eq!(
        entries_of(b, &s2, fence(2, 1)).await,
        entries(&[("a", b"1")])
    );
    let Outcome::Done(loaded) = load(b, &s1, fence(1, 2)).await else {
        panic!("refused")
    };
    assert_eq!(
        loaded.tenant_bytes, 4,
        "a stale commit's bytes are not counted"
    );
}

async fn a_higher_token_load_fences_older_commits(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(5, 1)).await;
    commit_one(b, commit(&s, fence(5, 1), vec![put("a", b"old owner")], 1)).await;
    // A new owner loads under token 2: the old owner's commits are refused.
    assert_eq!(
        entries_of(b, &s, fence(5, 2)).await,
        entries(&[("a", b"old owner")])
    );
    let c = commit(&s, fence(5, 1), vec![put("a", b"late")], 0);
    assert_eq!(commit_one(b, c).await, Outcome::Stale { current: 2 });
    let c = commit(&s, fence(5, 2), vec![put("a", b"new owner")], 0);
    assert_eq!(commit_one(b, c).await, Outcome::Done(1));
    assert_eq!(
        entries_of(b, &s, fence(5, 2)).await,
        entries(&[("a", b"new owner")])
    );
    // The fence is per partition: another partition is not fenced.
    load(b, &s, fence(6, 1)).await;
    let c = commit(&s, fence(6, 1), vec![put("b", b"1")], 1);
    assert_eq!(commit_one(b, c).await, Outcome::Done(2));
}

async fn a_lower_token_load_is_stale(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(7, 5)).await;
    assert_eq!(
        load(b, &s, fence(7, 3)).await,
        Outcome::Stale { current: 5 }
    );
    assert!(matches!(load(b, &s, fence(7, 5)).await, Outcome::Done(_)));
    // In one round, loads raise in order: a lower one after a higher one is
    // stale against the raised token.
    let loads = [9, 8, 9].map(|t| Load {
        scope: s.clone(),
        fence: fence(7, t),
    });
    let result = round(b, vec![], loads.to_vec()).await;
    assert!(matches!(result.loads[0], Outcome::Done(_)));
    assert_eq!(result.loads[1], Outcome::Stale { current: 9 });
    assert!(matches!(result.loads[2], Outcome::Done(_)));
}

async fn tenant_usage_follows_bytes_delta(b: &dyn Backend) {
    let (a1, a2) = (scope("acme/one", "k"), scope("acme/two", "k"));
    let (z, none) = (scope("zeta/one", "k"), scope("plain", "k"));
    for s in [&a1, &a2, &z, &none] {
        load(b, s, fence(1, 1)).await;
    }
    let commits = vec![
        commit(&a1, fence(1, 1), vec![put("a", b"123456789")], 10),
        commit(&a2, fence(1, 1), vec![put("b", b"1234")], 5),
        commit(&z, fence(1, 1), vec![put("c", b"123456")], 7),
        commit(&a1, fence(1, 1), vec![delete("a")], -10),
        commit(&none, fence(1, 1), vec![put("d", b"12")], 3),
    ];
    let result = round(b, commits, vec![]).await;
    let done = [10, 15, 7, 5, 3].map(Outcome::Done).to_vec();
    assert_eq!(result.commits, done);
    let c = commit(&a2, fence(1, 1), vec![put("e", b"1")], 2);
    assert_eq!(commit_one(b, c).await, Outcome::Done(7));
    for (s, bytes) in [(&a1, 7), (&a2, 7), (&z, 7), (&none, 3)] {
        let Outcome::Done(loaded) = load(b, s, fence(1, 1)).await else {
            panic!("refused")
        };
        assert_eq!(loaded.tenant_bytes, bytes, "{s:?}");
    }
}

async fn read_by_prefix_with_limit_raises_no_fence(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(8, 3)).await;
    let names = ["a/1", "a/2", "a/3", "a", "b/1", "a\u{10FFFF}", "é/1", "éa"];
    let writes = names.iter().map(|n| put(n, n.as_bytes())).collect();
    commit_one(b, commit(&s, fence(8, 3), writes, 0)).await;
    let read = |prefix: &str, limit| b.read(s.clone(), prefix.to_owned(), limit);
    let names_of = |v: Vec<(String, Vec<u8>)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
    let r = names_of(read("a/", 2).await.expect("read"));
    assert_eq!(r, ["a/1", "a/2"]);
    let r = names_of(read("a", 10).await.expect("read"));
    assert_eq!(r, ["a", "a/1", "a/2", "a/3", "a\u{10FFFF}"]);
    let r = names_of(read("é", 10).await.expect("read"));
    assert_eq!(r, ["é/1", "éa"]);
    assert_eq!(read("", 100).await.expect("read").len(), names.len());
    assert_eq!(read("", 0).await.expect("read"), vec![]);
    assert_eq!(read("c", 10).await.expect("read"), vec![]);
    let other = b.read(scope("acme/m", "other"), String::new(), 10).await;
    assert_eq!(other.expect("read"), vec![]);
    // The read raised no fence: the owner under token 3 still commits, and
    // a partition only read is still at token 0.
    let c = commit(&s, fence(8, 3), vec![put("z", b"1")], 0);
    assert_eq!(commit_one(b, c).await, Outcome::Done(0));
    let c = commit(&s, fence(11, 1), vec![put("z", b"1")], 0);
    b.read(s.clone(), String::new(), 10).await.expect("read");
    assert_eq!(commit_one(b, c).await, Outcome::Stale { current: 0 });
}

async fn names_sort_in_byte_order(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    load(b, &s, fence(0, 1)).await;
    let mut names = vec![
        "b",
        "B",
        "a",
        "A",
        "é",
        "e",
        "E",
        "z",
        "Z",
        "ä",
        "日本",
        "a b",
        "aa",
        "_",
        "~",
        "a-b",
        "ab",
        "Ab",
        "\u{10FFFF}",
        "\u{7f}",
        "\u{80}",
        "1",
        "10",
        "9",
    ];
    let writes = names.iter().map(|n| put(n, b"v")).collect();
    commit_one(b, commit(&s, fence(0, 1), writes, 0)).await;
    names.sort_unstable_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
    let loaded: Vec<String> = entries_of(b, &s, fence(0, 1))
        .await
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(loaded, names);
    let read: Vec<String> = b
        .read(s.clone(), String::new(), 100)
        .await
        .expect("read")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(read, names);
}

async fn scopes_are_isolated(b: &dyn Backend) {
    let scopes = [
        scope("acme/m", "k"),
        scope("acme/m", "k2"),
        scope("acme/n", "k"),
        scope("other/m", "k"),
        scope("acme/m", "K"),
    ];
    for s in &scopes {
        load(b, s, fence(4, 1)).await;
    }
    let commits = scopes
        .iter()
        .map(|s| {
            let v = format!("{}:{}", s.module, s.key);
            commit(s, fence(4, 1), vec![put("n", v.as_bytes())], 1)
        })
        .collect();
    round(b, commits, vec![]).await;
    let wipe = commit(&scopes[0], fence(4, 1), vec![delete_range("", None)], -1);
    commit_one(b, wipe).await;
    assert_eq!(entries_of(b, &scopes[0], fence(4, 1)).await, vec![]);
    for s in &scopes[1..] {
        let v = format!("{}:{}", s.module, s.key);
        assert_eq!(
            entries_of(b, s, fence(4, 1)).await,
            entries(&[("n", v.as_bytes())])
        );
        let read = b.read(s.clone(), "n".into(), 10).await.expect("read");
        assert_eq!(read, entries(&[("n", v.as_bytes())]));
    }
}

async fn the_highest_fence_token_is_the_top_of_every_partition(b: &dyn Backend) {
    let token = || async { b.highest_fence_token().await.expect("the highest token") };
    assert_eq!(token().await, 0, "a new store");
    let s = scope("acme/m", "k");
    load(b, &s, fence(3, 4)).await;
    load(b, &s, fence(9, 11)).await;
    load(b, &s, fence(5, 6)).await;
    assert_eq!(token().await, 11);
    // A stale load raises nothing.
    load(b, &s, fence(9, 2)).await;
    assert_eq!(token().await, 11);
}

/// A load read beside the rounds answers what a round would, or nothing:
/// never when the load would raise the token, and it raises nothing.
async fn a_read_load_answers_as_a_round_would_or_not_at_all(b: &dyn Backend) {
    let s = scope("acme/m", "k");
    let other = scope("acme/m", "other");
    let at = |f: Fence| Load {
        scope: s.clone(),
        fence: f,
    };
    assert_eq!(b.read_load(&at(fence(2, 5))), None, "raising 0 → 5");
    load(b, &s, fence(2, 5)).await;
    let writes = vec![put("a", b"1"), set_alarm("wake", 1_700_000_000_000)];
    commit_one(b, commit(&s, fence(2, 5), writes, 2)).await;
    commit_one(b, commit(&other, fence(2, 5), vec![put("b", b"22")], 3)).await;
    if let Some(read) = b.read_load(&at(fence(2, 5))) {
        let read = read.expect("a read");
        assert_eq!(read, load(b, &s, fence(2, 5)).await);
        let Outcome::Done(loaded) = read else {
            panic!("the owner's read was refused: {read:?}")
        };
        assert_eq!(loaded.entries, entries(&[("a", b"1")]));
        assert_eq!(loaded.tenant_bytes, 5);
    }
    assert_eq!(b.read_load(&at(fence(2, 6))), None, "raising 5 → 6");
    if let Some(read) = b.read_load(&at(fence(2, 4))) {
        assert_eq!(read, Ok(Outcome::Stale { current: 5 }));
    }
    // Nothing was raised: the owner under 5 still commits.
    let landed = commit_one(b, commit(&s, fence(2, 5), vec![put("a", b"2")], 0)).await;
    assert_eq!(landed, Outcome::Done(5));
}

/// Instantiate every rule for one backend, as a module of tests.
macro_rules! rules_for {
    ($kind:ident: $($rule:ident),* $(,)?) => {
        mod $kind {
            $(
                #[tokio::test]
                async fn $rule() {
                    let subject = super::$kind().await;
                    super::$rule(subject.backend.as_ref()).await;
                }
            )*
        }
    };
}

macro_rules! contract {
    ($($kind:ident),*) => {
        $(
            rules_for!($kind:
                put_then_get_round_trips,
                delete_removes_one_name,
                delete_range_with_and_without_end,
                writes_of_a_commit_apply_in_order,
                commits_of_one_key_in_one_round_apply_in_order,
                a_load_sees_the_commits_of_its_round,
                a_stale_commit_writes_nothing_while_others_land,
                a_higher_token_load_fences_older_commits,
                a_lower_token_load_is_stale,
                tenant_usage_follows_bytes_delta,
                read_by_prefix_with_limit_raises_no_fence,
                names_sort_in_byte_order,
                scopes_are_isolated,
                the_highest_fence_token_is_the_top_of_every_partition,
                alarms_land_with_their_commit_and_load_with_their_key,
                a_stale_commit_sets_and_cancels_no_alarm,
                a_partition_alarm_load_sees_the_commits_before_it_and_fences_older_owners,
                a_read_load_answers_as_a_round_would_or_not_at_all,
            );
        )*
    };
}

contract!(in_memory, on_file, postgres);

// ---------------------------------------------------------------------------
// The embedded file.

#[tokio::test]
async fn an_embedded_file_keeps_entries_alarms_and_fences_across_close_and_reopen() {
    let dir = temp_dir();
    let path = dir.join("nested").join("state.redb");
    let s = scope("acme/m", "k");
    {
        let b = EmbeddedBackend::open(&path).expect("opening");
        assert_eq!(b.describe(), format!("embedded {}", path.display()));
        load(&b, &s, fence(3, 4)).await;
        let writes = vec![
            put("a", b"1"),
            put("b", b"2"),
            set_alarm("wake", 1_700_000_000_000),
        ];
        commit_one(&b, commit(&s, fence(3, 4), writes, 6)).await;
    }
    let b = EmbeddedBackend::open(&path).expect("reopening");
    assert_eq!(
        load(&b, &s, fence(3, 3)).await,
        Outcome::Stale { current: 4 }
    );
    let loaded = Loaded {
        entries: entries(&[("a", b"1"), ("b", b"2")]),
        alarms: vec![("wake".to_owned(), 1_700_000_000_000)],
        tenant_bytes: 6,
    };
    assert_eq!(load(&b, &s, fence(3, 4)).await, Outcome::Done(loaded));
    let alarm = stored_alarm(3, &s, "wake", 1_700_000_000_000);
    assert_eq!(
        alarms_of_partition(&b, fence(3, 4)).await,
        Outcome::Done(vec![alarm])
    );
    drop(b);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_second_open_of_a_locked_file_is_a_clear_error() {
    let dir = temp_dir();
    let path = dir.join("state.redb");
    let _first = EmbeddedBackend::open(&path).expect("opening");
    let Err(super::BackendError::Unavailable(e)) = EmbeddedBackend::open(&path) else {
        panic!("a second open of a locked file succeeded")
    };
    assert!(e.contains(&path.display().to_string()), "{e}");
    assert!(e.contains("locked") && e.contains("another process"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_file_that_is_not_redb_is_a_clear_error() {
    let dir = temp_dir();
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join("state.redb");
    std::fs::write(&path, vec![b'x'; 8192]).expect("writing");
    let Err(super::BackendError::Unavailable(e)) = EmbeddedBackend::open(&path) else {
        panic!("a file of garbage opened as a store")
    };
    assert!(e.contains(&path.display().to_string()), "{e}");
    assert!(e.contains("cannot be opened as a redb database"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The embedded store answers loads that change nothing beside the rounds
/// (the rule above holds what it answers).
#[tokio::test]
async fn the_embedded_store_reads_loads_that_change_nothing() {
    for subject in [in_memory().await, on_file().await] {
        let b = subject.backend.as_ref();
        let s = scope("acme/m", "k");
        let at = |f: Fence| Load {
            scope: s.clone(),
            fence: f,
        };
        load(b, &s, fence(1, 3)).await;
        assert!(matches!(
            b.read_load(&at(fence(1, 3))),
            Some(Ok(Outcome::Done(_)))
        ));
        assert!(matches!(
            b.read_load(&at(fence(1, 2))),
            Some(Ok(Outcome::Stale { current: 3 }))
        ));
    }
}

#[tokio::test]
async fn an_in_memory_store_says_it_is_not_durable() {
    let b = EmbeddedBackend::in_memory().expect("in memory");
    assert!(b.describe().contains("not durable"), "{}", b.describe());
}

// ---------------------------------------------------------------------------
// PostgreSQL only.

#[tokio::test]
async fn postgres_describe_names_no_secret() {
    test_database().await;
    let url = "postgres://postgres:hunter2@127.0.0.1:5432/fief_test";
    let b = PostgresBackend::connect(url, &unique("describe"))
        .await
        .expect("connecting");
    let d = b.describe();
    assert!(d.starts_with("postgres 127.0.0.1:5432/fief_test"), "{d}");
    assert!(!d.contains("hunter2"), "{d}");
}

#[tokio::test]
async fn postgres_unreachable_is_unavailable() {
    let e = PostgresBackend::connect("postgres://postgres@127.0.0.1:1/x", "ns")
        .await
        .err()
        .expect("connecting to a closed port fails");
    assert!(matches!(e, super::BackendError::Unavailable(_)), "{e}");
}

/// Two nodes on one namespace race rounds over the same partitions, each
/// listing them in the opposite order, under tokens drawn from one counter
/// (a takeover at every step): no round fails (no deadlock), and no stale
/// commit lands: every commit writes its token, and a load under token `T`
/// never sees a value written by a commit of a lower token after a load
/// under a higher one saw a higher value (the value seen never decreases
/// with the loading token), and the last value is the highest landed token.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_nodes_racing_never_deadlock_nor_land_a_stale_commit() {
    const PARTITIONS: u32 = 8;
    const STEPS: u64 = 40;
    let ns = unique("race");
    let nodes = [postgres_on(&ns).await, postgres_on(&ns).await].map(Arc::new);
    let next = Arc::new(AtomicU64::new(1));
    let mut tasks = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let (node, next) = (Arc::clone(node), Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let mut order: Vec<u32> = (0..PARTITIONS).collect();
            if i == 1 {
                order.reverse();
            }
            let scope_of = |p: u32| scope("acme/race", &format!("p{p}"));
            let (mut seen, mut landed, mut stale) = (Vec::new(), Vec::new(), 0);
            for _ in 0..STEPS {
                let t = next.fetch_add(1, Ordering::SeqCst);
                let loads = order
                    .iter()
                    .map(|&p| Load {
                        scope: scope_of(p),
                        fence: fence(p, t),
                    })
                    .collect();
                let result = node
                    .round(Round {
                        loads,
                        ..Round::default()
                    })
                    .await;
                for (&p, outcome) in order.iter().zip(result.expect("a load round").loads) {
                    if let Outcome::Done(loaded) = outcome {
                        let v = loaded.entries.first().map_or(0, |(_, v)| {
                            u64::from_be_bytes(v.as_slice().try_into().expect("8 bytes"))
                        });
                        seen.push((p, t, v));
                    }
                }
                let commits = order
                    .iter()
                    .map(|&p| {
                        let w = vec![put("owner", &t.to_be_bytes())];
                        commit(&scope_of(p), fence(p, t), w, 0)
                    })
                    .collect();
                let result = node
                    .round(Round {
                        commits,
                        ..Round::default()
                    })
                    .await;
                for (&p, outcome) in order.iter().zip(result.expect("a commit round").commits) {
                    match outcome {
                        Outcome::Done(_) => landed.push((p, t)),
                        Outcome::Stale { current } => {
                            assert!(current > t, "stale against a lower token {current} < {t}");
                            stale += 1;
                        }
                    }
                }
            }
            (seen, landed, stale)
        }));
    }
    let (mut seen, mut landed, mut stale) = (Vec::new(), Vec::new(), 0);
    for task in tasks {
        let (s, l, n) = tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("the race finished (no deadlock)")
            .expect("a node's task");
        seen.extend(s);
        landed.extend(l);
        stale += n;
    }
    assert!(!landed.is_empty(), "no commit landed");
    seen.sort_unstable();
    for w in seen.windows(2) {
        let ((p1, t1, v1), (p2, t2, v2)) = (w[0], w[1]);
        if p1 == p2 {
            assert!(
                v1 <= v2,
                "partition {p1}: the load under {t1} saw {v1}, the later load under {t2} saw {v2}"
            );
        }
    }
    let last = postgres_on(&ns).await;
    for p in 0..PARTITIONS {
        let highest = landed
            .iter()
            .filter(|(q, _)| *q == p)
            .map(|(_, t)| *t)
            .max();
        let s = scope("acme/race", &format!("p{p}"));
        let got = entries_of(&last, &s, fence(p, u64::MAX >> 1)).await;
        let got = got
            .first()
            .map(|(_, v)| u64::from_be_bytes(v.as_slice().try_into().expect("8")));
        assert_eq!(
            got, highest,
            "partition {p} (stale commits refused: {stale})"
        );
    }
}
