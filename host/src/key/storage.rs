//! A key process's durable state and its output gate.
//!
//! [`KeyStorage`] lives in the key's store data. For a module that imports
//! `fief:key/storage` it loads the key's state through the node's
//! [`StorageWriter`] before the process's first callback (which raises the
//! partition's fence token in the store; [`KeyStorage::preload`], again
//! before a later `init`/`handle-*` callback if the load failed), so the
//! storage imports work on memory and never wait; it commits a callback's
//! writes when the callback returns (`KeyProcess`'s callbacks call
//! [`KeyStorage::commit`]).
//!
//! The output gate: while a callback has writes not yet committed, the
//! outputs it issues — casts, publications, timers — wait in the
//! [`outbox`](KeyStorage::hold); they leave, in order, only after the commit
//! succeeded, and are dropped with the process if it failed. A `call` or a
//! cache write cannot wait (it needs its answer), so it commits the writes
//! made so far first ([`KeyStorage::commit`] mid-callback). Outputs made
//! before a callback's first write leave at once: they cannot depend on a
//! write that does not exist yet.
//!
//! This file owns that bookkeeping. It must not carry outputs out itself
//! (`host_api.rs` does, through the node) nor decide about ownership: a
//! commit is refused here only for a process that is killed or a survivor
//! of a fence; everything else is the backend's fence check.

use std::sync::Arc;
use std::time::Duration;

use crate::bindings::storage::StorageError;
use crate::host_bytes::{Held, Ledger};
use crate::storage::state::{KeyState, StorageLimits};
use crate::storage::writer::StorageWriter;
use crate::storage::{Commit, Fence, KeyScope, Load, Outcome};
use crate::trace::TraceContext;

use super::KeyControl;

/// The words every commit failure starts with; the caller of a call whose
/// commit failed gets `Error::StorageUnavailable` instead of a crash.
pub(crate) const COMMIT_FAILED: &str = "storage commit failed";

/// An output held by the gate until the callback's writes are committed.
pub(crate) enum Output {
    /// `cast(module, key, message)`, the module already resolved, in the
    /// trace of the callback that made it.
    Cast {
        module: String,
        key: String,
        message: Vec<u8>,
        trace: Option<TraceContext>,
    },
    /// `publish(topic, payload)`, the topic already scoped.
    Publish { topic: String, payload: Vec<u8> },
    /// A frame or a close for one of the key's WebSocket connections.
    Connection(crate::wire::ConnSend),
    /// `send-after`: its id was given to the guest; it is armed on release.
    Timer {
        id: u64,
        delay: Duration,
        tag: Vec<u8>,
        held: Held,
    },
}

/// A key process's durable state (see the module header).
pub(crate) struct KeyStorage {
    writer: Arc<StorageWriter>,
    scope: KeyScope,
    fence: Fence,
    limits: StorageLimits,
    state: Option<KeyState>,
    /// Whether the module imports storage (so [`KeyStorage::preload`] loads).
    wanted: bool,
    /// Why the last load failed: what the imports answer until a load
    /// succeeds.
    load_failure: Option<StorageError>,
    /// The loaded state's host memory, charged to the key's ledger.
    held: Held,
    ledger: Arc<Ledger>,
    outbox: Vec<(Output, Held)>,
}

impl KeyStorage {
    /// Nothing loaded yet; `wanted`: the module imports storage.
    pub(crate) fn new(
        writer: Arc<StorageWriter>,
        scope: KeyScope,
        fence: Fence,
        limits: StorageLimits,
        ledger: Arc<Ledger>,
        wanted: bool,
    ) -> Self {
        KeyStorage {
            writer,
            scope,
            fence,
            limits,
            state: None,
            wanted,
            load_failure: None,
            held: Held::none(),
            ledger,
            outbox: Vec::new(),
        }
    }

    /// Load the key's state if the module imports storage and it is not
    /// loaded yet; a failure is kept for the imports to answer. Waits for
    /// the writer's round (bounded by its timeout), outside guest code.
    pub(crate) async fn preload(&mut self) {
        if !self.wanted || self.state.is_some() {
            return;
        }
        let load = Load {
            scope: self.scope.clone(),
            fence: self.fence,
        };
        let loaded = match self.writer.load(load).await {
            Ok(Outcome::Done(loaded)) => loaded,
            Ok(Outcome::Stale { current }) => {
                self.load_failure = Some(StorageError::Unavailable(format!(
                    "this process's ownership of the key has ended: a newer owner (token \
                     {current}, this process has {}) has loaded its state",
                    self.fence.token
                )));
                return;
            }
            Err(e) => {
                self.load_failure = Some(StorageError::Unavailable(e.to_string()));
                return;
            }
        };
        let state = KeyState::new(loaded, self.limits);
        self.held = self.ledger.force(state.held_bytes() as usize);
        self.state = Some(state);
        self.load_failure = None;
    }

    /// The key's state, or why it is not loaded.
    pub(crate) fn state(&mut self) -> Result<&mut KeyState, StorageError> {
        match &mut self.state {
            Some(state) => Ok(state),
            None => Err(self.load_failure.clone().unwrap_or_else(|| {
                StorageError::Unavailable(
                    "the key's state is not loaded: it is loaded before a call, cast or \
                     info callback, and was not before this one"
                        .to_owned(),
                )
            })),
        }
    }

    /// Re-charge the state's host memory after a write (bounded by the
    /// storage limits, so it is never refused).
    pub(crate) fn recharge(&mut self) {
        if let Some(state) = &self.state {
            self.held = self.ledger.force(state.held_bytes() as usize);
        }
    }

    /// What the tenant stores, as the node last learnt it.
    pub(crate) fn tenant_bytes(&self) -> u64 {
        self.writer.tenant_bytes(self.scope.tenant())
    }

