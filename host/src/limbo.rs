//! Limbo: the per-instance home of `continue` and `callback` survivors.
//!
//! At the fence, a survivor's process leaves its partition's kill tree (its
//! module's table of live keys) and is recorded here instead, outside the
//! reach of routing: no routed message reaches it again, but its timers,
//! its pub/sub subscriptions and local handles still do (the fence-mode
//! page's forfeit). Limbo is enumerable ([`LimboEntry`]).
//!
//! The bookkeeper is one task that owns the entry map. Survivors are
//! reaped (killed) when this node next initializes their partition, so a
//! node never hosts a survivor and a fresh process for one key. They die
//! with the instance, and they die with the bookkeeper: the map kills every
//! entry when it is dropped, so if the bookkeeper task ever crashes its
//! survivors die with it rather than live on unreapable (fate-sharing). A
//! crash of the node's *coordination* does not touch limbo.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::SystemTime;

use fief_core::{OnFence, PartitionId};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot};
use wasmtime::Engine;

use crate::key::KeyControl;
use crate::mailbox::Mailbox;

/// One survivor, as [`crate::Instance::limbo`] reports it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq, utoipa::ToSchema)]
pub struct LimboEntry {
    /// The module.
    pub module: String,
    /// The key.
    pub key: String,
    /// The partition the key belonged to.
    pub partition: u32,
    /// When it entered limbo (RFC 3339, UTC).
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String)]
    pub since: SystemTime,
    /// Its fence mode (`continue` or `callback`).
    pub mode: String,
}

/// A survivor's record: what it is, and how to reach and kill it.
pub(crate) struct Survivor {
    pub(crate) entry: LimboEntry,
    pub(crate) generation: u64,
    pub(crate) control: Arc<KeyControl>,
    pub(crate) mailbox: Mailbox,
}

enum Command {
    Insert(Survivor),
    Remove {
        module: String,
        key: String,
        generation: u64,
    },
    List(oneshot::Sender<Vec<LimboEntry>>),
    Mailbox {
        module: String,
        key: String,
        reply: oneshot::Sender<Option<Mailbox>>,
    },
    Reap {
        partitions: BTreeSet<PartitionId>,
        reply: oneshot::Sender<Vec<Arc<KeyControl>>>,
    },
    KillAll(oneshot::Sender<Vec<Arc<KeyControl>>>),
    Crash,
}

/// The survivors' map. Dropping it kills every survivor: whatever ends the
/// bookkeeper ends its survivors.
struct Entries {
    map: HashMap<(String, String), Survivor>,
    engine: Engine,
}

impl Entries {
    fn kill(
        &mut self,
        select: impl Fn(&Survivor) -> bool,
        reason: &'static str,
    ) -> Vec<Arc<KeyControl>> {
        let keys: Vec<_> = self
            .map
            .iter()
            .filter(|(_, s)| select(s))
            .map(|(k, _)| k.clone())
            .collect();
        let controls: Vec<_> = keys
            .into_iter()
            .filter_map(|k| self.map.remove(&k))
            .map(|s| {
                s.control.kill_one_of_many(reason);
                s.control
            })
            .collect();
        if !controls.is_empty() {
            self.engine.increment_epoch();
        }
        controls
    }
}

impl Drop for Entries {
    fn drop(&mut self) {
        let killed = self.kill(
            |_| true,
            "limbo's bookkeeper ended; survivors share its fate",
        );
        if !killed.is_empty() {
            tracing::warn!(
                killed = killed.len(),
                "limbo's bookkeeper ended: its survivors were killed"
            );
        }
    }
}

/// The limbo of one instance: a handle to its bookkeeper.
#[derive(Clone)]
pub(crate) struct Limbo {
    commands: mpsc::UnboundedSender<Command>,
}

