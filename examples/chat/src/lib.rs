//! `chat`: a chat room per key, over WebSocket connections.
//!
//! Clients connect to `GET /v1/keys/chat/<room>/connect` on any node of the
//! cluster. Every text frame a client sends is a message: the room keeps it
//! (durably, in the key's storage) and sends it to every connection of the
//! room, the sender's included, as a text frame. A client that connects gets
//! the kept history first, one frame per message. Over HTTP:
//!
//! | kind | message      | effect                                      | reply                                |
//! |------|--------------|---------------------------------------------|--------------------------------------|
//! | call | `history`    | none                                        | the kept messages, `\n`-joined       |
//! | call | `connections`| none                                        | how many connections the room has    |
//! | call | `say <text>` | as if a client had sent `<text>`            | how many connections it was sent to  |
//!
//! The room keeps its last [`HISTORY`] messages under the storage entry
//! `history` (a JSON array), so the history survives the key's eviction, a
//! move and a crash of its owner; the connections survive eviction and a
//! graceful move (the node that accepted each holds it). A message is sent
//! to each connection once, in the order the room took them.

use std::collections::VecDeque;

use fief_guest::connections::{self, Event};
use fief_guest::storage;
use fief_guest::{Json, Key, export_key, host};

/// How many messages a room keeps.
const HISTORY: usize = 100;

/// The storage entry holding the history.
const ENTRY: &str = "history";

/// One room.
struct Room {
    /// The last [`HISTORY`] messages, oldest first.
    history: VecDeque<String>,
}

impl Room {
    /// Keep `text` and send it to every connection; returns how many it
    /// was sent to.
    fn say(&mut self, text: String) -> Result<usize, String> {
        if self.history.len() == HISTORY {
            self.history.pop_front();
        }
        self.history.push_back(text.clone());
        storage::put_as::<Json, _>(ENTRY, &self.history)
            .map_err(|e| format!("chat: cannot keep the message: {e}"))?;
        let mut sent = 0;
        for id in connections::list() {
            match connections::send_text(id, &text) {
                Ok(()) => sent += 1,
                Err(e) => host::log::warn(&format!("chat: connection {id} missed a message: {e}")),
            }
        }
        Ok(sent)
    }
}

impl Key for Room {
    fn init(_key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        let history = storage::get_as::<Json, VecDeque<String>>(ENTRY)
            .map_err(|e| format!("chat: cannot read the history: {e}"))?
            .unwrap_or_default();
        Ok(Room { history })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let message = String::from_utf8_lossy(&message);
        let reply = match message.as_ref() {
            "history" => self
                .history
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join("\n"),
            "connections" => connections::list().len().to_string(),
            other => match other.strip_prefix("say ") {
                Some(text) => self.say(text.to_owned())?.to_string(),
                None => {
                    return Err(format!(
                        "unknown message: {other}; expected history, connections, say <text>"
                    ));
                }
            },
        };
        Ok(reply.into_bytes())
    }

    fn handle_connection(&mut self, event: Event) {
        match event {
            Event::Opened { id, resumed: false } => {
                for message in &self.history {
                    if connections::send_text(id, message).is_err() {
                        break;
                    }
                }
            }
            Event::Text { text, .. } => {
                if let Err(e) = self.say(text) {
                    host::log::error(&e);
                }
            }
            Event::Binary { id, .. } => connections::close(id, 4000, "chat: text frames only"),
            Event::Opened { resumed: true, .. } | Event::Closed { .. } => {}
        }
    }
}

export_key!(Room);
