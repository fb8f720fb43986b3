//! A storage backend the tests can hold up and break: a store (the
//! in-memory [`EmbeddedBackend`], or one several nodes share) behind a gate that can hold every round until
//! released, or fail every round, and that counts rounds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use fief::storage::{
    Backend, BackendError, BoxFuture, EmbeddedBackend, Entries, KeyScope, Round, RoundResult,
};
use tokio::sync::watch;

/// See the module header.
pub struct ControlledBackend {
    inner: Arc<dyn Backend>,
    hold: watch::Sender<bool>,
    fail: AtomicBool,
    rounds: AtomicU64,
    commits: AtomicU64,
}

impl ControlledBackend {
    /// A fresh store, neither holding nor failing.
    pub fn new() -> Arc<Self> {
        ControlledBackend::over(Arc::new(
            EmbeddedBackend::in_memory().expect("an in-memory store"),
        ))
    }

    /// A gate in front of `inner` (give each node of a cluster its own gate
    /// over one shared store, to hold one node's rounds only).
    pub fn over(inner: Arc<dyn Backend>) -> Arc<Self> {
        Arc::new(ControlledBackend {
            inner,
            hold: watch::channel(false).0,
            fail: AtomicBool::new(false),
            rounds: AtomicU64::new(0),
            commits: AtomicU64::new(0),
        })
    }

    /// Hold every round (those running and those to come) until
    /// `set_held(false)`.
    pub fn set_held(&self, held: bool) {
        self.hold.send_replace(held);
    }

    /// Fail every round with `unavailable` while `fail` is set.
    pub fn set_failing(&self, fail: bool) {
        self.fail.store(fail, Ordering::SeqCst);
    }

    /// Rounds that reached the store (held ones included).
    pub fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::SeqCst)
    }

    /// Commits that reached the store (held and failed ones included).
    pub fn commits(&self) -> u64 {
        self.commits.load(Ordering::SeqCst)
    }
}

impl Backend for ControlledBackend {
    fn describe(&self) -> String {
        "controlled (tests)".to_owned()
    }

    fn round(&self, round: Round) -> BoxFuture<'_, Result<RoundResult, BackendError>> {
        self.rounds.fetch_add(1, Ordering::SeqCst);
        self.commits
            .fetch_add(round.commits.len() as u64, Ordering::SeqCst);
        let mut hold = self.hold.subscribe();
        Box::pin(async move {
            let _ = hold.wait_for(|held| !*held).await;
            if self.fail.load(Ordering::SeqCst) {
                return Err(BackendError::Unavailable(
                    "the test store is down".to_owned(),
                ));
            }
            self.inner.round(round).await
        })
    }

    fn read(
        &self,
        scope: KeyScope,
        prefix: String,
        limit: u32,
    ) -> BoxFuture<'_, Result<Entries, BackendError>> {
        self.inner.read(scope, prefix, limit)
    }

    fn read_alarms(
        &self,
        scope: KeyScope,
        partition: u32,
    ) -> BoxFuture<'_, Result<Vec<(String, u64)>, BackendError>> {
        self.inner.read_alarms(scope, partition)
    }

    fn highest_fence_token(&self) -> BoxFuture<'_, Result<u64, BackendError>> {
        self.inner.highest_fence_token()
    }
}
