//! `legacy`: a key module built against the frozen `fief:key@0.1.0` WIT
//! (`wit/key.wit` in this crate, a copy of the package as it was
//! before `storage` was added), without the SDK, so the tests can show that a
//! node still deploys and runs what was built for 0.1.0.
//!
//! It counts: `incr` adds one and answers the new value, `get` answers it,
//! anything else is refused. A graceful handoff carries the value. It owns
//! nothing but its count.

// wit-bindgen's generated glue (the bindings and the `export!` expansion)
// is `unsafe`; this crate has no other code that could be.
#![allow(unsafe_code, reason = "wit-bindgen's generated export glue")]

mod bindings {
    wit_bindgen::generate!({ path: "wit", world: "key-module" });
}

use std::cell::Cell;

use bindings::exports::fief::key::lifecycle::{FenceDecision, Guest, Info, StopReason};
use bindings::fief::key::host;

thread_local! {
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

struct Legacy;

impl Guest for Legacy {
    fn init(_key: String, handoff_state: Option<Vec<u8>>) -> Result<(), String> {
        let count = match handoff_state {
            None => 0,
            Some(state) => String::from_utf8_lossy(&state)
                .parse()
                .map_err(|_| "legacy: the handoff state is not a number".to_owned())?,
        };
        COUNT.set(count);
        Ok(())
    }

    fn handle_call(message: Vec<u8>) -> Result<Vec<u8>, String> {
        match message.as_slice() {
            b"incr" => COUNT.set(COUNT.get() + 1),
            b"get" => {}
            b"whoami" => {
                return Ok(format!("{}/{}", host::self_module(), host::self_key()).into_bytes());
            }
            _ => return Err("legacy: expected incr, get or whoami".to_owned()),
        }
        Ok(COUNT.get().to_string().into_bytes())
    }

    fn handle_cast(_message: Vec<u8>) {}

    fn handle_info(_info: Info) {}

    fn handle_fence(_deadline_ms: u32) -> FenceDecision {
        FenceDecision::Stop("legacy: stops at a fence".to_owned())
    }

    fn handoff() -> Option<Vec<u8>> {
        Some(COUNT.get().to_string().into_bytes())
    }

    fn terminate(_reason: StopReason) {}
}

bindings::export!(Legacy with_types_in bindings);