    /// Whether outputs must wait: the callback has uncommitted writes.
    pub(crate) fn holding(&self) -> bool {
        self.state.as_ref().is_some_and(KeyState::has_pending)
    }

    /// A callback begins.
    pub(crate) fn begin_callback(&mut self) {
        if let Some(state) = &mut self.state {
            state.begin_callback();
        }
    }

    /// Hold `output` until the commit, charging `bytes` to the key's host
    /// memory; refused like any other host memory past its limit.
    pub(crate) fn hold(
        &mut self,
        output: Output,
        bytes: usize,
    ) -> Result<(), crate::host_bytes::Refusal> {
        let held = self.ledger.hold(bytes)?;
        self.outbox.push((output, held));
        Ok(())
    }

    /// Cancel a held timer; whether it was held.
    pub(crate) fn cancel_timer(&mut self, timer: u64) -> bool {
        let before = self.outbox.len();
        self.outbox
            .retain(|(output, _)| !matches!(output, Output::Timer { id, .. } if *id == timer));
        self.outbox.len() != before
    }

    /// Commit the writes made since the last commit, then hand back the
    /// outputs that waited for it, in order. An error is the process's
    /// death: the held outputs are dropped and its memory is ahead of the
    /// store.
    pub(crate) async fn commit(&mut self, control: &KeyControl) -> Result<Vec<Output>, String> {
        let Some((writes, bytes_delta)) = self.state.as_mut().and_then(KeyState::take_commit)
        else {
            return Ok(self.release());
        };
        self.recharge();
        if control.is_killed() || control.is_survivor() {
            self.outbox.clear();
            return Err(format!(
                "{COMMIT_FAILED}: this process's ownership of the key has ended (its node \
                 fenced); its writes were not committed"
            ));
        }
        let commit = Commit {
            scope: self.scope.clone(),
            fence: self.fence,
            writes,
            bytes_delta,
        };
        // A kill (a fence, an operator) does not wait for the store: the
        // commit is already in the writer's queue and lands or is refused
        // there, and the process dies now with its outputs withheld.
        let answered = tokio::select! {
            biased;
            () = control.killed() => None,
            answered = self.writer.commit(commit) => Some(answered),
        };
        let Some(answered) = answered else {
            self.outbox.clear();
            return Err(format!(
                "{COMMIT_FAILED}: the process was killed while its writes were being \
                 committed; they may or may not have been committed, and nothing that waited \
                 for them was sent"
            ));
        };
        match answered {
            Ok(Outcome::Done(_)) => Ok(self.release()),
            Ok(Outcome::Stale { current }) => {
                self.outbox.clear();
                Err(format!(
                    "{COMMIT_FAILED}: this process's ownership of the key has ended (a newer \
                     owner, token {current}, loaded its state); its writes were not committed"
                ))
            }
            Err(e) => {
                self.outbox.clear();
                Err(format!(
                    "{COMMIT_FAILED}: {e}; the callback's writes may or may not have been \
                     committed, and nothing that waited for them was sent"
                ))
            }
        }
    }

    fn release(&mut self) -> Vec<Output> {
        // The outputs' charges end here: from now on they are the node's
        // (a mailbox, a timer) and charged there.
        self.outbox.drain(..).map(|(output, _)| output).collect()
    }
}

impl super::KeyCtx {
    /// Commit the writes made so far in this callback before an output
    /// that cannot wait for the callback's end (a `call`, a cache write),
    /// and let out what waited. A failed commit traps the guest with the
    /// commit's failure as its death.
    pub(crate) async fn flush_storage(&mut self) -> wasmtime::Result<()> {
        if !self.storage.holding() {
            return Ok(());
        }
        let control = self.env.control.clone();
        match self.storage.commit(&control).await {
            Ok(outputs) => {
                self.release(outputs);
                Ok(())
            }
            Err(why) => {
                self.death = Some(why.clone());
                Err(wasmtime::Error::msg(why))
            }
        }
    }

    /// Carry out outputs the gate held, in order, now that the writes they
    /// waited for are committed. They were checked when issued; what fails
    /// now (a full mailbox, a node that fenced meanwhile) is dropped and
    /// logged, as a cast or a publication that finds no room always is.
    pub(crate) fn release(&mut self, outputs: Vec<Output>) {
        if outputs.is_empty() {
            return;
        }
        let (services, node) = match self.gate_node() {
            Ok(gated) => gated,
            Err(e) => {
                self.log.host_warning(format_args!(
                    "{} outputs dropped after their commit: {e}",
                    outputs.len()
                ));
                return;
            }
        };
        for output in outputs {
            match output {
                Output::Cast {
                    module,
                    key,
                    message,
                    trace,
                } => {
                    let cast = || node.clone().cast_key(&module, &key, message);
                    if let Err(e) = crate::trace::sync_scope(trace, cast) {
                        self.log.host_warning(format_args!(
                            "a cast to {module}/{key} held for its commit was dropped: {e}"
                        ));
                    }
                }
                Output::Connection(send) => {
                    if let Err(why) = crate::connections_api::send_now(self, &services, send) {
                        tracing::debug!(module = %self.env.module, key = %self.env.key,
                            "a connection frame held for its commit was dropped: {why:?}");
                    }
                }
                Output::Publish { topic, payload } => {
                    let published =
                        services
                            .pubsub
                            .publish(&topic, &payload, self.env.mailbox.ledger());
                    services
                        .metrics
                        .topics()
                        .published(published.forwarded, published.dropped);
                }
                Output::Timer {
                    id,
                    delay,
                    tag,
                    held,
                } => super::spawn_timer(self, id, delay, tag, held),
            }
        }
    }
}
