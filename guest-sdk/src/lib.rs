//! `fief-guest`: write a Fief key module in plain Rust.
//!
//! A *key module* is a WebAssembly component implementing the WIT world
//! `fief:key/key-module-realtime@0.1.0` (`wit/key.wit`: `key-module`, which
//! the node requires, plus the optional `alarm-handler` export that lets its
//! keys be woken by durable alarms and the optional `connection-handler`
//! export that lets clients hold WebSocket connections to them). The node starts one instance
//! of it per live key (a *key process*), hands it one message at a time, and
//! grants it effects only through the `host` interface. This crate hides the
//! WIT plumbing:
//!
//! - implement [`Key`] for your state type;
//! - export it once with [`export_key!`];
//! - reach the node through [`host`] (timers, pub/sub, calls to other keys,
//!   logging), keep durable state with [`storage`], be woken at a time
//!   you choose with [`alarms`] (and [`Key::handle_alarm`]), talk to
//!   WebSocket clients with [`connections`] (and [`Key::handle_connection`]),
//!   and encode
//!   typed messages with [`codec`].
//!
//! The crate owns the guest side of the contract only: it never decides
//! anything about ownership or fencing; it forwards. It upholds one rule of the
//! contract itself: a key process holds exactly one instance of the key type,
//! created by `init` and dropped by `terminate`; any lifecycle call outside
//! that window traps, because it means the host broke the contract.
//!
//! # Example
//!
//! A complete key module (its crate has `crate-type = ["cdylib"]` and depends
//! only on `fief-guest`):
//!
//! ```no_run
//! use fief_guest::{Key, export_key, host};
//!
//! /// Counts `incr` calls; the count survives a graceful handoff.
//! struct Hits(u64);
//!
//! impl Key for Hits {
//!     fn init(_key: &str, handoff: Option<Vec<u8>>) -> Result<Self, String> {
//!         let text = handoff.map(String::from_utf8).transpose().map_err(|e| e.to_string())?;
//!         let hits = text.as_deref().unwrap_or("0").parse().map_err(|_| "bad state")?;
//!         Ok(Hits(hits))
//!     }
//!
//!     fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
//!         match message.as_slice() {
//!             b"incr" => self.0 += 1,
//!             b"get" => {}
//!             _ => return Err("expected incr or get".into()),
//!         }
//!         host::log::debug(&format!("{} hits on {}", self.0, host::self_key()));
//!         Ok(self.0.to_string().into_bytes())
//!     }
//!
//!     fn handoff(&mut self) -> Option<Vec<u8>> {
//!         Some(self.0.to_string().into_bytes())
//!     }
//! }
//!
//! export_key!(Hits);
//! ```
//!
//! # Building
//!
//! ```text
//! cargo build --release --target wasm32-wasip2 -p <your-module>
//! ```
//!
//! The output, `target/wasm32-wasip2/release/<your_module>.wasm`, is already a
//! component: deploy it as is. The crate also compiles for the build machine
//! (so `cargo test` can run codec tests natively), but there every host import
//! is a stub that panics with `unreachable`.
//!
//! # Memory footprint
//!
//! The workspace's `.cargo/config.toml` links every `wasm32-wasip2` guest with
//! `-zstack-size=65536`: a 64 KiB stack instead of Rust's default 1 MiB. The
//! allocator is the target's default, wasi-libc's `dlmalloc`, which grows
//! linear memory on demand. rustc places the stack first in linear memory, so
//! a guest that overflows it traps (the node kills that one key) instead of
//! corrupting its data.
//!
//! Measured on the `counter` example: its initial linear memory is 2 pages
//! (128 KiB; the heap starts at byte 73,840, after the 64 KiB stack and about
//! 8 KiB of static data), against 17 pages (1.06 MiB) with the default stack.
//! A module that needs deep recursion can raise `-zstack-size` for itself.
//!
//! # Unsafe code
//!
//! The only `unsafe` code is what `wit_bindgen::generate!` emits for the
//! canonical ABI (in `__private::bindings`, allowed there and nowhere else) and
//! the export glue that [`export_key!`] expands into the module crate.

// `wit_bindgen::generate!` emits paths starting with `::fief_guest` (see
// `runtime_path` and `default_bindings_module` below) so that the export macro
// works from other crates; this alias makes those paths resolve here too.
extern crate self as fief_guest;

pub mod alarms;
pub mod cache;
pub mod codec;
pub mod connections;
pub mod host;
mod key;
mod read_cache;
pub mod storage;

pub use codec::{Binary, Codec, CodecError, Json};
pub use host::TimerId;
pub use key::Key;
/// Serde, re-exported so that key modules can derive messages without their
/// own dependency: use `#[serde(crate = "fief_guest::serde")]` on the type.
pub use serde;
pub use storage::StorageError;

pub use __private::bindings::fief::key::types::{
    CacheEntry, CacheError, CallError, EffectError, FenceDecision, Info, LogLevel, Publication,
    StopReason, TimerFired,
};

