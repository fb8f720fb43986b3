//! The `fief:key/storage` and `fief:key/alarms` imports: a key process's
//! own durable state and its alarms (rows of that state).
//!
//! The imports work on the process's copy of the key's state in memory,
//! loaded before the callback began (`KeyStorage::preload` in
//! `key/storage.rs`), so they are synchronous and never wait; the writes are
//! committed when the callback returns. Refusals (a bad name, a limit, the
//! store unreachable when the state was to be loaded) are WIT `result`s.
//!
//! A write (`put`, `delete`, `delete-range`) passes the side-effect gate
//! first (a killed key, or a `terminate` key past its node's fence point,
//! traps) and is charged its measured host time, like every import with an
//! effect. A read (`get`, `list`) touches nothing outside the process: it
//! checks only that the process was not killed, and is charged by what it
//! does — a fixed cost, a cost per listed entry, and the bytes it copies
//! in and out — instead of two clock reads around a map lookup that takes
//! less time than they do. Whatever a read returns can leave the process
//! only through an import that is gated (docs/storage.md, "Reads").
//!
//! This file only adapts the imports to the key's `KeyStorage`; it must not
//! commit (the callback's end does) or reach the backend.

use std::time::{Duration, Instant};

use crate::bindings::alarms::Host as AlarmsHost;
use crate::bindings::storage::{Host, StorageError};
use crate::key::KeyCtx;

/// Host time charged for one read of loaded state, besides its entries and
/// bytes: a name check and one lookup in a sorted map (measured at 20–40 ns
/// on the bench machine; charged generously).
const READ_NANOS: u64 = 100;

/// Host time charged per entry a `list` returns (one step of the map's
/// iterator and two small allocations), besides the entry's bytes.
const LIST_ENTRY_NANOS: u64 = 50;

/// What a read is charged: [`READ_NANOS`], [`LIST_ENTRY_NANOS`] per entry
/// returned, and its `bytes` in and out at the lift rate
/// (`KeyCtx::charge_host`'s `lifted`). A pure function, so the bound on what
/// a reading guest can make the host spend is a unit test.
fn read_cost(entries: usize, bytes: usize) -> (Duration, usize) {
    let nanos = READ_NANOS.saturating_add(LIST_ENTRY_NANOS.saturating_mul(entries as u64));
    (Duration::from_nanos(nanos), bytes)
}

impl KeyCtx {
    /// Run `read` on the key's loaded state and charge it by
    /// [`read_cost`]; `lifted`: the bytes of its arguments, `moved`: the
    /// entries and bytes its answer returns.
    ///
    /// No fence check and no clock read: a read has no effect outside the
    /// process (see the module header). A killed process still traps.
    fn read_state<T>(
        &mut self,
        lifted: usize,
        read: impl FnOnce(&crate::storage::state::KeyState) -> Result<T, StorageError>,
        moved: impl FnOnce(&T) -> (usize, usize),
    ) -> wasmtime::Result<Result<T, StorageError>> {
        if self.env.control.is_killed() {
            wasmtime::bail!("read refused: this key process was killed");
        }
        let result = self.storage.state().and_then(|state| read(state));
        let (entries, bytes) = result.as_ref().map_or((0, 0), moved);
        let (spent, copied) = read_cost(entries, lifted.saturating_add(bytes));
        self.charge_host(spent, copied)?;
        Ok(result)
    }

    /// Run `write` on the key's state through the side-effect gate, charging
    /// its measured host time and `lifted` bytes of arguments to the
    /// callback, and re-charge the state's host memory after it.
    fn write_state<T>(
        &mut self,
        lifted: usize,
        write: impl FnOnce(&mut crate::storage::state::KeyState, u64) -> Result<T, StorageError>,
    ) -> wasmtime::Result<Result<T, StorageError>> {
        self.gate()?;
        let start = Instant::now();
        let tenant_bytes = self.storage.tenant_bytes();
        let result = self
            .storage
            .state()
            .and_then(|state| write(state, tenant_bytes));
        self.storage.recharge();
        self.charge_host(start.elapsed(), lifted)?;
        Ok(result)
    }
}

impl Host for KeyCtx {
    fn get(&mut self, name: String) -> wasmtime::Result<Result<Option<Vec<u8>>, StorageError>> {
        self.read_state(
            name.len(),
            |state| state.get(&name),
            |value| (0, value.as_ref().map_or(0, Vec::len)),
        )
    }

    fn put(&mut self, name: String, value: Vec<u8>) -> wasmtime::Result<Result<(), StorageError>> {
        let lifted = name.len() + value.len();
        self.write_state(lifted, |state, tenant_bytes| {
            state.put(name, value, tenant_bytes)
        })
    }

    fn delete(&mut self, name: String) -> wasmtime::Result<Result<bool, StorageError>> {
        let lifted = name.len();
        self.write_state(lifted, |state, _| state.delete(&name))
    }

    fn list(
        &mut self,
        start: String,
        end: Option<String>,
        limit: u32,
    ) -> wasmtime::Result<Result<Vec<(String, Vec<u8>)>, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.read_state(
            lifted,
            |state| state.list(&start, end.as_deref(), limit),
            |entries| {
                let bytes = entries.iter().map(|(n, v)| n.len() + v.len()).sum();
                (entries.len(), bytes)
            },
        )
    }

    fn delete_range(
        &mut self,
        start: String,
        end: Option<String>,
    ) -> wasmtime::Result<Result<u64, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.write_state(lifted, |state, _| {
            state.delete_range(&start, end.as_deref())
        })
    }
}

/// Milliseconds since the Unix epoch on this node's wall clock (alarms are
/// wall-clock times, `docs/alarms.md`, "Time").
pub(crate) fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl AlarmsHost for KeyCtx {
    fn set_alarm(
        &mut self,
        name: String,
        at_ms: u64,
    ) -> wasmtime::Result<Result<(), StorageError>> {
        if !self.alarms_allowed {
            self.gate()?;
            return Ok(Err(StorageError::Invalid(
                "this module does not export fief:key/alarm-handler, so no alarm of it could \
                 fire: build it for the key-module-with-alarms world (with the Rust SDK, \
                 implement `Key::handle_alarm`)"
                    .to_owned(),
            )));
        }
        let lifted = name.len() + 8;
        let now_ms = wall_ms();
        self.write_state(lifted, |state, _| state.set_alarm(name, at_ms, now_ms))
    }

    fn cancel_alarm(&mut self, name: String) -> wasmtime::Result<Result<bool, StorageError>> {
        let lifted = name.len();
        self.write_state(lifted, |state, _| state.cancel_alarm(&name))
    }

    fn list_alarms(&mut self) -> wasmtime::Result<Result<Vec<(String, u64)>, StorageError>> {
        self.read_state(
            0,
            |state| Ok(state.list_alarms()),
            |alarms| (alarms.len(), alarms.iter().map(|(n, _)| n.len() + 8).sum()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_is_charged_its_entries_and_bytes() {
        assert_eq!(read_cost(0, 0), (Duration::from_nanos(READ_NANOS), 0));
        // A 1 MiB value read back: its bytes are charged at the lift rate.
        assert_eq!(read_cost(0, 1 << 20).1, 1 << 20);
        // A list of 10,000 entries: 0.5 ms of entries on top.
        let (spent, _) = read_cost(10_000, 0);
        assert_eq!(
            spent,
            Duration::from_nanos(READ_NANOS + 10_000 * LIST_ENTRY_NANOS)
        );
    }
}
