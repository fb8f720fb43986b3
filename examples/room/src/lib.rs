//! `room`: chat rooms on pub/sub, one member per key.
//!
//! Key `<room>/<member>` is one member's view of the room `<room>` (the part
//! of the key before its first `/`); a key with no `/` is in the room of its
//! own name (`lobby` is in the room `lobby`, with `lobby/ann` and
//! `lobby/bob`). When it starts, a key subscribes to the topic
//! `room:<room>` and keeps the last [`HISTORY`] payloads published there (by
//! any member, itself included). Messages are UTF-8 text:
//!
//! | kind | message      | effect                              | reply                                   |
//! |------|--------------|-------------------------------------|-----------------------------------------|
//! | call | `get`        | none                                | the kept messages, `\n`-joined          |
//! | call | `say <text>` | publishes `<text>` to `room:<room>` | how many subscribers it reached (below) |
//!
//! The members may live on any nodes of the cluster: a publication reaches
//! the room's members on the speaker's node and is forwarded once to each
//! other node with members, which gives it to its own. So `say`'s count is
//! the members on this node that got it plus those each other node last
//! said it had (a member that joined on another node a moment ago may not be
//! counted, nor hear it, yet). Delivery is best effort: a member may miss a
//! message, never get one twice.
//!
//! A key does not record its own `say` directly: it is subscribed to its
//! room's topic, so the publication comes back through `handle-info` like
//! everyone else's, in the order the node delivered them. Payloads that are
//! not UTF-8 are kept with invalid bytes replaced (U+FFFD).
//!
//! A graceful handoff passes the kept messages to the next owner as a JSON
//! array of strings (the SDK's [`Json`] codec).
//!
//! Over HTTP, the `/` of a member's key is percent-encoded in the path
//! (`POST /v1/keys/room/lobby%2Fann/call`); `fief call room lobby/ann get`
//! does that itself.

use std::collections::VecDeque;

use fief_guest::{Codec, Info, Json, Key, export_key, host};

/// How many publications a room keeps.
const HISTORY: usize = 16;

/// One member's view of a room.
struct Room {
    /// The topic of the room: `room:<room>` ([`room_of`]).
    topic: String,
    /// The last [`HISTORY`] payloads, oldest first.
    messages: VecDeque<String>,
}

/// The room a key is a member of: the part before its first `/`, or the
/// whole key if it has none.
fn room_of(key: &str) -> &str {
    key.split_once('/').map_or(key, |(room, _member)| room)
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
        let topic = format!("room:{}", room_of(key));
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