/// Exports a [`Key`] implementation as this crate's key module.
///
/// Call it exactly once, at the top level of the module crate (a `cdylib`),
/// with the type that implements [`Key`]:
///
/// ```ignore
/// fief_guest::export_key!(MyKey);
/// ```
///
/// It wires the WIT `lifecycle` exports to one instance of the type, kept in a
/// thread-local slot: `init` fills the slot, every other export borrows it,
/// and `terminate` empties it (dropping the instance after
/// [`Key::terminate`]).
///
/// # Panics
///
/// The generated exports panic (the key process traps) if the host calls
/// anything but `init` while the slot is empty (before `init`, after a failed
/// `init`, or after `terminate`), or calls `init` while the slot is full.
#[macro_export]
macro_rules! export_key {
    ($key:ty) => {
        const _: () = {
            $crate::__private::thread_local! {
                static FIEF_KEY_INSTANCE: $crate::__private::Slot<$key> =
                    const { $crate::__private::Slot::new() };
            }

            struct FiefKeyExport;

            impl $crate::__private::Guest for FiefKeyExport {
                fn init(
                    key: $crate::__private::String,
                    handoff_state: $crate::__private::Option<$crate::__private::Vec<u8>>,
                ) -> $crate::__private::Result<(), $crate::__private::String> {
                    $crate::__private::init::<$key>(&FIEF_KEY_INSTANCE, key, handoff_state)
                }

                fn handle_call(
                    message: $crate::__private::Vec<u8>,
                ) -> $crate::__private::Result<
                    $crate::__private::Vec<u8>,
                    $crate::__private::String,
                > {
                    $crate::__private::handle_call::<$key>(&FIEF_KEY_INSTANCE, message)
                }

                fn handle_cast(message: $crate::__private::Vec<u8>) {
                    $crate::__private::handle_cast::<$key>(&FIEF_KEY_INSTANCE, message)
                }

                fn handle_info(info: $crate::Info) {
                    $crate::__private::handle_info::<$key>(&FIEF_KEY_INSTANCE, info)
                }

                fn handle_fence(deadline_ms: u32) -> $crate::FenceDecision {
                    $crate::__private::handle_fence::<$key>(&FIEF_KEY_INSTANCE, deadline_ms)
                }

                fn handoff() -> $crate::__private::Option<$crate::__private::Vec<u8>> {
                    $crate::__private::handoff::<$key>(&FIEF_KEY_INSTANCE)
                }

                fn terminate(reason: $crate::StopReason) {
                    $crate::__private::terminate::<$key>(&FIEF_KEY_INSTANCE, reason)
                }
            }

            impl $crate::__private::AlarmGuest for FiefKeyExport {
                fn handle_alarm(name: $crate::__private::String, attempt: u32) {
                    $crate::__private::handle_alarm::<$key>(&FIEF_KEY_INSTANCE, name, attempt)
                }
            }

            impl $crate::__private::ConnectionGuest for FiefKeyExport {
                fn connection_opened(id: u64, resumed: bool) {
                    $crate::__private::handle_connection::<$key>(
                        &FIEF_KEY_INSTANCE,
                        $crate::connections::Event::Opened { id, resumed },
                    )
                }

                fn connection_text(id: u64, text: $crate::__private::String) {
                    $crate::__private::handle_connection::<$key>(
                        &FIEF_KEY_INSTANCE,
                        $crate::connections::Event::Text { id, text },
                    )
                }

                fn connection_binary(id: u64, data: $crate::__private::Vec<u8>) {
                    $crate::__private::handle_connection::<$key>(
                        &FIEF_KEY_INSTANCE,
                        $crate::connections::Event::Binary { id, data },
                    )
                }

                fn connection_closed(id: u64, code: u16, reason: $crate::__private::String) {
                    $crate::__private::handle_connection::<$key>(
                        &FIEF_KEY_INSTANCE,
                        $crate::connections::Event::Closed { id, code, reason },
                    )
                }
            }

            $crate::__private::bindings::__export_key_module!(
                FiefKeyExport with_types_in $crate::__private::bindings
            );
        };
    };
}

/// Implementation details of [`export_key!`]; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::key::{
        Slot, handle_alarm, handle_call, handle_cast, handle_connection, handle_fence, handle_info,
        handoff, init, terminate,
    };
    pub use bindings::exports::fief::key::alarm_handler::Guest as AlarmGuest;
    pub use bindings::exports::fief::key::connection_handler::Guest as ConnectionGuest;
    pub use bindings::exports::fief::key::lifecycle::Guest;
    pub use std::option::Option;
    pub use std::result::Result;
    pub use std::string::String;
    pub use std::thread_local;
    pub use std::vec::Vec;
    pub use wit_bindgen;

    /// The bindings `wit_bindgen::generate!` writes for `wit/key.wit`.
    // The canonical ABI glue that wit-bindgen generates (lifting and lowering
    // through raw pointers, `extern "C"` imports and exports) cannot be written
    // without `unsafe`; this module holds that generated code and nothing else,
    // so the allowance stays this narrow.
    #[allow(unsafe_code, reason = "wit-bindgen's generated export glue")]
    pub mod bindings {
        wit_bindgen::generate!({
            path: "../wit",
            world: "key-module-realtime",
            // The export macro must be callable from the module crate, where
            // neither `wit_bindgen` nor these bindings are in scope by name.
            pub_export_macro: true,
            export_macro_name: "__export_key_module",
            default_bindings_module: "::fief_guest::__private::bindings",
            runtime_path: "::fief_guest::__private::wit_bindgen::rt",
            additional_derives: [PartialEq, Eq],
        });
    }
}
