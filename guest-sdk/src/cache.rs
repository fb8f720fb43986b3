//! The coherent single-owner cache, from inside a key.
//!
//! Entries are partitioned like keys: an entry named after this key lives on
//! this node, others on their owners (the call then waits for the network).
//! An entry is dropped whenever its partition changes owner, so treat every
//! read as "maybe empty". Versions make read-modify-write safe:
//!
//! ```ignore
//! use fief_guest::cache::{self, Write};
//! loop {
//!     let current = cache::get("visits", "total")?;
//!     let (count, expect) = match &current {
//!         Some(entry) => (parse(&entry.value) + 1, Write::IfVersion(entry.version)),
//!         None => (1, Write::IfAbsent),
//!     };
//!     match cache::put("visits", "total", count.to_string().as_bytes(), None, expect) {
//!         Err(fief_guest::CacheError::Conflict(_)) => continue, // someone else won; retry
//!         other => break other,
//!     }
//! }
//! ```

use core::time::Duration;

use crate::__private::bindings::fief::key::host as wit;
use crate::{CacheEntry, CacheError};

/// The precondition of a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// Write whatever is there.
    Always,
    /// Write only if there is no entry.
    IfAbsent,
    /// Write only if the entry's version is this one (compare-and-set).
    IfVersion(u64),
}

impl Write {
    fn expected_version(self) -> Option<u64> {
        match self {
            Write::Always => None,
            Write::IfAbsent => Some(0),
            Write::IfVersion(version) => Some(version),
        }
    }
}

/// Reads an entry; `Ok(None)` when there is none.
///
/// # Errors
///
/// [`CacheError::Invalid`] for a refused name, [`CacheError::Unavailable`]
/// when the entry's owner is fenced, unassigned or unreachable.
pub fn get(namespace: &str, key: &str) -> Result<Option<CacheEntry>, CacheError> {
    wit::cache_get(namespace, key)
}

/// Writes an entry and returns its new version; `ttl` drops it after that
/// long (rounded up to whole milliseconds).
///
/// # Errors
///
/// [`CacheError::Conflict`] when `write`'s precondition does not hold
/// (nothing is written), and the errors of [`get`].
pub fn put(
    namespace: &str,
    key: &str,
    value: &[u8],
    ttl: Option<Duration>,
    write: Write,
) -> Result<u64, CacheError> {
    let ttl_ms =
        ttl.map(|ttl| u64::try_from(ttl.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX));
    wit::cache_put(namespace, key, value, ttl_ms, write.expected_version())
}

/// Deletes an entry if `write`'s precondition holds; returns whether there
/// was one.
///
/// # Errors
///
/// As for [`put`].
pub fn delete(namespace: &str, key: &str, write: Write) -> Result<bool, CacheError> {
    wit::cache_delete(namespace, key, write.expected_version())
}
