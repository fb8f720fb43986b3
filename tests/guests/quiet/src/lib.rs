//! `quiet`: a test guest for the fence-mode page's sanctioned pairing — a key
//! with external ingress that goes quiet at the fence (deploy it with
//! `on_fence = callback`).
//!
//! Key `<name>` subscribes to the topic `room:<name>` in `init`. In
//! `handle-fence` it unsubscribes, records `fence:<deadline-ms>` and answers
//! `continue`: it survives in limbo, readable through local handles, but no
//! publication reaches it any more.
//!
//! | command | reply                                                          |
//! |---------|----------------------------------------------------------------|
//! | `get`   | everything recorded, one per line, oldest first                |
//! | `state` | `subscribed` before the fence, `quiet` after `handle-fence`    |
//!
//! Recorded: each publication as `pub:<payload>`, and the fence as
//! `fence:<deadline-ms>`.

use fief_guest::{FenceDecision, Info, Key, export_key, host};

/// One quiet key.
struct Quiet {
    /// `room:<key>`.
    topic: String,
    /// Everything recorded, oldest first.
    received: Vec<String>,
    /// Whether `handle-fence` ran (the key unsubscribed).
    quiet: bool,
}

impl Key for Quiet {
    fn init(key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        let topic = format!("room:{key}");
        host::subscribe(&topic).map_err(|e| format!("quiet: cannot subscribe to {topic}: {e}"))?;
        Ok(Quiet {
            topic,
            received: Vec::new(),
            quiet: false,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        match message.as_slice() {
            b"get" => Ok(self.received.join("\n").into_bytes()),
            b"state" => Ok(if self.quiet { "quiet" } else { "subscribed" }
                .as_bytes()
                .to_vec()),
            other => Err(format!(
                "quiet: unknown command {:?}; expected get or state",
                String::from_utf8_lossy(other)
            )),
        }
    }

    fn handle_info(&mut self, info: Info) {
        if let Info::Published(publication) = info {
            self.received.push(format!(
                "pub:{}",
                String::from_utf8_lossy(&publication.payload)
            ));
        }
    }

    fn handle_fence(&mut self, deadline_ms: u32) -> FenceDecision {
        host::unsubscribe(&self.topic);
        self.quiet = true;
        self.received.push(format!("fence:{deadline_ms}"));
        FenceDecision::Continue
    }
}

export_key!(Quiet);
