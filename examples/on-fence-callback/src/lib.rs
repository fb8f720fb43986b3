//! `on-fence-callback`: a chat room that goes quiet at the fence, for
//! `on_fence = callback` (see `docs/fencing.md`).
//!
//! Why this mode: a room has external ingress — it subscribes to the topic
//! `room:<name>` in `init` and acts on every publication. Under `continue` a
//! survivor would keep doing so after its node fenced, while a new owner
//! elsewhere serves the same room: the split-brain actor the fence-mode page
//! warns about. Under `terminate` the room's history would be lost at every
//! fence. `callback` is the sanctioned middle: in `handle_fence` the room
//! unsubscribes and demotes itself to read-only, then answers `continue`. It
//! survives in limbo with its history warm for local readers (through
//! `Instance::call_local_handle`), but nothing reaches it from outside any
//! more and it refuses to publish.
//!
//! `handle_fence` runs under a deadline (the module's
//! `handle_fence_deadline`, 50 ms by default). The deadline is advisory, the
//! fence is not: a room that overran it would be killed, so it only does two
//! cheap things there.
//!
//! ```text
//! cargo build --release --target wasm32-wasip2 -p on-fence-callback
//! fief deploy target/wasm32-wasip2/release/on_fence_callback.wasm --module room \
//!     -o on_fence=callback -o handle_fence_deadline=50ms
//! ```
//!
//! Messages are UTF-8 text:
//!
//! | kind | message      | effect                                  | reply                                  |
//! |------|--------------|-----------------------------------------|----------------------------------------|
//! | call | `get`        | none                                    | the kept messages, `\n`-joined         |
//! | call | `say <text>` | publishes `<text>` to `room:<name>`     | how many got it; an error if read-only |
//! | call | `mode`       | none                                    | `live`, or `read-only` after the fence |

use std::collections::VecDeque;

use fief_guest::{FenceDecision, Info, Key, export_key, host};

/// How many publications a room keeps.
const HISTORY: usize = 32;

/// One room.
struct Room {
    /// The topic this room listens on: `room:<key>`.
    topic: String,
    /// The last [`HISTORY`] payloads, oldest first.
    messages: VecDeque<String>,
    /// Set in `handle_fence`: unsubscribed, publishes nothing.
    read_only: bool,
}

impl Key for Room {
    fn init(key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        let topic = format!("room:{key}");
        host::subscribe(&topic).map_err(|e| format!("room: cannot subscribe to {topic}: {e}"))?;
        Ok(Room {
            topic,
            messages: VecDeque::with_capacity(HISTORY),
            read_only: false,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let message = String::from_utf8_lossy(&message);
        if message == "get" {
            let kept: Vec<&str> = self.messages.iter().map(String::as_str).collect();
            return Ok(kept.join("\n").into_bytes());
        }
        if message == "mode" {
            let mode = if self.read_only { "read-only" } else { "live" };
            return Ok(mode.as_bytes().to_vec());
        }
        if let Some(text) = message.strip_prefix("say ") {
            if self.read_only {
                return Err("room: read-only: this process survived a fence".to_owned());
            }
            let delivered = host::publish(&self.topic, text.as_bytes())
                .map_err(|e| format!("room: cannot publish: {e}"))?;
            return Ok(delivered.to_string().into_bytes());
        }
        Err(format!(
            "room: unknown message {message:?}; expected get, say <text> or mode"
        ))
    }

    fn handle_info(&mut self, info: Info) {
        // After the fence nothing arrives (unsubscribed, no timers); the
        // check keeps a publication already queued at the fence out too.
        if self.read_only {
            return;
        }
        if let Info::Published(publication) = info
            && publication.topic == self.topic
        {
            if self.messages.len() == HISTORY {
                self.messages.pop_front();
            }
            self.messages
                .push_back(String::from_utf8_lossy(&publication.payload).into_owned());
        }
    }

    fn handle_fence(&mut self, _deadline_ms: u32) -> FenceDecision {
        host::unsubscribe(&self.topic);
        self.read_only = true;
        FenceDecision::Continue
    }
}

export_key!(Room);
