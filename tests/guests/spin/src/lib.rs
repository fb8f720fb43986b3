//! `spin`: a test guest that never yields, for the host's CPU limits and
//! deadlines (epoch interruption / fuel, `handle-fence` deadlines, a caller
//! blocked on a spinning callee).
//!
//! | where                  | behaviour                                                   |
//! |------------------------|-------------------------------------------------------------|
//! | call `ping`            | replies `pong` (the process is healthy)                     |
//! | call `spin`            | loops forever                                               |
//! | call `burn <turns>`    | loops `turns` times (bounded work), then replies `burnt`    |
//! | call `spin-after-call <module> <key>` | host-calls that key with `ping` (5 s timeout), then loops forever |
//! | cast `spin-after-call <module> <key>` | the same, on the key's own task (a cast is never served inline) |
//! | `handle-fence`         | loops forever (misses every fence deadline)                 |
//! | `init`                 | loops forever if the key starts with `spin-init`            |
//!
//! Anything else is refused with an error naming the commands.

use core::hint::black_box;
use core::time::Duration;

use fief_guest::{FenceDecision, Key, export_key, host};

/// Loops forever, doing work the optimizer cannot remove.
fn spin_forever() -> ! {
    let mut turns: u64 = 0;
    loop {
        turns = black_box(turns.wrapping_add(1));
    }
}

/// The spinner (stateless).
struct Spin;

impl Key for Spin {
    fn init(key: &str, _handoff: Option<Vec<u8>>) -> Result<Self, String> {
        if key.starts_with("spin-init") {
            spin_forever();
        }
        Ok(Spin)
    }

    fn handle_call(&mut self, message: Vec<u8>) -> Result<Vec<u8>, String> {
        let text = String::from_utf8_lossy(&message);
        if text == "ping" {
            return Ok(b"pong".to_vec());
        }
        if text == "spin" {
            spin_forever();
        }
        if let Some(turns) = text.strip_prefix("burn ") {
            let turns: u64 = turns
                .parse()
                .map_err(|_| format!("spin: expected burn <turns>, got {text:?}"))?;
            let mut done: u64 = 0;
            while black_box(done) < turns {
                done += 1;
            }
            return Ok(b"burnt".to_vec());
        }
        if let Some(target) = text.strip_prefix("spin-after-call ") {
            let (module, key) = target.split_once(' ').ok_or_else(|| {
                format!("spin: expected spin-after-call <module> <key>, got {text:?}")
            })?;
            let reply = host::call(module, key, b"ping", Duration::from_secs(5));
            black_box(reply.ok());
            spin_forever();
        }
        Err(format!(
            "spin: unknown message {text:?}; expected ping, spin, burn <turns>, \
             spin-after-call <module> <key>"
        ))
    }

    fn handle_cast(&mut self, message: Vec<u8>) {
        let text = String::from_utf8_lossy(&message);
        if let Some((module, key)) = text
            .strip_prefix("spin-after-call ")
            .and_then(|target| target.split_once(' '))
        {
            black_box(host::call(module, key, b"ping", Duration::from_secs(5)).ok());
            spin_forever();
        }
    }

    fn handle_fence(&mut self, _deadline_ms: u32) -> FenceDecision {
        spin_forever()
    }
}

export_key!(Spin);
