//! What the storage writer has in flight, so that a key's load may be read
//! beside the rounds (issue 20: an evicted key's reactivation).
//!
//! A load through the writer's round always sees the commits handed over
//! before it (they are in its round or an earlier one). A load read at once
//! ([`Backend::read_load`](super::Backend::read_load)) sees only what has
//! landed, so the writer reads that way only for a key that is *settled*:
//! none of its commits handed over and not yet answered, and no round
//! abandoned on its timeout since a later round came back (an abandoned
//! round may still be landing; the backend's rounds land one after another,
//! so a round that came back after it means it is done).
//!
//! Keys are counted by a hash of their scope: two keys that share a hash
//! only send each other's loads through rounds. It owns this bookkeeping;
//! it must not read or write the store.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;

use super::KeyScope;

/// A commit in flight, as [`Unsettled::handed`] counted it.
#[derive(Clone, Copy, Debug)]
pub(super) struct InFlight(u64);

#[derive(Default)]
struct Counts {
    /// Commits handed over and not answered, by scope hash (no zeros).
    commits: HashMap<u64, u32>,
    /// A round was abandoned and no round has come back since.
    abandoned: bool,
}

/// The writer's commits in flight and abandoned rounds (module header).
#[derive(Default)]
pub(super) struct Unsettled {
    hasher: RandomState,
    counts: Mutex<Counts>,
}

impl Unsettled {
    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A commit of `scope` is about to be handed over.
    pub(super) fn handed(&self, scope: &KeyScope) -> InFlight {
        let hash = self.hasher.hash_one(scope);
        *self.counts().commits.entry(hash).or_default() += 1;
        InFlight(hash)
    }

    /// The commit was answered: landed, refused, failed with its round, or
    /// never handed over (the writer had stopped). Call
    /// [`Unsettled::abandoned`] first when its round timed out.
    pub(super) fn answered(&self, commit: InFlight) {
        let mut counts = self.counts();
        if let Some(n) = counts.commits.get_mut(&commit.0) {
            *n -= 1;
            if *n == 0 {
                counts.commits.remove(&commit.0);
            }
        }
    }

    /// A round was given up on its timeout: it may still land.
    pub(super) fn abandoned(&self) {
        self.counts().abandoned = true;
    }

    /// A round came back (landed or failed): every earlier round is done.
    pub(super) fn came_back(&self) {
        self.counts().abandoned = false;
    }

    /// Whether a load of `scope` may be read beside the rounds now.
    pub(super) fn settled(&self, scope: &KeyScope) -> bool {
        let hash = self.hasher.hash_one(scope);
        let counts = self.counts();
        !counts.abandoned && !counts.commits.contains_key(&hash)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(key: &str) -> KeyScope {
        KeyScope {
            module: "acme/m".into(),
            key: key.into(),
        }
    }

    #[test]
    fn a_key_is_unsettled_while_any_of_its_commits_is_in_flight() {
        let u = Unsettled::default();
        assert!(u.settled(&scope("a")));
        let (one, two) = (u.handed(&scope("a")), u.handed(&scope("a")));
        assert!(!u.settled(&scope("a")));
        assert!(u.settled(&scope("b")), "another key is not held up");
        u.answered(one);
        assert!(!u.settled(&scope("a")), "one commit is still in flight");
        u.answered(two);
        assert!(u.settled(&scope("a")));
    }

    #[test]
    fn an_abandoned_round_unsettles_every_key_until_a_round_comes_back() {
        let u = Unsettled::default();
        let commit = u.handed(&scope("a"));
        u.abandoned();
        u.answered(commit);
        assert!(!u.settled(&scope("a")) && !u.settled(&scope("b")));
        u.came_back();
        assert!(u.settled(&scope("a")) && u.settled(&scope("b")));
    }
}
