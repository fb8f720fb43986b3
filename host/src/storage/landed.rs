//! What the embedded store has landed, kept in memory beside its file: each
//! partition's fence token and each tenant's stored bytes. A key's load
//! that changes nothing (`Backend::read_load`) reads them here instead of
//! opening two tables in its read transaction.
//!
//! The embedded store is its file's only writer (redb locks the file), and
//! every round that writes goes through it, so the values here are the
//! file's own, learnt at open and after each round's commit. What a load
//! must never do is answer `Done` under a token a landed round has already
//! raised past, or miss an earlier owner's commits. So:
//!
//! - a round marks the partitions it raises as *raising* before its commit
//!   and records the new tokens (and clears the marks) after it; a token
//!   here is never above the file's, and only a raising partition's is
//!   below it;
//! - a load reads the token, takes its read snapshot, and reads the token
//!   again ([`Landed::settled_token`] both times). Equal and settled both
//!   times, the snapshot holds the raise to that token (recorded after its
//!   commit, read before the snapshot) and no raise past it (its mark was
//!   set before its commit, so before the snapshot, and still stood or had
//!   been replaced by the higher token at the second read). Otherwise the
//!   load reads the token from its snapshot, as a store without this would.
//!
//! Tenants' bytes are what a key's writes are checked against, an estimate
//! by design (`state.rs`); each value is the one its latest commit wrote,
//! ordered by the rounds' sequence in the file.
//!
//! It owns only these maps; it must not read or write the file (the
//! backend does, and tells it what landed).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use crate::sync::lock;

/// The embedded store's landed fence tokens and tenants' bytes (see the
/// module docs).
#[derive(Default)]
pub(super) struct Landed {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Partition → its fence token as landed (absent: 0).
    tokens: HashMap<u32, u64>,
    /// Partition → rounds raising it whose commit has not been recorded.
    raising: HashMap<u32, u32>,
    /// Tenant → (bytes, the sequence number of the round that wrote them).
    usage: HashMap<String, (u64, u64)>,
}

impl Landed {
    /// What the file holds at open: its fence tokens and tenants' bytes.
    pub(super) fn new(
        tokens: impl IntoIterator<Item = (u32, u64)>,
        usage: impl IntoIterator<Item = (String, u64)>,
    ) -> Self {
        Landed {
            inner: Mutex::new(Inner {
                tokens: tokens.into_iter().collect(),
                raising: HashMap::new(),
                usage: usage.into_iter().map(|(t, b)| (t, (b, 0))).collect(),
            }),
        }
    }

    /// `partition`'s fence token as landed, or `None` while a round that
    /// raises it is between its decision and its record.
    pub(super) fn settled_token(&self, partition: u32) -> Option<u64> {
        let inner = lock(&self.inner);
        if inner.raising.contains_key(&partition) {
            return None;
        }
        Some(inner.tokens.get(&partition).copied().unwrap_or(0))
    }

    /// Bytes `tenant` stores, as landed.
    pub(super) fn tenant_bytes(&self, tenant: &str) -> u64 {
        lock(&self.inner).usage.get(tenant).map_or(0, |(b, _)| *b)
    }

    /// A round is about to commit raises of `raised`'s partitions: mark
    /// them until [`Landed::record`].
    pub(super) fn raising(&self, raised: &BTreeMap<u32, u64>) {
        let mut inner = lock(&self.inner);
        for p in raised.keys() {
            *inner.raising.entry(*p).or_default() += 1;
        }
    }

    /// The round numbered `seq` (its place among the file's write
    /// transactions) that [`Landed::raising`] marked with `raised` is over:
    /// record its tokens and `usage` if it `committed`, and clear its marks
    /// either way.
    pub(super) fn record(
        &self,
        seq: u64,
        raised: &BTreeMap<u32, u64>,
        usage: &BTreeMap<String, u64>,
        committed: bool,
    ) {
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        for (p, token) in raised {
            if committed {
                let landed = inner.tokens.entry(*p).or_default();
                *landed = (*landed).max(*token);
            }
            if let Some(n) = inner.raising.get_mut(p) {
                *n -= 1;
                if *n == 0 {
                    inner.raising.remove(p);
                }
            }
        }
        if committed {
            for (tenant, bytes) in usage {
                match inner.usage.get_mut(tenant.as_str()) {
                    Some(had) if had.1 > seq => {}
                    Some(had) => *had = (*bytes, seq),
                    None => {
                        inner.usage.insert(tenant.clone(), (*bytes, seq));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raise(p: u32, token: u64) -> BTreeMap<u32, u64> {
        BTreeMap::from([(p, token)])
    }

    #[test]
    fn a_raise_is_unsettled_from_its_mark_to_its_record() {
        let landed = Landed::new([(1, 4)], []);
        assert_eq!(landed.settled_token(1), Some(4));
        assert_eq!(landed.settled_token(2), Some(0), "no row: token 0");
        landed.raising(&raise(1, 5));
        landed.raising(&raise(1, 6));
        assert_eq!(landed.settled_token(1), None);
        assert_eq!(landed.settled_token(2), Some(0), "other partitions settle");
        landed.record(2, &raise(1, 6), &BTreeMap::new(), true);
        assert_eq!(landed.settled_token(1), None, "one round still raising");
        landed.record(1, &raise(1, 5), &BTreeMap::new(), true);
        assert_eq!(landed.settled_token(1), Some(6), "tokens only rise");
        landed.raising(&raise(1, 9));
        landed.record(3, &raise(1, 9), &BTreeMap::new(), false);
        assert_eq!(
            landed.settled_token(1),
            Some(6),
            "a failed commit raises nothing"
        );
    }

    #[test]
    fn a_tenants_bytes_are_its_latest_rounds() {
        let landed = Landed::new([], [("t".to_owned(), 10)]);
        assert_eq!(landed.tenant_bytes("t"), 10);
        assert_eq!(landed.tenant_bytes("u"), 0);
        let usage = |b| BTreeMap::from([("t".to_owned(), b)]);
        landed.record(5, &BTreeMap::new(), &usage(50), true);
        landed.record(4, &BTreeMap::new(), &usage(40), true);
        assert_eq!(
            landed.tenant_bytes("t"),
            50,
            "an earlier round recorded late"
        );
        landed.record(6, &BTreeMap::new(), &usage(60), false);
        assert_eq!(
            landed.tenant_bytes("t"),
            50,
            "a failed commit wrote nothing"
        );
    }
}
