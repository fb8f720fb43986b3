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

/// What an import does with the loaded state.
type Work<'a, T> = Box<
    dyn FnOnce(&mut crate::storage::state::KeyState, u64) -> Result<T, StorageError> + Send + 'a,
>;

impl KeyCtx {
    /// Run `work` on the key's state (loading it first), charging its host
    /// time and `lifted` bytes of arguments to the callback.
    async fn on_state<T>(
        &mut self,
        lifted: usize,
        work: Work<'_, T>,
    ) -> wasmtime::Result<Result<T, StorageError>> {
        self.gate()?;
        // The first call waits for the load (not charged: it is waiting,
        // bounded by the writer's round timeout); the world may have
        // changed meanwhile.
        let loaded = self.storage.state().await.map(|_| ());
        self.gate()?;
        let start = Instant::now();
        let tenant_bytes = self.storage.tenant_bytes();
        let result = match loaded {
            Err(e) => Err(e),
            Ok(()) => match self.storage.state().await {
                Ok(state) => work(state, tenant_bytes),
                Err(e) => Err(e),
            },
        };
        self.storage.recharge();
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
        self.on_state(lifted, Box::new(move |state, _| state.get(&name)))
            .await
    }

    async fn put(
        &mut self,
        name: String,
        value: Vec<u8>,
    ) -> wasmtime::Result<Result<(), StorageError>> {
        let lifted = name.len() + value.len();
        self.on_state(
            lifted,
            Box::new(move |state, tenant_bytes| state.put(name, value, tenant_bytes)),
        )
        .await
    }

    async fn delete(&mut self, name: String) -> wasmtime::Result<Result<bool, StorageError>> {
        let lifted = name.len();
        self.on_state(lifted, Box::new(move |state, _| state.delete(&name)))
            .await
    }

    async fn list(
        &mut self,
        start: String,
        end: Option<String>,
        limit: u32,
    ) -> wasmtime::Result<Result<Vec<(String, Vec<u8>)>, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.on_state(
            lifted,
            Box::new(move |state, _| state.list(&start, end.as_deref(), limit)),
        )
        .await
    }

    async fn delete_range(
        &mut self,
        start: String,
        end: Option<String>,
    ) -> wasmtime::Result<Result<u64, StorageError>> {
        let lifted = start.len() + end.as_ref().map_or(0, String::len);
        self.on_state(
            lifted,
            Box::new(move |state, _| state.delete_range(&start, end.as_deref())),
        )
        .await
    }
}
