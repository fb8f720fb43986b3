//! What the node offers a key process: idiomatic wrappers over every import of
//! the WIT `host` interface.
//!
//! The wrappers only translate types: [`Duration`] instead of raw
//! milliseconds, [`TimerId`] instead of a bare `u64`, and typed variants
//! ([`call_typed`], [`cast_typed`], [`publish_typed`]) that run a
//! [`Codec`] on the way. They add no policy, no retry, and no state: limits,
//! fencing and delivery are the node's.
//!
//! Contract clause: every effectful host function checks the key's fence
//! first; after the node fenced itself (or the key was killed) the call has no
//! effect and the key process traps. Code here therefore never needs to handle
//! "fenced" for effects other than [`call`], where it is a [`CallError`].
//!
//! Off `wasm32` (for example in `cargo test` on the build machine) the imports
//! are stubs that panic: only pure code can be tested natively.

#![forbid(unsafe_code)]

use core::fmt;
use core::num::ParseIntError;
use core::str::FromStr;
use core::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::__private::bindings::fief::key::host as wit;
use crate::codec::{Codec, CodecError};
use crate::{CallError, EffectError, TimerFired};

/// The id of a timer armed with [`send_after`].
///
/// It is the `id` the node reports in [`TimerFired`] when the timer fires;
/// compare with [`TimerFired::timer_id`]. It formats and parses as a decimal
/// number, so it can travel in text messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TimerId(u64);

impl TimerId {
    /// Wraps a raw timer id, as the WIT interface carries it.
    #[must_use]
    pub const fn from_raw(id: u64) -> Self {
        Self(id)
    }

    /// The raw timer id, as the WIT interface carries it.
    #[must_use]
    pub const fn as_raw(self) -> u64 {
        self.0
    }
}

impl fmt::Display for TimerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl FromStr for TimerId {
    type Err = ParseIntError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse().map(Self)
    }
}

impl TimerFired {
    /// The id of the timer that fired, as [`send_after`] returned it.
    #[must_use]
    pub fn timer_id(&self) -> TimerId {
        TimerId(self.id)
    }
}

/// The key this process serves.
#[must_use]
pub fn self_key() -> String {
    wit::self_key()
}

/// The module this process runs.
#[must_use]
pub fn self_module() -> String {
    wit::self_module()
}

/// The ownership token of this key's partition on this node.
///
/// It strictly increases every time the partition gets a new owner: attach it
/// to writes so that an external store can reject a stale owner.
#[must_use]
pub fn ownership_token() -> u64 {
    wit::ownership_token()
}

/// Arms a one-shot timer: after `delay`, [`Info::Timer`](crate::Info::Timer)
/// is delivered to this key with the same `tag`.
///
/// `delay` is rounded up to whole milliseconds (so a non-zero delay never
/// becomes zero) and saturates at `u64::MAX` milliseconds.
///
/// # Errors
///
/// [`EffectError::Limit`] when the key already has as many timers as the node
/// allows, [`EffectError::Invalid`] when the tag is refused (too long).
pub fn send_after(delay: Duration, tag: &[u8]) -> Result<TimerId, EffectError> {
    let delay_ms = u64::try_from(millis_rounded_up(delay)).unwrap_or(u64::MAX);
    wit::send_after(delay_ms, tag).map(TimerId)
}

/// Cancels a timer. Returns `true` if it had not fired yet.
///
/// A timer that fired but whose [`Info::Timer`](crate::Info::Timer) is still
/// queued counts as fired: compare ids when it arrives if a stale timer
/// matters.
pub fn cancel_timer(timer: TimerId) -> bool {
    wit::cancel_timer(timer.0)
}

/// Subscribes this key to `topic`; publications arrive as
/// [`Info::Published`](crate::Info::Published).
///
/// # Errors
///
/// [`EffectError::Limit`] when the key has as many subscriptions as the node
/// allows, [`EffectError::Invalid`] for a refused topic (empty, too long).
pub fn subscribe(topic: &str) -> Result<(), EffectError> {
    wit::subscribe(topic)
}

/// Unsubscribes this key from `topic`. A topic not subscribed to is a no-op.
pub fn unsubscribe(topic: &str) {
    wit::unsubscribe(topic);
}

/// Publishes `payload` to every key subscribed to `topic` (this one included,
/// if subscribed). Returns how many subscribers it was delivered to.
///
/// # Errors
///
/// [`EffectError::Limit`] past the key's publish rate,
/// [`EffectError::Invalid`] for a refused topic or an oversized payload.
pub fn publish(topic: &str, payload: &[u8]) -> Result<u32, EffectError> {
    wit::publish(topic, payload)
}

/// Calls `key` of `module` and waits at most `timeout` for its reply.
///
/// `timeout` is rounded up to whole milliseconds and saturates at `u32::MAX`
/// milliseconds (about 49 days).
///
/// # Errors
///
/// Every [`CallError`]: the module is unknown, the message or key refused, this
/// node fenced, the owner unreachable or too slow, the callee overloaded, a
/// call to itself ([`CallError::Deadlock`]), the callee's own error
/// ([`CallError::Rejected`]), or the callee died ([`CallError::Crashed`]).
pub fn call(
    module: &str,
    key: &str,
    message: &[u8],
    timeout: Duration,
) -> Result<Vec<u8>, CallError> {
    let timeout_ms = u32::try_from(millis_rounded_up(timeout)).unwrap_or(u32::MAX);
    wit::call(module, key, message, timeout_ms)
}

