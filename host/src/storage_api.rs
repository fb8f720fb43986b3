//! The `fief:key/storage` imports: a key process's own durable state.
//!
//! Every import passes the side-effect gate first (a killed key, or a
//! `terminate` key past its node's fence point, traps), loads the key's
//! state at the first call ([`KeyStorage::state`](crate::key)), and then
//! works on the process's copy in memory; the writes are committed when
//! the callback returns. Refusals (a bad name, a limit, the store
//! unreachable) are WIT `result`s. Host time is charged to the callback
//! like every import's, the wait for the first load excepted (it is bounded
//! by the writer's round timeout).
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
    /// Run `work` on the key's state (loading it first), charging its host
    /// time and `lifted` bytes of arguments to the callback.
    ///
    /// The path of a read of loaded state is kept short (it is most calls
    /// of a stored key, and measured against a call that does not read:
    /// docs/benchmarks.md, S10): one gate, no wait, no lock, and the
    /// state's memory charge is left as it is.
    async fn on_state<T>(
        &mut self,
        access: Access,
        lifted: usize,
        work: impl FnOnce(&mut crate::storage::state::KeyState, u64) -> Result<T, StorageError>,
    ) -> wasmtime::Result<Result<T, StorageError>> {
        self.gate()?;
        if !self.storage.loaded() {
            // The first call waits for the load (not charged: it is
            // waiting, bounded by the writer's round timeout); the world
            // may have changed meanwhile.
            let loaded = self.storage.state().await.map(|_| ());
            self.gate()?;
            if let Err(e) = loaded {
                return Ok(Err(e));
            }
        }
        let start = Instant::now();
        let tenant_bytes = match access {
            Access::Write => self.storage.tenant_bytes(),
            Access::Read => 0,
        };
        let state = self.storage.loaded_state().expect("loaded above");
        let result = work(state, tenant_bytes);
        if access == Access::Write {
            self.storage.recharge();
        }
        self.charge_host(start.elapsed(), lifted)?;
        Ok(result)
    }
}

impl Host for KeyCtx {
    async fn get(
        &mut self,
        name: String,
    ) -> wasmtime::Result<Result<Option<Vec<u8>>, StorageError>> {
        let lifted = name.len();
        self.on_state(Access::Read, lifted, |state, _| state.get(&name))
            .await
    }

    async fn put(
        &mut self,
        name: String,
        value: Vec<u8>,
    ) -> wasmtime::Result<Result<(), StorageError>> {
        let lifted = name.len() + value.len();
        self.on_state(Access::Write, lifted, |state, tenant_bytes| {
            state.put(name, value, tenant_bytes)
        })
        .await
    }

    async fn delete(&mut self, name: String) -> wasmtime::Result<Result<bool, StorageError>> {
        let lifted = name.len();
        self.on_state(Access::Write, lifted, |state, _| state.delete(&name))
            .await
    }

    async fn list(
        &mut self,
        start: String,
        end: Option<String>,
        limit: u32,
    ) -> wasmtime::Result<Result<Vec<(String, Vec<u8>)>, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.on_state(Access::Read, lifted, |state, _| {
            state.list(&start, end.as_deref(), limit)
        })
        .await
    }

    async fn delete_range(
        &mut self,
        start: String,
        end: Option<String>,
    ) -> wasmtime::Result<Result<u64, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.on_state(Access::Write, lifted, |state, _| {
            state.delete_range(&start, end.as_deref())
        })
        .await
    }
}
