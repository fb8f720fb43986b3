//! `on-fence-continue`: a read-mostly look-aside cache, for
//! `on_fence = continue` (see `docs/fencing.md`).
//!
//! Why this mode: a stale survivor of this module is harmless by
//! construction. The authoritative data lives elsewhere (the caller fills the
//! cache with `put` after reading it from its database), and the cache has no
//! effects at all: it arms no timer, subscribes to nothing, publishes
//! nothing, calls no other key and writes nowhere. When its node fences, the
//! entry survives in limbo instead of being killed: routed calls to it are
//! refused like every routed call to a fenced node, but code on the same node
//! holding a *local handle* (`Instance::call_local_handle`) can still read
//! the possibly stale value. What the mode forfeits (guarantee 1: a new owner
//! elsewhere may serve the same key while the survivor lives) costs nothing
//! here, because two read-only copies of a cache entry cannot disagree in
//! anything that matters.
//!
//! Do not copy this mode into a module that acts: a survivor keeps its timers
//! and subscriptions, and keeps acting on them after the fence. Such a module
//! wants `callback` (go quiet at the fence) or `terminate`.
//!
//! ```text
//! cargo build --release --target wasm32-wasip2 -p on-fence-continue
//! fief deploy target/wasm32-wasip2/release/on_fence_continue.wasm --module cache -o on_fence=continue
//! ```
//!
//! Messages are UTF-8 text:
//!
//! | kind | message       | effect                      | reply                                   |
//! |------|---------------|-----------------------------|-----------------------------------------|
//! | call | `put <value>` | stores `<value>`            | `ok`                                    |
//! | call | `get`         | counts a read               | `hit <value>`, or `miss`                |
//! | call | `stats`       | none                        | `reads <n> hits <n> writes <n>`         |

use fief_guest::{Key, export_key};

/// One cached entry.
struct Entry {
    /// The cached value, once filled.
    value: Option<String>,
    /// Reads served.
    reads: u64,
    /// Reads that found a value.
    hits: u64,
    /// Values stored.
    writes: u64,
}

impl Key for Entry {
    fn init(_key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        Ok(Entry {
            value: None,
            reads: 0,
            hits: 0,
            writes: 0,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let message = String::from_utf8_lossy(&message);
        let reply = if let Some(value) = message.strip_prefix("put ") {
            self.value = Some(value.to_owned());
            self.writes += 1;
            "ok".to_owned()
        } else if message == "get" {
            self.reads += 1;
            match &self.value {
                Some(value) => {
                    self.hits += 1;
                    format!("hit {value}")
                }
                None => "miss".to_owned(),
            }
        } else if message == "stats" {
            format!(
                "reads {} hits {} writes {}",
                self.reads, self.hits, self.writes
            )
        } else {
            return Err(format!(
                "cache: unknown message {message:?}; expected put <value>, get or stats"
            ));
        };
        Ok(reply.into_bytes())
    }
}

export_key!(Entry);