impl Limbo {
    /// Start the bookkeeper.
    pub(crate) fn start(engine: Engine) -> Self {
        let (commands, mut rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut entries = Entries {
                map: HashMap::new(),
                engine,
            };
            while let Some(command) = rx.recv().await {
                match command {
                    Command::Insert(s) => {
                        entries
                            .map
                            .insert((s.entry.module.clone(), s.entry.key.clone()), s);
                    }
                    Command::Remove {
                        module,
                        key,
                        generation,
                    } => {
                        let id = (module, key);
                        if entries
                            .map
                            .get(&id)
                            .is_some_and(|s| s.generation == generation)
                        {
                            entries.map.remove(&id);
                        }
                    }
                    Command::List(reply) => {
                        let mut list: Vec<_> =
                            entries.map.values().map(|s| s.entry.clone()).collect();
                        list.sort_by(|a, b| (&a.module, &a.key).cmp(&(&b.module, &b.key)));
                        let _ = reply.send(list);
                    }
                    Command::Mailbox { module, key, reply } => {
                        let _ =
                            reply.send(entries.map.get(&(module, key)).map(|s| s.mailbox.clone()));
                    }
                    Command::Reap { partitions, reply } => {
                        let killed = entries.kill(
                            |s| partitions.contains(&PartitionId(s.entry.partition)),
                            "reaped: this node initializes the partition again",
                        );
                        let _ = reply.send(killed);
                    }
                    Command::KillAll(reply) => {
                        let _ = reply.send(entries.kill(|_| true, "the instance is shutting down"));
                    }
                    Command::Crash => panic!("limbo bookkeeper crash injected"),
                }
            }
        });
        Limbo { commands }
    }

    /// Record a survivor.
    pub(crate) fn insert(&self, survivor: Survivor) {
        if let Err(mpsc::error::SendError(Command::Insert(s))) =
            self.commands.send(Command::Insert(survivor))
        {
            // No bookkeeper: a survivor nobody could reap must not live.
            s.control.kill("limbo's bookkeeper is gone");
        }
    }

    /// Forget a survivor that ended (only that generation).
    pub(crate) fn remove(&self, module: &str, key: &str, generation: u64) {
        let _ = self.commands.send(Command::Remove {
            module: module.to_owned(),
            key: key.to_owned(),
            generation,
        });
    }

    /// Every survivor.
    pub(crate) async fn entries(&self) -> Vec<LimboEntry> {
        let (reply, rx) = oneshot::channel();
        let _ = self.commands.send(Command::List(reply));
        rx.await.unwrap_or_default()
    }

    /// A survivor's mailbox (its local handle), if it is in limbo.
    pub(crate) async fn mailbox(&self, module: &str, key: &str) -> Option<Mailbox> {
        let (reply, rx) = oneshot::channel();
        let _ = self.commands.send(Command::Mailbox {
            module: module.to_owned(),
            key: key.to_owned(),
            reply,
        });
        rx.await.ok().flatten()
    }

    /// Kill the survivors of `partitions` and wait until they are gone.
    pub(crate) async fn reap(&self, partitions: BTreeSet<PartitionId>) -> usize {
        let (reply, rx) = oneshot::channel();
        let _ = self.commands.send(Command::Reap { partitions, reply });
        wait_all(rx.await.unwrap_or_default()).await
    }

    /// Kill every survivor and wait until they are gone.
    pub(crate) async fn kill_all(&self) -> usize {
        let (reply, rx) = oneshot::channel();
        let _ = self.commands.send(Command::KillAll(reply));
        wait_all(rx.await.unwrap_or_default()).await
    }

    /// Make the bookkeeper panic (fault injection, contract §5 row 7).
    pub(crate) fn crash(&self) {
        let _ = self.commands.send(Command::Crash);
    }
}

async fn wait_all(controls: Vec<Arc<KeyControl>>) -> usize {
    let n = controls.len();
    for control in controls {
        control.exited().await;
    }
    n
}

/// The name of a fence mode, for [`LimboEntry::mode`].
pub(crate) fn mode_name(mode: OnFence) -> String {
    mode.as_str().to_owned()
}
