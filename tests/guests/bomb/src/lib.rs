//! `bomb`: a test guest that tries to exhaust every resource the host must
//! limit — linear memory, the stack, reply size, timers, publications — so
//! host tests can prove each limit holds and kills or refuses only this key.
//!
//! Every behaviour is a UTF-8 text command sent with `handle-call`:
//!
//! | command         | behaviour                                                          |
//! |-----------------|--------------------------------------------------------------------|
//! | `ping`          | replies `pong` (the process is healthy)                            |
//! | `memory`        | allocates 1 MiB chunks, fills and keeps each, forever (until the memory limit traps it) |
//! | `recurse`       | recurses without bound (until the stack overflows and traps)       |
//! | `reply <n>`     | replies `n` bytes of `x` (probes the reply size limit)             |
//! | `timers`        | arms 1-hour timers until `send-after` errors; replies how many it armed |
//! | `publish-flood` | publishes to `bomb:flood` until `publish` errors; replies how many it published |
//!
//! `timers` and `publish-flood` only return if the host enforces a limit;
//! without one they run until the host's CPU limit kills the process. The
//! error that stopped them is logged at info level.

use core::hint::black_box;
use core::time::Duration;

use fief_guest::{Key, export_key, host};

/// The size of one `memory` allocation.
const CHUNK_BYTES: usize = 1 << 20;

/// The bomb; keeps what `memory` allocated so none of it is freed.
struct Bomb {
    /// Every chunk allocated by `memory`.
    hoard: Vec<Vec<u8>>,
}

/// Recurses until the stack runs out; the frame holds a buffer so each level
/// uses real stack, and `black_box` keeps the call from becoming a loop.
#[inline(never)]
fn recurse(depth: u64) -> u64 {
    let frame = black_box([depth; 16]);
    if black_box(depth) == u64::MAX {
        return frame[0];
    }
    recurse(black_box(depth + 1)).wrapping_add(frame[15])
}

impl Bomb {
    /// `memory`: never returns normally.
    fn exhaust_memory(&mut self) -> ! {
        loop {
            let chunk = vec![0xA5_u8; CHUNK_BYTES];
            self.hoard.push(black_box(chunk));
        }
    }

    /// `timers`: how many timers the host let this key arm.
    fn arm_timers() -> u64 {
        let mut armed: u64 = 0;
        loop {
            match host::send_after(Duration::from_secs(3600), b"bomb") {
                Ok(_) => armed += 1,
                Err(error) => {
                    host::log::info(&format!("bomb: send-after refused after {armed}: {error}"));
                    return armed;
                }
            }
        }
    }

    /// `publish-flood`: how many publications the host accepted.
    fn flood() -> u64 {
        let mut published: u64 = 0;
        loop {
            match host::publish("bomb:flood", b"x") {
                Ok(_) => published += 1,
                Err(error) => {
                    host::log::info(&format!("bomb: publish refused after {published}: {error}"));
                    return published;
                }
            }
        }
    }
}

impl Key for Bomb {
    fn init(_key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        Ok(Bomb { hoard: Vec::new() })
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let text = String::from_utf8_lossy(&message);
        let (command, args) = text.split_once(' ').unwrap_or((&text, ""));
        match command {
            "ping" => Ok(b"pong".to_vec()),
            "memory" => self.exhaust_memory(),
            "recurse" => Ok(recurse(0).to_string().into_bytes()),
            "reply" => {
                let n: usize = args
                    .parse()
                    .map_err(|_| format!("bomb: reply needs a byte count, got {args:?}"))?;
                Ok(vec![b'x'; n])
            }
            "timers" => Ok(Self::arm_timers().to_string().into_bytes()),
            "publish-flood" => Ok(Self::flood().to_string().into_bytes()),
            _ => Err(format!(
                "bomb: unknown message {text:?}; expected ping, memory, recurse, reply <n>, \
                 timers, publish-flood"
            )),
        }
    }
}

export_key!(Bomb);
