//! The writer's order: a load never reads beside a commit of its key that
//! was handed over before it, nor beside a round that may still be landing;
//! and a read beside the rounds never sets the node's view of a tenant's
//! stored bytes back to before a round that answered meanwhile.
//! The store is the embedded one behind a gate that holds rounds back as a
//! slow disk would, and lands them one after another as redb does.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tokio::sync::{Mutex, Semaphore};

use super::{Books, StorageMetrics, StorageWriter};
use crate::storage::{
    Backend, BackendError, BoxFuture, Commit, EmbeddedBackend, Entries, Fence, KeyScope, Load,
    Loaded, Outcome, Round, RoundResult, Write,
};

/// The embedded store whose rounds wait for a permit each, one at a time,
/// and land even when their caller gave up on them.
struct Gated {
    store: Arc<EmbeddedBackend>,
    permits: Arc<Semaphore>,
    one_at_a_time: Arc<Mutex<()>>,
}

impl Backend for Gated {
    fn describe(&self) -> String {
        "gated".into()
    }

    fn round(&self, round: Round) -> BoxFuture<'_, Result<RoundResult, BackendError>> {
        let (store, permits) = (self.store.clone(), self.permits.clone());
        let one_at_a_time = self.one_at_a_time.clone();
        let landing = tokio::spawn(async move {
            let _turn = one_at_a_time.lock().await;
            permits.acquire().await.expect("open").forget();
            store.round(round).await
        });
        Box::pin(async move { landing.await.expect("the round's task") })
    }

    fn read_load(&self, load: &Load) -> Option<Result<Outcome<Loaded>, BackendError>> {
        self.store.read_load(load)
    }

    fn read(&self, _: KeyScope, _: String, _: u32) -> BoxFuture<'_, Result<Entries, BackendError>> {
        unreachable!("not read by these tests")
    }

    fn read_alarms(
        &self,
        _: KeyScope,
        _: u32,
    ) -> BoxFuture<'_, Result<Vec<(String, u64)>, BackendError>> {
        unreachable!("not read by these tests")
    }

    fn highest_fence_token(&self) -> BoxFuture<'_, Result<u64, BackendError>> {
        unreachable!("not read by these tests")
    }
}

/// How long the tests' writer waits for a round before giving it up.
const TIMEOUT: Duration = Duration::from_secs(1);

const FENCE: Fence = Fence {
    partition: 3,
    token: 7,
};

fn scope() -> KeyScope {
    KeyScope {
        module: "acme/m".into(),
        key: "k".into(),
    }
}

/// A writer on a gated store where the key's partition is loaded under
/// [`FENCE`] (so later loads change nothing); the permits it holds.
async fn writer() -> (Arc<StorageWriter>, Arc<Semaphore>) {
    let permits = Arc::new(Semaphore::new(0));
    let gated = Gated {
        store: Arc::new(EmbeddedBackend::in_memory().expect("a store")),
        permits: permits.clone(),
        one_at_a_time: Arc::default(),
    };
    let metrics = StorageMetrics::register(&mut Registry::default());
    let writer = StorageWriter::start_with(Arc::new(gated), metrics, TIMEOUT);
    permits.add_permits(1);
    let first = writer.load(load()).await.expect("the first load");
    assert!(matches!(first, Outcome::Done(_)), "{first:?}");
    (writer, permits)
}

fn load() -> Load {
    Load {
        scope: scope(),
        fence: FENCE,
    }
}

fn commit(value: &[u8]) -> Commit {
    Commit {
        scope: scope(),
        fence: FENCE,
        writes: vec![Write::Put {
            name: "n".into(),
            value: value.to_vec(),
        }],
        bytes_delta: 2,
    }
}

/// The value of `n` a load answered.
fn value(answer: Result<Outcome<Loaded>, BackendError>) -> Option<Vec<u8>> {
    match answer.expect("a load") {
        Outcome::Done(loaded) => loaded.entries.into_iter().next().map(|(_, v)| v),
        stale => panic!("the load was refused: {stale:?}"),
    }
}

#[tokio::test]
async fn a_settled_key_is_read_beside_a_held_round() {
    let (writer, _permits) = writer().await;
    // No permit: a round would wait forever; the read does not.
    let read = tokio::time::timeout(Duration::from_secs(30), writer.load(load())).await;
    assert_eq!(value(read.expect("read at once")), None);
}

#[tokio::test]
async fn a_load_after_a_commit_in_flight_waits_for_it_and_sees_it() {
    let (writer, permits) = writer().await;
    let committing = tokio::spawn({
        let writer = writer.clone();
        async move { writer.commit(commit(b"1")).await }
    });
    tokio::task::yield_now().await;
    let loading = tokio::spawn({
        let writer = writer.clone();
        async move { writer.load(load()).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        !loading.is_finished(),
        "the load did not wait for the commit"
    );
    permits.add_permits(2);
    let landed = committing.await.expect("task").expect("landed");
    assert_eq!(landed, Outcome::Done(2));
    assert_eq!(value(loading.await.expect("task")), Some(b"1".to_vec()));
}

#[tokio::test]
async fn after_an_abandoned_round_loads_wait_for_a_round_to_come_back() {
    let (writer, permits) = writer().await;
    let abandoned = writer.commit(commit(b"1")).await;
    assert!(
        matches!(abandoned, Err(BackendError::Unavailable(_))),
        "{abandoned:?}"
    );
    // The commit was answered (unknown), yet its round may still land: the
    // next load goes through a round, after it.
    let loading = tokio::spawn({
        let writer = writer.clone();
        async move { writer.load(load()).await }
    });
    tokio::time::sleep(TIMEOUT / 5).await;
    assert!(
        !loading.is_finished(),
        "the load read beside a landing round"
    );
    permits.add_permits(2);
    assert_eq!(value(loading.await.expect("task")), Some(b"1".to_vec()));
    // A round came back: the key is settled again and read at once.
    let read = tokio::time::timeout(Duration::from_secs(1), writer.load(load())).await;
    assert_eq!(value(read.expect("read at once")), Some(b"1".to_vec()));
}

#[test]
fn a_read_beside_the_rounds_never_overwrites_what_a_later_round_answered() {
    let books = Books {
        usage: std::sync::Mutex::default(),
        metrics: StorageMetrics::register(&mut Registry::default()),
        unsettled: crate::storage::unsettled::Unsettled::default(),
    };
    let bytes = |books: &Books| books.usage().bytes.get("acme").copied();
    // A read begins; a round lands and answers before the read does.
    let read_after = books.rounds();
    books.round_answered();
    books.learnt("acme", 100, None);
    books.learnt("acme", 50, Some(read_after));
    assert_eq!(bytes(&books), Some(100), "the older snapshot won");
    // A read with no round answered meanwhile is the latest word.
    let read_after = books.rounds();
    books.learnt("acme", 70, Some(read_after));
    assert_eq!(bytes(&books), Some(70));
}
