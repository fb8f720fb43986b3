//! The [`Key`] trait and the dispatch behind [`export_key!`](crate::export_key).
//!
//! This module owns the one-instance-per-key-process rule: the instance lives
//! in a [`Slot`] that `init` fills and `terminate` empties, and every other
//! lifecycle export borrows it. It does no I/O and calls no host import; it
//! only forwards the WIT lifecycle calls to the trait.
//!
//! Contract clause upheld: the node calls the lifecycle one call at a time, in
//! order, `init` first (`wit/key.wit`, `interface lifecycle`). A call that
//! breaks that order is a host bug, so it traps with a message naming the call
//! rather than being papered over.

#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::thread::LocalKey;

use crate::{FenceDecision, Info, StopReason};

/// The state of one key process: what a key module implements.
///
/// The node creates one value of this type per key process (through
/// [`Key::init`]), feeds it one message at a time, and drops it after
/// [`Key::terminate`]. Export the type with
/// [`export_key!`](crate::export_key).
///
/// Only `init` and `handle_call` are required; the other methods have
/// defaults that ignore the message, refuse to survive a fence, and hand off
/// no state.
pub trait Key: Sized + 'static {
    /// Starts the key process for `key`, before any message.
    ///
    /// `handoff` is what the previous owner's [`Key::handoff`] returned, if
    /// the key moved to this node gracefully; `None` on a fresh start.
    ///
    /// # Errors
    ///
    /// An error refuses the activation: the message that caused it fails with
    /// this text, and no instance is kept.
    fn init(key: &str, handoff: Option<Vec<u8>>) -> Result<Self, String>;

    /// Handles a request that wants a reply.
    ///
    /// # Errors
    ///
    /// An error is the reply: the caller sees it as `call-error.rejected`.
    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String>;

    /// Handles a one-way message. The default ignores it.
    fn handle_cast(&mut self, _message: Vec<u8>) {}

    /// Handles a fired timer or a publication on a subscribed topic. The
    /// default ignores it.
    fn handle_info(&mut self, _info: Info) {}

    /// Handles a durable alarm of this key that is due (set with
    /// [`crate::alarms::set`]). `attempt` is 1 the first time this node
    /// runs it, one more after each run that trapped (a panic) or whose
    /// commit did not land. Returning commits the callback's writes and
    /// deletes the alarm (unless it was set again here); panic to have it
    /// retried with backoff. The default does nothing (the alarm is
    /// deleted).
    fn handle_alarm(&mut self, _name: String, _attempt: u32) {}

    /// Handles something that happened to one of this key's WebSocket
    /// connections (`GET /v1/keys/{module}/{key}/connect`): answer with
    /// [`crate::connections`]. The default closes every connection that
    /// opens (code 1000, "this key takes no WebSocket connections") and
    /// ignores the rest: implement it to accept them.
    fn handle_connection(&mut self, event: crate::connections::Event) {
        if let crate::connections::Event::Opened { id, .. } = event {
            crate::connections::close(id, 1000, "this key takes no WebSocket connections");
        }
    }

    /// Decides what to do when this key's node fenced itself (only called for
    /// modules deployed with `on-fence = callback`); answer within
    /// `deadline_ms` milliseconds or the process is killed.
    ///
    /// The default stops the process with the reason `"fenced"`.
    fn handle_fence(&mut self, _deadline_ms: u32) -> FenceDecision {
        FenceDecision::Stop("fenced".into())
    }

    /// Returns the state the key's next owner receives in [`Key::init`],
    /// when the key moves to another node. The default hands off nothing.
    fn handoff(&mut self) -> Option<Vec<u8>> {
        None
    }

    /// Runs just before the process is stopped normally (not when it is
    /// killed). The instance is dropped right after. The default does nothing.
    fn terminate(&mut self, _reason: StopReason) {}
}

/// The thread-local slot holding a key process's one instance.
#[doc(hidden)]
pub struct Slot<K>(RefCell<Option<K>>);

impl<K> Slot<K> {
    /// An empty slot, for the `thread_local!` initializer.
    #[must_use]
    pub const fn new() -> Self {
        Self(RefCell::new(None))
    }
}

impl<K> Default for Slot<K> {
    fn default() -> Self {
        Self::new()
    }
}

/// Runs `f` on the instance, trapping if there is none.
fn with_instance<K: Key, R>(
    slot: &'static LocalKey<Slot<K>>,
    export: &str,
    f: impl FnOnce(&mut K) -> R,
) -> R {
    slot.with(|slot| {
        let mut instance = slot.0.borrow_mut();
        let Some(instance) = instance.as_mut() else {
            panic!(
                "fief-guest: lifecycle `{export}` called with no live key instance \
                 (before `init`, after a failed `init`, or after `terminate`)"
            );
        };
        f(instance)
    })
}

