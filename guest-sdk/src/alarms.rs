//! This key's durable alarms, from inside the key (`docs/alarms.md`).
//!
//! An alarm is a named wake-up at a wall-clock time, stored with the key's
//! state: [`set`] and [`cancel`] are writes of the callback's commit (they
//! land with its other writes, or not at all). When one is due, the key's
//! current owner calls [`Key::handle_alarm`](crate::Key::handle_alarm),
//! activating the key if it is not live; the callback's commit deletes the
//! alarm. An alarm never fires early, fires at least once (a handler that
//! panics is retried with backoff), and is fired by one owner only.
//!
//! ```ignore
//! use fief_guest::alarms;
//! use std::time::Duration;
//!
//! alarms::set_in("reminder", Duration::from_secs(60))?;
//! ```
//!
//! This module forwards to the `fief:key/alarms` imports and reads the wall
//! clock for [`set_in`]; it decides nothing about firing.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::__private::bindings::fief::key::alarms as wit;
use crate::storage::StorageError;

/// Sets alarm `name` to fire at `at_ms`, milliseconds since the Unix epoch
/// (replacing an alarm of that name).
///
/// # Errors
///
/// [`StorageError::Invalid`] for a name of 0 or over 256 bytes or a time more
/// than ten years ahead, [`StorageError::Limit`] past the module's
/// `max_alarms_per_key` or the callback's writes, [`StorageError::Unavailable`]
/// when the key's state cannot be loaded.
pub fn set(name: &str, at_ms: u64) -> Result<(), StorageError> {
    wit::set_alarm(name, at_ms)
}

/// Sets alarm `name` to fire `delay` from now (this process's wall clock).
///
/// # Errors
///
/// As [`set`].
pub fn set_in(name: &str, delay: Duration) -> Result<(), StorageError> {
    let at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .saturating_add(delay);
    set(name, u64::try_from(at.as_millis()).unwrap_or(u64::MAX))
}

/// Cancels alarm `name`. Returns whether it was set.
///
/// # Errors
///
/// As [`set`].
pub fn cancel(name: &str) -> Result<bool, StorageError> {
    wit::cancel_alarm(name)
}

/// Every alarm of this key, `(name, at_ms)`, sorted by name.
///
/// # Errors
///
/// [`StorageError::Unavailable`] when the key's state cannot be loaded.
pub fn list() -> Result<Vec<(String, u64)>, StorageError> {
    wit::list_alarms()
}
