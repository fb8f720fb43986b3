//! `room`: a chat room per key, built on pub/sub.
//!
//! Key `<name>` subscribes to the topic `room:<name>` when it starts and keeps
//! the last [`HISTORY`] payloads published there (by anyone, itself
//! included). Messages are UTF-8 text:
//!
//! | kind | message      | effect                                    | reply                        |
//! |------|--------------|-------------------------------------------|------------------------------|
//! | call | `get`        | none                                      | the kept messages, `\n`-joined |
//! | call | `say <text>` | publishes `<text>` to `room:<name>`       | how many subscribers got it  |
//!
//! A key does not record its own `say` directly: it is subscribed to its own
//! topic, so the publication comes back through `handle-info` like everyone
//! else's, in the order the node delivered them. Payloads that are not UTF-8
//! are kept with invalid bytes replaced (U+FFFD).
//!
//! A graceful handoff passes the kept messages to the next owner as a JSON
//! array of strings (the SDK's [`Json`] codec).

use std::collections::VecDeque;

use fief_guest::{Codec, Info, Json, Key, export_key, host};

/// How many publications a room keeps.
const HISTORY: usize = 16;

/// One room.
struct Room {
    /// The topic this room listens on: `room:<key>`.
    topic: String,
    /// The last [`HISTORY`] payloads, oldest first.
    messages: VecDeque<String>,
}

impl Room {
    /// Appends a message, forgetting the oldest past [`HISTORY`].
    fn remember(&mut self, message: String) {
        if self.messages.len() == HISTORY {
            self.messages.pop_front();
        }
        self.messages.push_back(message);
    }
}

impl Key for Room {
    fn init(key: &str, handoff: Option<Vec<u8>>) -> Result<Self, String> {
        let kept: Vec<String> = match handoff {
            None => Vec::new(),
            Some(state) => {
                Json::decode(&state).map_err(|error| format!("room: bad handoff state: {error}"))?
            }
        };
        let topic = format!("room:{key}");
        host::subscribe(&topic)
            .map_err(|error| format!("room: cannot subscribe to {topic}: {error}"))?;
        let mut room = Room {
            topic,
            messages: VecDeque::with_capacity(HISTORY),
        };
        for message in kept {
            room.remember(message);
        }
        Ok(room)
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let message = String::from_utf8_lossy(&message);
        if message == "get" {
            let joined = self.messages.iter().map(String::as_str).collect::<Vec<_>>();
            return Ok(joined.join("\n").into_bytes());
        }
        if let Some(text) = message.strip_prefix("say ") {
            let delivered = host::publish(&self.topic, text.as_bytes())
                .map_err(|error| format!("room: cannot publish: {error}"))?;
            return Ok(delivered.to_string().into_bytes());
        }
        Err(format!(
            "unknown message: {message}; expected get, say <text>"
        ))
    }

    fn handle_info(&mut self, info: Info) {
        if let Info::Published(publication) = info
            && publication.topic == self.topic
        {
            self.remember(String::from_utf8_lossy(&publication.payload).into_owned());
        }
    }

    fn handoff(&mut self) -> Option<Vec<u8>> {
        match Json::encode(&self.messages) {
            Ok(state) => Some(state),
            Err(error) => {
                // Strings always encode as JSON; if that ever breaks, start
                // the next owner empty rather than refusing the handoff.
                host::log::error(&format!("room: cannot encode handoff state: {error}"));
                None
            }
        }
    }
}

export_key!(Room);
