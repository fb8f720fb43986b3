//! The crate's one helper over `std::sync`: [`lock`], a mutex lock that
//! ignores poisoning.
//!
//! A leaf: it imports nothing of the crate, so any layer may use it without
//! reaching into another (it lived in `key/` once, and made half the crate
//! look as if it depended on key processes). It must not grow state or
//! policy.

use std::sync::{Mutex, MutexGuard};

/// Lock a std mutex, ignoring poisoning: every critical section in this
/// crate leaves the data consistent before it can panic.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
