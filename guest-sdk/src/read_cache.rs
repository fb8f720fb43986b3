//! The key process's bounded cache of its own stored values, inside the
//! guest, so a repeated `storage::get` does not cross into the host.
//!
//! Coherence rests on single ownership, not on invalidation messages: the
//! process is the only writer of its key's state (the node fences every
//! other one), every write of this process goes through [`crate::storage`],
//! which updates this cache after the host accepted it, and a process
//! whose commit fails or whose callback traps is killed with its memory —
//! and this cache — so it never outlives a write the store did not take.
//! A new process (after an eviction, a move, a crash, a redeploy) starts
//! empty and reads through the host, which loads the key's state from the
//! store under the new ownership token.
//!
//! This file owns the bookkeeping and its bound only. It must not call the
//! host: [`crate::storage`] decides when to read through and what to
//! remember.

use std::collections::BTreeMap;
use std::ops::Bound;

/// Bytes an entry is taken to cost beyond its name and value (the map's
/// node, the two buffers' headers), so known-absent names are bounded too.
pub(crate) const ENTRY_OVERHEAD: usize = 64;

/// The default bound on what the cache holds: names, values and
/// [`ENTRY_OVERHEAD`] per entry.
pub const DEFAULT_LIMIT: usize = 256 * 1024;

/// Values by name, as last read from or written to the host; `None`: the
/// host said there is no such entry.
#[derive(Debug)]
pub(crate) struct ReadCache {
    entries: BTreeMap<String, Option<Vec<u8>>>,
    /// What `entries` costs, by [`cost`].
    bytes: usize,
    /// Most `bytes` may reach.
    limit: usize,
}

fn cost(name: &str, value: Option<&[u8]>) -> usize {
    name.len() + value.map_or(0, <[u8]>::len) + ENTRY_OVERHEAD
}

impl ReadCache {
    /// An empty cache that holds at most `limit` bytes (0: holds nothing).
    pub(crate) const fn new(limit: usize) -> Self {
        ReadCache {
            entries: BTreeMap::new(),
            bytes: 0,
            limit,
        }
    }

    /// What is known of `name`: `Some(value)` (where `value` is `None`
    /// when there is no such entry), or `None` when the host must be asked.
    pub(crate) fn get(&self, name: &str) -> Option<Option<Vec<u8>>> {
        self.entries.get(name).cloned()
    }

    /// Remember that `name` holds `value` (`None`: nothing). A value that
    /// alone is over the bound is not kept (and what was known of `name` is
    /// forgotten); to make room, entries are dropped from the first name on.
    pub(crate) fn remember(&mut self, name: &str, value: Option<&[u8]>) {
        self.forget(name);
        let needed = cost(name, value);
        if needed > self.limit {
            return;
        }
        while self.bytes + needed > self.limit {
            let Some((dropped, value)) = self.entries.pop_first() else {
                break;
            };
            self.bytes -= cost(&dropped, value.as_deref());
        }
        self.entries
            .insert(name.to_owned(), value.map(<[u8]>::to_vec));
        self.bytes += needed;
    }

    /// Forget what is known of `name`.
    pub(crate) fn forget(&mut self, name: &str) {
        if let Some(value) = self.entries.remove(name) {
            self.bytes -= cost(name, value.as_deref());
        }
    }

    /// Forget every name in `start..end` (`end` `None`: to the last).
    pub(crate) fn forget_range(&mut self, start: &str, end: Option<&str>) {
        let upper = end.map_or(Bound::Unbounded, Bound::Excluded);
        let names: Vec<String> = self
            .entries
            .range::<str, _>((Bound::Included(start), upper))
            .map(|(name, _)| name.clone())
            .collect();
        for name in names {
            self.forget(&name);
        }
    }

    /// Change the bound to `limit` bytes, dropping entries to fit.
    pub(crate) fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
        while self.bytes > self.limit {
            let Some((dropped, value)) = self.entries.pop_first() else {
                break;
            };
            self.bytes -= cost(&dropped, value.as_deref());
        }
    }

    /// What the cache holds now, by its cost model.
    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::{ENTRY_OVERHEAD, ReadCache};

    #[test]
    fn a_remembered_value_and_a_known_absence_are_hits() {
        let mut cache = ReadCache::new(1024);
        assert_eq!(cache.get("a"), None);
        cache.remember("a", Some(b"1"));
        cache.remember("b", None);
        assert_eq!(cache.get("a"), Some(Some(b"1".to_vec())));
        assert_eq!(cache.get("b"), Some(None));
        cache.remember("a", Some(b"22"));
        assert_eq!(cache.get("a"), Some(Some(b"22".to_vec())));
        assert_eq!(cache.bytes(), 1 + 2 + 1 + 2 * ENTRY_OVERHEAD);
    }

    #[test]
    fn forgetting_a_range_spares_the_names_outside_it() {
        let mut cache = ReadCache::new(4096);
        for name in ["a", "b", "ba", "c", "d"] {
            cache.remember(name, Some(b"v"));
        }
        cache.forget_range("b", Some("c"));
        assert_eq!(cache.get("a"), Some(Some(b"v".to_vec())));
        assert_eq!(cache.get("b"), None);
        assert_eq!(cache.get("ba"), None);
        assert_eq!(cache.get("c"), Some(Some(b"v".to_vec())));
        cache.forget_range("c", None);
        assert_eq!(cache.get("d"), None);
        assert_eq!(cache.bytes(), cost_of("a", 1));
    }

    #[test]
    fn the_cache_never_holds_more_than_its_limit() {
        let limit = 4 * (ENTRY_OVERHEAD + 10);
        let mut cache = ReadCache::new(limit);
        for i in 0..100 {
            cache.remember(&format!("n{i:02}"), Some(&[0; 7]));
            assert!(cache.bytes() <= limit, "{} > {limit}", cache.bytes());
        }
        // The newest entry is always kept.
        assert_eq!(cache.get("n99"), Some(Some(vec![0; 7])));
        // A value over the whole bound is not kept, and what was known is
        // forgotten.
        cache.remember("big", Some(&[0; 100]));
        cache.remember("big", Some(&vec![0; limit]));
        assert_eq!(cache.get("big"), None);
        cache.set_limit(0);
        assert_eq!(cache.bytes(), 0);
        cache.remember("n", None);
        assert_eq!(cache.get("n"), None, "a limit of 0 keeps nothing");
    }

    fn cost_of(name: &str, value: usize) -> usize {
        name.len() + value + ENTRY_OVERHEAD
    }
}
