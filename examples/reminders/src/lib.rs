//! `reminders`: durable alarms (`fief:key/alarms`) and what they did, kept
//! in the key's storage.
//!
//! Messages are UTF-8 text:
//!
//! | kind | message | effect | reply |
//! |------|---------|--------|-------|
//! | call | `set <name> <delay-ms>` | sets alarm `name` to fire `delay-ms` from now | its time, ms since the Unix epoch |
//! | call | `set-at <name> <at-ms>` | sets alarm `name` to fire at `at-ms` | `ok` |
//! | call | `cancel <name>` | cancels alarm `name` | `true` or `false` |
//! | call | `alarms` | none | `name=at` per line, sorted by name |
//! | call | `fired` | none | one line per handled firing: `name attempt fired-at-ms` |
//!
//! When an alarm is due, `handle_alarm` appends `name attempt now` to the
//! `fired` log (in storage, committed with the alarm's deletion). An alarm
//! whose name starts with `flaky` panics on its first attempt (so the node
//! retries it, the handler then seeing attempt 2); one whose name starts
//! with `again` sets itself again 200 ms later, once (`again-2`...).
//! Unlike `counter`'s timers, which live in the process, an alarm survives
//! the key's eviction, a crash, a restart and a move: it is a row of the
//! key's state, and it wakes the key.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fief_guest::{Key, alarms, export_key, storage};

/// The storage entry holding the log of handled firings.
const FIRED: &str = "fired";

fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

fn error(e: impl std::fmt::Display) -> String {
    format!("reminders: {e}")
}

/// One key's reminders: nothing in memory but what storage holds.
struct Reminders;

impl Reminders {
    fn log() -> Result<String, String> {
        let bytes = storage::get(FIRED).map_err(error)?.unwrap_or_default();
        String::from_utf8(bytes).map_err(error)
    }
}

impl Key for Reminders {
    fn init(_key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        Ok(Reminders)
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let text = String::from_utf8(message).map_err(error)?;
        let words: Vec<&str> = text.split_whitespace().collect();
        let reply = match words.as_slice() {
            ["set", name, delay] => {
                let delay: u64 = delay.parse().map_err(error)?;
                let at = now_ms().saturating_add(delay);
                alarms::set(name, at).map_err(error)?;
                at.to_string()
            }
            ["set-at", name, at] => {
                alarms::set(name, at.parse().map_err(error)?).map_err(error)?;
                "ok".to_owned()
            }
            ["cancel", name] => alarms::cancel(name).map_err(error)?.to_string(),
            ["alarms"] => alarms::list()
                .map_err(error)?
                .iter()
                .map(|(name, at)| format!("{name}={at}\n"))
                .collect(),
            ["fired"] => Self::log()?,
            _ => {
                return Err(format!(
                    "reminders: unknown message {text:?}; expected set, set-at, cancel, alarms or fired"
                ));
            }
        };
        Ok(reply.into_bytes())
    }

    fn handle_alarm(&mut self, name: String, attempt: u32) {
        assert!(
            !(name.starts_with("flaky") && attempt == 1),
            "reminders: {name} fails its first attempt, as asked"
        );
        let mut log = Self::log().expect("reminders: the log is readable");
        log.push_str(&format!("{name} {attempt} {}\n", now_ms()));
        storage::put(FIRED, log.as_bytes()).expect("reminders: the log is writable");
        if name.starts_with("again") && !name.ends_with("-2") {
            alarms::set_in(&format!("{name}-2"), Duration::from_millis(200))
                .expect("reminders: the next alarm is set");
        }
    }
}

export_key!(Reminders);
