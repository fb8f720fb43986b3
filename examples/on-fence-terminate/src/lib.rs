//! `on-fence-terminate`: a session counter, for `on_fence = terminate` (the
//! default mode; see `docs/fencing.md`).
//!
//! Why this mode: a session acts. Every `touch` re-arms an expiry timer, and
//! when the session expires it *publishes* `expired <session>` on the topic
//! `sessions` for whoever cleans up after sessions. That publication, like
//! the timer behind it, must happen on at most one node: under `terminate`
//! the process is killed at its node's fence point, before any other node may
//! start serving the session, and every effect it still tries after the fence
//! point is refused by the host. So there is never a second live counter for
//! one session, nor a second expiry. The count is not persisted: it dies with
//! the process (after a fence or a crash, the session starts again from 0).
//!
//! Deploy it with the default options:
//!
//! ```text
//! cargo build --release --target wasm32-wasip2 -p on-fence-terminate
//! fief deploy target/wasm32-wasip2/release/on_fence_terminate.wasm --module sessions
//! ```
//!
//! Messages are UTF-8 text:
//!
//! | kind | message | effect                                          | reply                 |
//! |------|---------|-------------------------------------------------|-----------------------|
//! | call | `touch` | counts one request, re-arms the expiry timer    | the new count         |
//! | call | `get`   | none                                            | the count             |
//!
//! A session expires [`SESSION_IDLE`] after its last `touch`: it publishes
//! `expired <session>` on [`EXPIRY_TOPIC`] and starts again from 0.

use core::time::Duration;

use fief_guest::{Info, Key, TimerId, export_key, host};

/// How long a session lives after its last `touch`.
const SESSION_IDLE: Duration = Duration::from_secs(30 * 60);
/// Where expiries are announced.
const EXPIRY_TOPIC: &str = "sessions";
/// The tag of the expiry timer.
const EXPIRY_TAG: &[u8] = b"expire";

/// One session.
struct Session {
    /// The session id (the key).
    id: String,
    /// Requests counted since the session started.
    count: u64,
    /// The armed expiry timer.
    expiry: Option<TimerId>,
}

impl Session {
    /// Re-arms the expiry timer for [`SESSION_IDLE`] from now.
    fn rearm(&mut self) {
        if let Some(timer) = self.expiry.take() {
            host::cancel_timer(timer);
        }
        match host::send_after(SESSION_IDLE, EXPIRY_TAG) {
            Ok(timer) => self.expiry = Some(timer),
            Err(error) => host::log::warn(&format!(
                "sessions: cannot arm the expiry of {}: {error}",
                self.id
            )),
        }
    }
}

impl Key for Session {
    fn init(key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        Ok(Session {
            id: key.to_owned(),
            count: 0,
            expiry: None,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        match message.as_slice() {
            b"touch" => {
                self.count += 1;
                self.rearm();
            }
            b"get" => {}
            other => {
                return Err(format!(
                    "sessions: unknown message {:?}; expected touch or get",
                    String::from_utf8_lossy(other)
                ));
            }
        }
        Ok(self.count.to_string().into_bytes())
    }

    fn handle_info(&mut self, info: Info) {
        let Info::Timer(fired) = info else { return };
        if Some(fired.timer_id()) != self.expiry {
            // A timer cancelled just after it fired: stale.
            return;
        }
        self.expiry = None;
        self.count = 0;
        let announcement = format!("expired {}", self.id);
        if let Err(error) = host::publish(EXPIRY_TOPIC, announcement.as_bytes()) {
            host::log::warn(&format!(
                "sessions: cannot announce {announcement}: {error}"
            ));
        }
    }
}

export_key!(Session);
