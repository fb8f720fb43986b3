//! This key's WebSocket connections, from inside the key
//! (`docs/realtime.md`).
//!
//! A client connects with `GET /v1/keys/{module}/{key}/connect` on any node;
//! the key hears of it through [`Key::handle_connection`](crate::Key::handle_connection)
//! ([`Event::Opened`], then each frame, then [`Event::Closed`]) and answers
//! with [`send_text`], [`send_binary`] and [`close`]. A connection belongs to
//! the key, not to one process: it survives the key's eviction and a
//! graceful move (the next process sees it opened again, `resumed`), and
//! [`list`] names the open ones.
//!
//! ```ignore
//! use fief_guest::connections::{self, Event};
//!
//! fn handle_connection(&mut self, event: Event) {
//!     if let Event::Text { id, text } = event {
//!         let _ = connections::send_text(id, &text); // echo
//!     }
//! }
//! ```
//!
//! This module forwards to the `fief:key/connections` imports; it decides
//! nothing.

use crate::__private::bindings::fief::key::connections as wit;
use crate::EffectError;

/// What happened to one of this key's connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Connection `id` is attached to this key: a client connected
    /// (`resumed` false), or a connection opened earlier is handed to this
    /// process (after an eviction, a graceful move or an owner's failure).
    Opened {
        /// The connection.
        id: u64,
        /// Whether it was open before this process.
        resumed: bool,
    },
    /// A text frame from the client.
    Text {
        /// The connection.
        id: u64,
        /// The frame.
        text: String,
    },
    /// A binary frame from the client.
    Binary {
        /// The connection.
        id: u64,
        /// The frame.
        data: Vec<u8>,
    },
    /// The connection closed (by its client, by this key, or at a limit).
    Closed {
        /// The connection.
        id: u64,
        /// The close code.
        code: u16,
        /// The close reason.
        reason: String,
    },
}

/// Sends a text frame to connection `id`.
///
/// # Errors
///
/// [`EffectError::Invalid`] for a connection this key does not have,
/// [`EffectError::Limit`] past `max_message_size`, [`EffectError::Overloaded`]
/// if the connection's queue is full.
pub fn send_text(id: u64, text: &str) -> Result<(), EffectError> {
    wit::send_text(id, text)
}

/// Sends a binary frame to connection `id`.
///
/// # Errors
///
/// As [`send_text`].
pub fn send_binary(id: u64, data: &[u8]) -> Result<(), EffectError> {
    wit::send_binary(id, data)
}

/// Closes connection `id` with `code` (1000, or 3000 to 4999; any other is
/// sent as 1000) and `reason` (cut to 123 bytes). No effect on a connection
/// this key does not have.
pub fn close(id: u64, code: u16, reason: &str) {
    wit::close(id, code, reason);
}

/// The ids of this key's open connections, in the order they opened.
#[must_use]
pub fn list() -> Vec<u64> {
    wit::list_connections()
}