/// Sends `message` to `key` of `module` without waiting for it to be
/// processed.
///
/// # Errors
///
/// [`EffectError::UnknownModule`], [`EffectError::Overloaded`] when the
/// callee's mailbox is full, [`EffectError::Invalid`] for a refused key or
/// message.
pub fn cast(module: &str, key: &str, message: &[u8]) -> Result<(), EffectError> {
    wit::cast(module, key, message)
}

/// A typed host operation failed: either the codec or the host refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TypedError<E> {
    /// The request could not be encoded, or the reply could not be decoded.
    Codec(CodecError),
    /// The host refused the operation.
    Host(E),
}

impl<E: fmt::Display> fmt::Display for TypedError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TypedError::Codec(error) => error.fmt(f),
            TypedError::Host(error) => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for TypedError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TypedError::Codec(error) => Some(error),
            TypedError::Host(error) => Some(error),
        }
    }
}

/// [`call`] with a request and a reply encoded by the codec `C`.
///
/// ```no_run
/// use core::time::Duration;
/// use fief_guest::{Json, host};
///
/// let total: u64 = host::call_typed::<Json, _, _>("ledger", "alice", &("add", 5), Duration::from_secs(1))?;
/// # Ok::<(), host::TypedError<fief_guest::CallError>>(())
/// ```
///
/// # Errors
///
/// [`TypedError::Codec`] if the request does not encode or the reply does not
/// decode as `Resp`; [`TypedError::Host`] with the [`CallError`] of [`call`].
pub fn call_typed<C, Req, Resp>(
    module: &str,
    key: &str,
    request: &Req,
    timeout: Duration,
) -> Result<Resp, TypedError<CallError>>
where
    C: Codec,
    Req: Serialize + ?Sized,
    Resp: DeserializeOwned,
{
    let request = C::encode(request).map_err(TypedError::Codec)?;
    let reply = call(module, key, &request, timeout).map_err(TypedError::Host)?;
    C::decode(&reply).map_err(TypedError::Codec)
}

/// [`cast`] with a message encoded by the codec `C`.
///
/// # Errors
///
/// [`TypedError::Codec`] if the message does not encode;
/// [`TypedError::Host`] with the [`EffectError`] of [`cast`].
pub fn cast_typed<C, Msg>(
    module: &str,
    key: &str,
    message: &Msg,
) -> Result<(), TypedError<EffectError>>
where
    C: Codec,
    Msg: Serialize + ?Sized,
{
    let message = C::encode(message).map_err(TypedError::Codec)?;
    cast(module, key, &message).map_err(TypedError::Host)
}

/// [`publish`] with a payload encoded by the codec `C`.
///
/// # Errors
///
/// [`TypedError::Codec`] if the payload does not encode;
/// [`TypedError::Host`] with the [`EffectError`] of [`publish`].
pub fn publish_typed<C, Msg>(topic: &str, payload: &Msg) -> Result<u32, TypedError<EffectError>>
where
    C: Codec,
    Msg: Serialize + ?Sized,
{
    let payload = C::encode(payload).map_err(TypedError::Codec)?;
    publish(topic, &payload).map_err(TypedError::Host)
}

/// Writes lines to the node's log, tagged by the node with this key's module
/// and name.
pub mod log {
    use crate::__private::bindings::fief::key::host as wit;
    use crate::LogLevel;

    /// Writes `message` at `level`.
    pub fn log(level: LogLevel, message: &str) {
        wit::log(level, message);
    }

    /// Writes `message` at trace level.
    pub fn trace(message: &str) {
        log(LogLevel::Trace, message);
    }

    /// Writes `message` at debug level.
    pub fn debug(message: &str) {
        log(LogLevel::Debug, message);
    }

    /// Writes `message` at info level.
    pub fn info(message: &str) {
        log(LogLevel::Info, message);
    }

    /// Writes `message` at warn level.
    pub fn warn(message: &str) {
        log(LogLevel::Warn, message);
    }

    /// Writes `message` at error level.
    pub fn error(message: &str) {
        log(LogLevel::Error, message);
    }
}

/// `duration` in whole milliseconds, rounded up.
fn millis_rounded_up(duration: Duration) -> u128 {
    let millis = duration.as_millis();
    if duration.subsec_nanos().is_multiple_of(1_000_000) {
        millis
    } else {
        millis + 1
    }
}

#[cfg(test)]
mod tests {
    //! The pure parts: unit conversions and the timer id's text form.

    use super::*;

    #[test]
    fn durations_round_up_to_whole_milliseconds() {
        assert_eq!(millis_rounded_up(Duration::ZERO), 0);
        assert_eq!(millis_rounded_up(Duration::from_nanos(1)), 1);
        assert_eq!(millis_rounded_up(Duration::from_millis(5)), 5);
        assert_eq!(millis_rounded_up(Duration::from_micros(5_001)), 6);
        assert_eq!(
            u32::try_from(millis_rounded_up(Duration::MAX)).unwrap_or(u32::MAX),
            u32::MAX
        );
    }

    #[test]
    fn timer_id_round_trips_as_text() {
        let id = TimerId::from_raw(42);
        assert_eq!(id.to_string(), "42");
        assert_eq!("42".parse::<TimerId>().unwrap(), id);
        assert!("x".parse::<TimerId>().is_err());
        let fired = TimerFired {
            id: 42,
            tag: b"t".to_vec(),
        };
        assert_eq!(fired.timer_id(), id);
    }
}
