//! This key's durable state, from inside the key.
//!
//! Each key process sees only its own key's state: a sorted map of names to
//! values, kept by the node's storage backend. The writes of one callback
//! are committed together when the callback returns, and the callback's
//! reply (and the casts, publications and timers issued after its first
//! write) leave only after that commit succeeded. A process whose ownership
//! has ended cannot commit: a stale owner never overwrites a newer one.
//!
//! ```ignore
//! use fief_guest::storage;
//!
//! let count: u64 = storage::get_as::<fief_guest::Json, _>("count")?.unwrap_or(0);
//! storage::put_as::<fief_guest::Json, _>("count", &(count + 1))?;
//! ```
//!
//! Reads after the first are served from the process's memory: the node
//! holds the key's loaded state, and this module keeps a bounded cache of
//! the values [`get`] returned (and [`put`] wrote) inside the guest, so a
//! repeated read does not even cross into the host. The cache is coherent
//! because this process is its key's only writer and dies with any write
//! the store refused; [`set_read_cache_limit`] bounds or disables it.
//! This module forwards to the `fief:key/storage` imports, keeps that
//! cache, and encodes values; it decides nothing about durability or
//! fencing.

use std::cell::RefCell;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::__private::bindings::fief::key::storage as wit;
use crate::codec::Codec;
use crate::read_cache::ReadCache;

pub use crate::read_cache::DEFAULT_LIMIT as DEFAULT_READ_CACHE_LIMIT;
pub use wit::StorageError;

thread_local! {
    /// This process's cache of its stored values (a guest has one thread).
    static CACHE: RefCell<ReadCache> = const { RefCell::new(ReadCache::new(DEFAULT_READ_CACHE_LIMIT)) };
}

fn cache<R>(f: impl FnOnce(&mut ReadCache) -> R) -> R {
    CACHE.with(|cache| f(&mut cache.borrow_mut()))
}

/// Bound the cache of read values to `bytes` (names, values and 64 bytes
/// per entry; [`DEFAULT_READ_CACHE_LIMIT`] until set); 0 turns it off, so
/// every [`get`] asks the node. The cache lives in this process's linear
/// memory and counts against its module's `max_memory`.
pub fn set_read_cache_limit(bytes: usize) {
    cache(|cache| cache.set_limit(bytes));
}

/// The value stored under `name`, if any.
///
/// The first read of a name asks the node (which serves it from the key's
/// state, loaded once); later reads of it are served from this process's
/// own cache, as are names it wrote.
///
/// # Errors
///
/// [`StorageError::Invalid`] for a refused name, [`StorageError::Unavailable`]
/// when the state cannot be loaded or this process may no longer write it.
pub fn get(name: &str) -> Result<Option<Vec<u8>>, StorageError> {
    if let Some(known) = cache(|cache| cache.get(name)) {
        return Ok(known);
    }
    let value = wit::get(name)?;
    cache(|cache| cache.remember(name, value.as_deref()));
    Ok(value)
}

/// Stores `value` under `name`; committed when the callback returns.
///
/// # Errors
///
/// [`StorageError::Invalid`] for an oversized name or value,
/// [`StorageError::Limit`] past the key's or tenant's bytes or the writes
/// allowed per callback, and the errors of [`get`].
pub fn put(name: &str, value: &[u8]) -> Result<(), StorageError> {
    let result = wit::put(name, value);
    cache(|cache| match result {
        Ok(()) => cache.remember(name, Some(value)),
        Err(_) => cache.forget(name),
    });
    result
}

/// Removes `name`; returns whether it was there.
///
/// # Errors
///
/// As [`put`].
pub fn delete(name: &str) -> Result<bool, StorageError> {
    let result = wit::delete(name);
    cache(|cache| match result {
        Ok(_) => cache.remember(name, None),
        Err(_) => cache.forget(name),
    });
    result
}

/// Up to `limit` entries with names in `start..end` (`end` `None`: to the
/// last), sorted by name.
///
/// # Errors
///
/// As [`get`]; [`StorageError::Invalid`] when `end` is before `start`.
pub fn list(
    start: &str,
    end: Option<&str>,
    limit: u32,
) -> Result<Vec<(String, Vec<u8>)>, StorageError> {
    wit::list(start, end, limit)
}

/// Up to `limit` entries whose names start with `prefix`, sorted by name.
///
/// # Errors
///
/// As [`get`].
pub fn list_prefix(prefix: &str, limit: u32) -> Result<Vec<(String, Vec<u8>)>, StorageError> {
    wit::list(prefix, prefix_end(prefix).as_deref(), limit)
}

/// Removes every entry with a name in `start..end` (`end` `None`: to the
/// last); returns how many were removed.
///
/// # Errors
///
/// As [`put`].
pub fn delete_range(start: &str, end: Option<&str>) -> Result<u64, StorageError> {
    let result = wit::delete_range(start, end);
    cache(|cache| cache.forget_range(start, end));
    result
}

/// Removes every entry whose name starts with `prefix`; returns how many.
///
/// # Errors
///
/// As [`put`].
pub fn delete_prefix(prefix: &str) -> Result<u64, StorageError> {
    delete_range(prefix, prefix_end(prefix).as_deref())
}

/// Reads `name` and decodes it with codec `C` (e.g. [`crate::Json`]).
///
/// # Errors
///
/// As [`get`]; [`StorageError::Invalid`] when the stored bytes are not a `T`
/// in `C`.
pub fn get_as<C: Codec, T: DeserializeOwned>(name: &str) -> Result<Option<T>, StorageError> {
    match get(name)? {
        None => Ok(None),
        Some(bytes) => C::decode(&bytes)
            .map(Some)
            .map_err(|e| StorageError::Invalid(format!("stored value {name:?}: {e}"))),
    }
}

/// Encodes `value` with codec `C` and stores it under `name`.
///
/// # Errors
///
/// As [`put`]; [`StorageError::Invalid`] when `value` cannot be encoded.
pub fn put_as<C: Codec, T: Serialize + ?Sized>(name: &str, value: &T) -> Result<(), StorageError> {
    let bytes = C::encode(value).map_err(|e| StorageError::Invalid(e.to_string()))?;
    put(name, &bytes)
}

/// The first name after every name that starts with `prefix` (`None`: no
/// such name, every name from `prefix` on starts with it or is greater).
fn prefix_end(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        // The next scalar value; UTF-8 byte order is scalar order.
        let next = (last as u32 + 1..=char::MAX as u32).find_map(char::from_u32);
        if let Some(next) = next {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn a_prefix_ends_at_its_last_character_plus_one() {
        assert_eq!(prefix_end("user:").as_deref(), Some("user;"));
        assert_eq!(prefix_end("a").as_deref(), Some("b"));
        assert_eq!(prefix_end(""), None);
        // Past the surrogates, and past the last scalar value.
        assert_eq!(prefix_end("x\u{D7FF}").as_deref(), Some("x\u{E000}"));
        assert_eq!(prefix_end("x\u{10FFFF}").as_deref(), Some("y"));
        assert_eq!(prefix_end("\u{10FFFF}"), None);
    }

    #[test]
    fn every_name_with_the_prefix_sorts_before_its_end() {
        for (prefix, name) in [("ab", "ab\u{10FFFF}\u{10FFFF}"), ("é", "éz"), ("a", "a")] {
            let end = prefix_end(prefix).unwrap();
            assert!(name.as_bytes() < end.as_bytes(), "{name:?} < {end:?}");
            assert!(prefix.as_bytes() <= name.as_bytes());
        }
        assert!("b".as_bytes() >= prefix_end("a").unwrap().as_bytes());
    }
}
