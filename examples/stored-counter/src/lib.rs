//! `stored-counter`: one durable number per key, kept in the key's storage
//! as decimal text.
//!
//! Messages are UTF-8 text:
//!
//! | kind | message | effect                      | reply     |
//! |------|---------|-----------------------------|-----------|
//! | call | `incr`  | adds one                    | new value |
//! | call | `get`   | none                        | value     |
//! | call | `reset` | removes the value (back to 0) | `0`     |
//!
//! Unlike `counter` (whose value lives in the process and dies with it),
//! the value is in `fief:key/storage`: `incr` answers only once the new
//! value is committed, so an answered `incr` survives a crash, a fence, an
//! idle stop, a move and a restart of the node (with durable storage: a
//! `data_dir`, or PostgreSQL). No handoff state is needed: the next process
//! loads the value.
//!
//! The count is read and written as text rather than with the SDK's `Json`
//! codec (the stored bytes are the same): serde_json's code brings about
//! 29 KiB of static data, which every live key maps (docs/guests.md,
//! "Memory per live key").

use fief_guest::{Key, export_key, storage};

/// The name the value is stored under.
const COUNT: &str = "count";

/// One key's counter: nothing in memory but what storage holds.
struct StoredCounter;

impl StoredCounter {
    fn value() -> Result<u64, String> {
        let Some(bytes) = storage::get(COUNT)
            .map_err(|e| format!("stored-counter: cannot read the count: {e}"))?
        else {
            return Ok(0);
        };
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.parse().ok())
            .ok_or_else(|| {
                format!(
                    "stored-counter: the stored count {:?} is not a number",
                    String::from_utf8_lossy(&bytes)
                )
            })
    }
}

impl Key for StoredCounter {
    fn init(_key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        Ok(StoredCounter)
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let value = match message.as_slice() {
            b"incr" => {
                let value = Self::value()? + 1;
                storage::put(COUNT, value.to_string().as_bytes())
                    .map_err(|e| format!("stored-counter: cannot store the count: {e}"))?;
                value
            }
            b"get" => Self::value()?,
            b"reset" => {
                storage::delete(COUNT)
                    .map_err(|e| format!("stored-counter: cannot reset the count: {e}"))?;
                0
            }
            other => {
                return Err(format!(
                    "stored-counter: unknown message {:?}; expected incr, get or reset",
                    String::from_utf8_lossy(other)
                ));
            }
        };
        Ok(value.to_string().into_bytes())
    }
}

export_key!(StoredCounter);
