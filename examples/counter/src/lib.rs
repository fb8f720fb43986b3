//! `counter`: the smallest useful key module — one number per key.
//!
//! Messages are UTF-8 text:
//!
//! | kind | message          | effect                                             | reply            |
//! |------|------------------|----------------------------------------------------|------------------|
//! | call | `incr`           | adds one                                           | new value        |
//! | call | `get`            | none                                               | value            |
//! | cast | `tick-every <ms>`| adds one every `<ms>` ms (replaces an earlier one) | —                |
//! | cast | `stop-ticking`   | stops the ticking                                  | —                |
//!
//! Values are decimal text and start at 0. A graceful handoff carries the
//! value (decimal text) to the next owner; ticking does not move with it,
//! because timers belong to the node that armed them.
//!
//! Ticking uses one self-re-arming one-shot timer. A timer can fire just
//! before it is cancelled and still be queued, so every fired timer is matched
//! against the one currently armed and stale ones are ignored.

use core::time::Duration;

use fief_guest::{Info, Key, TimerId, export_key, host};

/// The tag of the ticking timer.
const TICK_TAG: &[u8] = b"tick";

/// One key's counter.
struct Counter {
    /// The current value.
    value: u64,
    /// The armed ticking timer, if ticking.
    ticker: Option<Ticker>,
}

/// An armed ticking timer.
struct Ticker {
    /// The timer that will fire next.
    timer: TimerId,
    /// How often to tick.
    every: Duration,
}

impl Counter {
    /// Stops ticking, if ticking.
    fn stop_ticking(&mut self) {
        if let Some(ticker) = self.ticker.take() {
            host::cancel_timer(ticker.timer);
        }
    }

    /// Arms the ticking timer for `every`; logs and stays stopped if the node
    /// refuses it.
    fn start_ticking(&mut self, every: Duration) {
        self.ticker = match host::send_after(every, TICK_TAG) {
            Ok(timer) => Some(Ticker { timer, every }),
            Err(error) => {
                host::log::warn(&format!("counter: cannot arm tick timer: {error}"));
                None
            }
        };
    }
}

impl Key for Counter {
    fn init(_key: &str, handoff: Option<Vec<u8>>) -> Result<Self, String> {
        let value = match handoff {
            None => 0,
            Some(state) => std::str::from_utf8(&state)
                .ok()
                .and_then(|text| text.parse().ok())
                .ok_or_else(|| {
                    format!(
                        "counter: handoff state is not a decimal value: {:?}",
                        String::from_utf8_lossy(&state)
                    )
                })?,
        };
        Ok(Counter {
            value,
            ticker: None,
        })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        match message.as_slice() {
            b"incr" => {
                self.value = self
                    .value
                    .checked_add(1)
                    .ok_or("counter: value would overflow")?;
            }
            b"get" => {}
            _ => {
                return Err(format!(
                    "unknown message: {}; expected incr, get",
                    String::from_utf8_lossy(&message)
                ));
            }
        }
        Ok(self.value.to_string().into_bytes())
    }

    fn handle_cast(&mut self, message: Vec<u8>) {
        let message = String::from_utf8_lossy(&message);
        if message == "stop-ticking" {
            self.stop_ticking();
        } else if let Some(ms) = message.strip_prefix("tick-every ") {
            match ms.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => {
                    self.stop_ticking();
                    self.start_ticking(Duration::from_millis(ms));
                }
                _ => host::log::warn(&format!(
                    "counter: tick-every needs a positive number of milliseconds, got {ms:?}"
                )),
            }
        } else {
            host::log::warn(&format!(
                "counter: unknown cast: {message}; expected tick-every <ms>, stop-ticking"
            ));
        }
    }

    fn handle_info(&mut self, info: Info) {
        let Info::Timer(fired) = info else {
            return;
        };
        let Some(ticker) = &self.ticker else {
            return;
        };
        if fired.timer_id() != ticker.timer {
            // A timer cancelled after it fired: not the current ticker.
            return;
        }
        let every = ticker.every;
        self.value = self.value.saturating_add(1);
        self.start_ticking(every);
    }

    fn handoff(&mut self) -> Option<Vec<u8>> {
        Some(self.value.to_string().into_bytes())
    }
}

export_key!(Counter);
