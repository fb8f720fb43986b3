//! The `fief:key/storage` imports: a key process's own durable state.
//!
//! Every import passes the side-effect gate first (a killed key, or a
//! `terminate` key past its node's fence point, traps), then works on the
//! process's copy of the key's state in memory, loaded before the callback
//! began (`KeyStorage::preload` in `key/storage.rs`), so the imports are
//! synchronous and never wait; the writes are committed when the callback
//! returns. Refusals (a bad name, a limit, the store unreachable when the
//! state was to be loaded) are WIT `result`s. Host time is charged to the
//! callback like every import's.
//!
//! This file only adapts the imports to the key's `KeyStorage`; it must not
//! commit (the callback's end does) or reach the backend.

use std::time::Instant;

use crate::bindings::storage::{Host, StorageError};
use crate::key::KeyCtx;

/// Whether an import may change the state (then its host memory is charged
/// again, and a `put` needs the tenant's stored bytes for its quota).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Access {
    Read,
    Write,
}

impl KeyCtx {
    /// Run `work` on the key's state, charging its host time and `lifted`
    /// bytes of arguments to the callback.
    ///
    /// The state was loaded before the callback (`KeyStorage::preload`), so
    /// this never waits; a read takes one gate, no lock, and leaves the
    /// state's memory charge as it is (docs/benchmarks.md, "Durable state").
    fn on_state<T>(
        &mut self,
        access: Access,
        lifted: usize,
        work: impl FnOnce(&mut crate::storage::state::KeyState, u64) -> Result<T, StorageError>,
    ) -> wasmtime::Result<Result<T, StorageError>> {
        self.gate()?;
        let start = Instant::now();
        let tenant_bytes = match access {
            Access::Write => self.storage.tenant_bytes(),
            Access::Read => 0,
        };
        let result = self
            .storage
            .state()
            .and_then(|state| work(state, tenant_bytes));
        if access == Access::Write {
            self.storage.recharge();
        }
        self.charge_host(start.elapsed(), lifted)?;
        Ok(result)
    }
}

impl Host for KeyCtx {
    fn get(&mut self, name: String) -> wasmtime::Result<Result<Option<Vec<u8>>, StorageError>> {
        let lifted = name.len();
        self.on_state(Access::Read, lifted, |state, _| state.get(&name))
    }

    fn put(&mut self, name: String, value: Vec<u8>) -> wasmtime::Result<Result<(), StorageError>> {
        let lifted = name.len() + value.len();
        self.on_state(Access::Write, lifted, |state, tenant_bytes| {
            state.put(name, value, tenant_bytes)
        })
    }

    fn delete(&mut self, name: String) -> wasmtime::Result<Result<bool, StorageError>> {
        let lifted = name.len();
        self.on_state(Access::Write, lifted, |state, _| state.delete(&name))
    }

    fn list(
        &mut self,
        start: String,
        end: Option<String>,
        limit: u32,
    ) -> wasmtime::Result<Result<Vec<(String, Vec<u8>)>, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.on_state(Access::Read, lifted, |state, _| {
            state.list(&start, end.as_deref(), limit)
        })
    }

    fn delete_range(
        &mut self,
        start: String,
        end: Option<String>,
    ) -> wasmtime::Result<Result<u64, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.on_state(Access::Write, lifted, |state, _| {
            state.delete_range(&start, end.as_deref())
        })
    }
}