/// `lifecycle.init`: creates the instance.
#[doc(hidden)]
pub fn init<K: Key>(
    slot: &'static LocalKey<Slot<K>>,
    key: String,
    handoff_state: Option<Vec<u8>>,
) -> Result<(), String> {
    slot.with(|slot| {
        let mut instance = slot.0.borrow_mut();
        assert!(
            instance.is_none(),
            "fief-guest: lifecycle `init` called twice for key {key:?} without `terminate`"
        );
        *instance = Some(K::init(&key, handoff_state)?);
        Ok(())
    })
}

/// `lifecycle.handle-call`.
#[doc(hidden)]
pub fn handle_call<K: Key>(
    slot: &'static LocalKey<Slot<K>>,
    message: Vec<u8>,
) -> Result<Vec<u8>, String> {
    with_instance(slot, "handle-call", |key| key.handle_call(message))
}

/// `lifecycle.handle-cast`.
#[doc(hidden)]
pub fn handle_cast<K: Key>(slot: &'static LocalKey<Slot<K>>, message: Vec<u8>) {
    with_instance(slot, "handle-cast", |key| key.handle_cast(message));
}

/// `lifecycle.handle-info`.
#[doc(hidden)]
pub fn handle_info<K: Key>(slot: &'static LocalKey<Slot<K>>, info: Info) {
    with_instance(slot, "handle-info", |key| key.handle_info(info));
}

/// `alarm-handler.handle-alarm`.
#[doc(hidden)]
pub fn handle_alarm<K: Key>(slot: &'static LocalKey<Slot<K>>, name: String, attempt: u32) {
    with_instance(slot, "handle-alarm", |key| key.handle_alarm(name, attempt));
}

/// `connection-handler`'s functions, as one event.
#[doc(hidden)]
pub fn handle_connection<K: Key>(
    slot: &'static LocalKey<Slot<K>>,
    event: crate::connections::Event,
) {
    with_instance(slot, "connection-handler", |key| {
        key.handle_connection(event)
    });
}

/// `lifecycle.handle-fence`.
#[doc(hidden)]
pub fn handle_fence<K: Key>(slot: &'static LocalKey<Slot<K>>, deadline_ms: u32) -> FenceDecision {
    with_instance(slot, "handle-fence", |key| key.handle_fence(deadline_ms))
}

/// `lifecycle.handoff`.
#[doc(hidden)]
pub fn handoff<K: Key>(slot: &'static LocalKey<Slot<K>>) -> Option<Vec<u8>> {
    with_instance(slot, "handoff", K::handoff)
}

/// `lifecycle.terminate`: runs [`Key::terminate`], then drops the instance.
#[doc(hidden)]
pub fn terminate<K: Key>(slot: &'static LocalKey<Slot<K>>, reason: StopReason) {
    let instance = slot.with(|slot| slot.0.borrow_mut().take());
    let Some(mut instance) = instance else {
        panic!(
            "fief-guest: lifecycle `terminate` called with no live key instance \
             (before `init`, after a failed `init`, or after `terminate`)"
        );
    };
    instance.terminate(reason);
}

#[cfg(test)]
mod tests {
    //! The slot discipline, driven natively without a host.

    use super::*;

    struct Echo {
        terminated: bool,
    }

    impl Key for Echo {
        fn init(key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
            if key == "refuse" {
                return Err("refused".into());
            }
            Ok(Echo { terminated: false })
        }

        fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
            assert!(!self.terminated);
            Ok(message)
        }

        fn terminate(&mut self, _reason: StopReason) {
            self.terminated = true;
        }
    }

    thread_local! {
        static LIVE: Slot<Echo> = const { Slot::new() };
        static REFUSED: Slot<Echo> = const { Slot::new() };
        static DEAD: Slot<Echo> = const { Slot::new() };
    }

    #[test]
    fn init_then_calls_then_terminate() {
        init(&LIVE, "k".into(), None).unwrap();
        assert_eq!(handle_call(&LIVE, b"hi".to_vec()).unwrap(), b"hi");
        handle_cast(&LIVE, b"ignored".to_vec());
        assert_eq!(handoff(&LIVE), None);
        assert_eq!(
            handle_fence(&LIVE, 10),
            FenceDecision::Stop("fenced".into())
        );
        terminate(&LIVE, StopReason::Idle);
        assert!(LIVE.with(|slot| slot.0.borrow().is_none()));
    }

    #[test]
    fn failed_init_keeps_no_instance() {
        assert_eq!(init(&REFUSED, "refuse".into(), None), Err("refused".into()));
        assert!(REFUSED.with(|slot| slot.0.borrow().is_none()));
    }

    #[test]
    #[should_panic(expected = "no live key instance")]
    fn call_before_init_traps() {
        let _ = handle_call(&DEAD, Vec::new());
    }
}
