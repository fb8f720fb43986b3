//! A module's table of live keys (`ModuleSlot`): one entry per live key.
//!
//! This file owns the table: delivery of a message to a key, activating it
//! first when it has no live process (under the table's lock, after the
//! node admitted the activation), the choice of running a routed call inline
//! (`try_inline`) or of letting it start an absent key's process on its own
//! task (`activate_for_call`), the fence sweep (`fence_keys`: kill, or hand to limbo),
//! kills by partition, graceful stops, and an idle key's retirement. The
//! table keeps its entries in use order (least recently used first) for
//! eviction (`eviction.rs` chooses the victims). **An
//! entry is removed only by its key's own task after its store was
//! dropped** (`remove_if_current`, `retired`). It must not run guest code
//! itself: the key's task (`task.rs`) or an inline call (`inline.rs`) does.

use arc_swap::ArcSwap;
use lru::LruCache;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use fief_core::{OnFence, OwnershipToken, PartitionId};
use tokio::sync::oneshot;

use super::inline::{run_activation, run_inline, serve_inline};
use super::process::{ProcessCell, ProcessGuard};
use super::task::{Meter, Start, key_meter, run_key};
use super::{Envelope, Eviction, KeyControl, KeyEnv, KeyServices, Via, lock};
use crate::bindings::types::StopReason;
use crate::cpu_budget::{CpuMeter, TenantCpu};
use crate::error::{Error, Result};
use crate::host_bytes::Ledger;
use crate::limbo::{Limbo, LimboEntry, Survivor, mode_name};
use crate::line_budget::LineBudget;
use crate::mailbox::{self, Mailbox, MailboxRx, Refused};
use crate::metrics::InlineCounters;
use crate::module::CompiledModule;
use crate::trace::TraceContext;

/// A live key's entry in its module's table.
pub(crate) struct KeyHandle {
    pub(super) tx: Mailbox,
    pub(super) process: Arc<ProcessCell>,
    pub(super) control: Arc<KeyControl>,
    pub(super) generation: u64,
    started_at: SystemTime,
    partition: PartitionId,
    on_fence: OnFence,
    handle_fence_deadline: Duration,
    /// The node's epoch tick at the key's last routed message.
    pub(super) last_used: u64,
    /// Ordered to retire by an eviction (not counted against the module's
    /// `max_live_keys` meanwhile).
    pub(super) evicting: bool,
}

/// A module's live keys, least recently used first.
pub(super) type KeyTable = LruCache<Box<str>, KeyHandle>;

/// Why a routed call cannot run inline (see [`ModuleSlot::call`]).
enum Miss {
    /// The key has no entry: the call may activate it.
    Absent,
    /// The key is live but not idle: the call goes through the mailbox.
    Busy,
    /// The module's tenant is over its share of the callers' workers
    /// ([`crate::inline_share`]): the call goes through the mailbox, and an
    /// absent key is started by its own task on the guest threads.
    OverShare,
}

/// A key activated for the routed call that found it absent, which starts
/// its process on its own task (`inline.rs`, `run_activation`).
pub(super) struct Activation {
    /// The new key's process, empty, held until it has started.
    pub(super) held: ProcessGuard,
    pub(super) module: Arc<CompiledModule>,
    pub(super) env: Arc<KeyEnv>,
    /// Its state handed over by its previous owner, if it moved here.
    pub(super) handoff: Option<Vec<u8>>,
    pub(super) meter: Meter,
}

/// Lines about a module's keys that died or failed to start it may make
/// per second, once [`END_LINE_BURST`] is spent (the rest are withheld and
/// noted; `fief_key_kills_total` counts every death).
const END_LINES_PER_SECOND: f64 = 10.0;

/// Lines about a module's ended keys it may make at once.
const END_LINE_BURST: f64 = 100.0;

/// A deployed module name: its current version and its live keys.
///
/// Keys are tracked per name, not per version, so a redeploy never lets two
/// versions run one key at once: live keys finish on their version, new
/// activations use the new one.
pub(crate) struct ModuleSlot {
    pub(crate) name: Arc<str>,
    /// Read on every call (its limits): an `ArcSwap`, lock-free.
    current: ArcSwap<CompiledModule>,
    pub(super) keys: Mutex<KeyTable>,
    /// Entries of `keys` ordered to retire by an eviction (changed under
    /// the table's lock).
    pub(super) evicting: AtomicUsize,
    /// Keys evicted lately (at most `RECENTLY_EVICTED`), to count their
    /// reactivations.
    pub(super) recently_evicted: Mutex<LruCache<Box<str>, ()>>,
    next_generation: AtomicU64,
    /// `fief_calls_inline_total{module}` and `fief_calls_demoted_total{module}`.
    inline_calls: InlineCounters,
    /// The rate of this module's lines about keys that died or failed to
    /// start ([`END_LINES_PER_SECOND`], a burst of [`END_LINE_BURST`]): a
    /// module's keys can end as fast as callers activate them, and a tenant
    /// calling its own module whose every call traps made the node write a
    /// warning per request.
    pub(super) end_lines: LineBudget,
    /// The module's tenant's CPU meter, found at its first routed call.
    tenant_cpu: OnceLock<Arc<TenantCpu>>,
}

/// One live key, as reported by [`crate::Instance::keys`].
#[derive(Clone, Debug, serde::Serialize, utoipa::ToSchema)]
pub struct LiveKey {
    /// The module.
    pub module: String,
    /// The key.
    pub key: String,
    /// Its partition.
    pub partition: u32,
    /// When its process started (RFC 3339, UTC).
    #[serde(with = "humantime_serde")]
    #[schema(value_type = String)]
    pub since: SystemTime,
    /// Host memory the node holds for it outside its linear memory (queued
    /// messages, timer tags, subscriptions), in bytes.
    pub host_bytes: usize,
}

impl ModuleSlot {
    /// The slot of `name`, running `module`, counting its inline calls to
    /// `inline_calls`.
    pub(crate) fn new(name: &str, module: CompiledModule, inline_calls: InlineCounters) -> Self {
        ModuleSlot {
            name: Arc::from(name),
            current: ArcSwap::from_pointee(module),
            keys: Mutex::new(LruCache::unbounded()),
            evicting: AtomicUsize::new(0),
            recently_evicted: Mutex::new(LruCache::new(super::eviction::RECENTLY_EVICTED)),
            next_generation: AtomicU64::new(1),
            inline_calls,
            end_lines: LineBudget::new(END_LINES_PER_SECOND, END_LINE_BURST),
            tenant_cpu: OnceLock::new(),
        }
    }

    /// Whether a routed call to one of this module's keys may run on its
    /// caller's task, as far as its tenant's share of the callers' workers
    /// goes ([`crate::inline_share`]).
    fn tenant_may_run_inline(&self, services: &KeyServices, ticks: u64) -> bool {
        services.may_run_inline(self.tenant(services), ticks)
    }

    /// The module's tenant's CPU meter (its shares and request turns),
    /// found once.
    pub(crate) fn tenant(&self, services: &KeyServices) -> &Arc<TenantCpu> {
        self.tenant_cpu.get_or_init(|| {
            let tenant = crate::auth::tenant_of(&self.name).unwrap_or("");
            services
                .tenant_cpu
                .of(tenant, || services.metrics.tenant_counters(tenant))
        })
    }

    /// The version new activations use.
    pub(crate) fn current(&self) -> Arc<CompiledModule> {
        self.current.load_full()
    }

    /// A short look at the current version (its options, say), with no
    /// reference count taken; not to be held across an `await`.
    pub(crate) fn peek(&self) -> arc_swap::Guard<Arc<CompiledModule>> {
        self.current.load()
    }

    /// Make `module` the version new activations use.
    pub(crate) fn replace(&self, module: CompiledModule) {
        self.current.store(Arc::new(module));
    }

    pub(crate) fn live_keys(&self) -> usize {
        lock(&self.keys).len()
    }

    /// Messages waiting in the mailboxes of this module's live keys.
    pub(crate) fn queued(&self) -> usize {
        lock(&self.keys)
            .iter()
            .map(|(_, h)| h.tx.max_capacity() - h.tx.capacity())
            .sum()
    }

    pub(crate) fn list(&self) -> Vec<LiveKey> {
        lock(&self.keys)
            .iter()
            .map(|(key, h)| LiveKey {
                module: self.name.to_string(),
                key: key.to_string(),
                partition: h.partition.0,
                since: h.started_at,
                host_bytes: h.tx.ledger().used(),
            })
            .collect()
    }

    /// Put `envelope` in the key's mailbox, activating the key first if it
    /// has no live process.
    pub(crate) fn deliver(
        self: &Arc<Self>,
        services: &Arc<KeyServices>,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
        envelope: Envelope,
    ) -> Result<()> {
        self.deliver_in(
            &mut lock(&self.keys),
            services,
            (key, partition, token),
            envelope,
            false,
        )
    }

    /// [`deliver`](Self::deliver) under the key-table lock, held as `keys`.
    /// `replacing`: the messages of a key that just retired, for its next
    /// process (its slot in the budget was its own a moment ago: no
    /// eviction is needed, and none is refused for the budget).
    fn deliver_in(
        self: &Arc<Self>,
        keys: &mut KeyTable,
        services: &Arc<KeyServices>,
        (key, partition, token): (&str, PartitionId, OwnershipToken),
        envelope: Envelope,
        replacing: bool,
    ) -> Result<()> {
        let now = services.runtime.ticks();
        let envelope = match keys.get_mut(key) {
            Some(handle) => match handle.tx.try_send(envelope) {
                Ok(()) if handle.evicting => {
                    handle.control.start_task();
                    return Ok(());
                }
                Ok(()) => {
                    handle.control.start_task();
                    handle.last_used = now;
                    return Ok(());
                }
                // The process is gone but its entry not yet removed: its
                // task removes it under this lock right after the store is
                // dropped, so it is safe to replace here.
                Err(Refused::Closed(envelope)) => envelope,
                Err(refused) => return Err(refused.into_error(&self.name, key, &handle.tx)),
            },
            None => envelope,
        };
        self.activate(
            keys,
            services,
            (key, partition, token),
            Some(envelope),
            replacing,
        )
        .map(|_| ())
    }

    /// Activate `key`, which has no entry in `keys` (the key-table lock,
    /// held): under the live-key budget (evicting the least recently used
    /// idle key past it), once the node admitted it, a new entry and its
    /// task. With `first`, the task starts the process and `first` waits for
    /// it in the mailbox; without, the caller gets the process to start
    /// itself ([`Activation`]; see `inline.rs`, `run_activation`).
    fn activate(
        self: &Arc<Self>,
        keys: &mut KeyTable,
        services: &Arc<KeyServices>,
        (key, partition, token): (&str, PartitionId, OwnershipToken),
        first: Option<Envelope>,
        replacing: bool,
    ) -> Result<Option<Activation>> {
        let now = services.runtime.ticks();
        let by_task = first.is_some();
        let module = self.current();
        let options = &module.options;
        // Past the budget, the least recently used idle key makes room (it
        // retires while this one starts; only busy keys refuse).
        let evicting = self.evicting.load(Ordering::Relaxed);
        if !replacing
            && keys.len().saturating_sub(evicting) >= options.max_live_keys as usize
            && !self.evict_one(keys, Eviction::ModuleBudget, &services.runtime.tick_wakes)
        {
            return Err(Error::TooManyKeys {
                module: self.name.to_string(),
                limit: options.max_live_keys,
            });
        }
        // The node lives while its keys' tasks run: the new task holds it.
        let Some(node) = services.node() else {
            return Err(Error::Internal("the node has stopped".to_owned()));
        };
        // Routed before a move began draining the partition, this message
        // must not start a process the drain has already missed: the check
        // and the insert below happen under this module's key-table lock,
        // which the drain's listing takes after it marked the partition (found by the
        // leave test: a call routed just before the drain started a fresh
        // process after the handoff, and the key counted from 0 again).
        let handoff = node.admit_activation(&self.name, key, partition, token)?;
        let tenant = crate::auth::tenant_of(&self.name).unwrap_or("");
        let ledger = Ledger::key(
            &services.host_bytes.of(tenant),
            usize::try_from(options.max_host_bytes_per_key.as_u64()).unwrap_or(usize::MAX),
        );
        let (tx, rx) = mailbox::channel(options.mailbox_depth as usize, ledger);
        let control = Arc::new(KeyControl::default());
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let env = Arc::new(KeyEnv {
            module: self.name.clone(),
            key: Arc::from(key),
            token,
            partition,
            control: control.clone(),
            mailbox: tx.downgrade(),
            services: Arc::downgrade(services),
            generation,
            on_fence: options.on_fence,
            max_timers: options.max_timers_per_key,
            max_subscriptions: options.max_subscriptions_per_key,
            max_handoff: services.max_handoff_size(options),
        });
        // A new mailbox has room for one message, but its bytes may pass the
        // tenant's budget: then no process is started for it.
        if let Some(envelope) = first
            && let Err(refused) = tx.try_send(envelope)
        {
            return Err(refused.into_error(&self.name, key, &tx));
        }
        let process = Arc::new(ProcessCell::new(None));
        // Whoever starts the process holds it from the start; other callers
        // go through the mailbox until it has started.
        let held = process
            .clone()
            .try_lock_owned()
            .unwrap_or_else(|_| unreachable!("a new cell is unlocked"));
        let meter = key_meter(services, &module, &self.name);
        if lock(&self.recently_evicted).pop(key).is_some() {
            services.metrics.reactivated(&self.name);
        }
        keys.put(
            Box::from(key),
            KeyHandle {
                tx,
                process: process.clone(),
                control: control.clone(),
                generation,
                started_at: SystemTime::now(),
                partition,
                on_fence: options.on_fence,
                handle_fence_deadline: options.handle_fence_deadline,
                last_used: now,
                evicting: false,
            },
        );
        let (start, activation) = if by_task {
            (Start::Here { held, handoff }, None)
        } else {
            let activation = Activation {
                held,
                module: module.clone(),
                env: env.clone(),
                handoff,
                meter: meter.clone(),
            };
            (Start::ByCaller, Some(activation))
        };
        let task = run_key(
            (services.clone(), node),
            self.clone(),
            module,
            env,
            rx,
            process,
            start,
            meter,
        );
        if by_task {
            services.tasks.spawn_on(task, &services.guest);
        } else {
            // The caller starts the process and runs its call; the task is
            // needed once the caller lets go (or a message, an order comes
            // first): its spawn waits for the next tick, off the caller's
            // path (`KeyControl::defer_task`). Measured: an evicted key's
            // reactivation ~10 µs less (docs/benchmarks.md, "Issue 20,
            // seventeenth pass").
            let (tasks, guest) = (services.tasks.clone(), services.guest.clone());
            control.defer_task(
                Box::new(move || drop(tasks.spawn_on(task, &guest))),
                &services.runtime.tick_wakes,
            );
        }
        Ok(activation)
    }

    /// Call `key` and wait for its reply, activating it first if it has no
    /// live process.
    ///
    /// When the key is idle (nothing in its mailbox, nothing being
    /// processed) and the call is routed, the call runs right here on the
    /// caller's task, holding the key's process: no hop to the key's task
    /// and back. When the key has no entry (and the node may act), a routed
    /// call starts its process right here too (`run_activation`). Otherwise
    /// it goes through the mailbox like every other message. Either way the key runs one callback at a time, in arrival
    /// order, and with the `trace` of the request it serves.
    #[allow(
        clippy::too_many_arguments,
        reason = "the key's place, the message and what travels with it"
    )]
    pub(crate) async fn call(
        self: &Arc<Self>,
        services: &Arc<KeyServices>,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
        message: Vec<u8>,
        via: Via,
        trace: Option<TraceContext>,
    ) -> Result<Vec<u8>> {
        if via == Via::Routed {
            let ticks = services.runtime.ticks();
            // A tenant over its share of the callers' workers is served on
            // the guest threads (`crate::inline_share`).
            let inline = if self.tenant_may_run_inline(services, ticks) {
                self.try_inline(key, ticks)
            } else {
                Err(Miss::OverShare)
            };
            match inline {
                Ok((process, control, cpu)) => {
                    // For the event log, read before the check, as the key
                    // loop does.
                    let checked_at = services.reports_events().then(std::time::Instant::now);
                    // Served only while the node may act; otherwise the
                    // key's task decides (a terminate key dies, a survivor
                    // refuses).
                    if !control.is_killed() && !control.is_survivor() && services.may_act() {
                        if let (Some(at), Some(running)) = (checked_at, process.as_ref()) {
                            crate::event_log::report_inline_call(
                                services,
                                &running.store.data().env,
                                &message,
                                at,
                            );
                        }
                        control.touch();
                        self.inline_calls.calls.inc();
                        let future = Box::pin(run_inline(process, control.clone(), message, trace));
                        return serve_inline(future, control, cpu, &self.inline_calls.demoted)
                            .await;
                    }
                }
                // No process: the call starts one here, and runs on it.
                Err(Miss::Absent) if services.may_act() => {
                    let activation = self.activate_for_call(services, key, partition, token)?;
                    if let Some(activation) = activation {
                        self.inline_calls.calls.inc();
                        let (control, cpu) =
                            (activation.env.control.clone(), activation.meter.0.clone());
                        let future =
                            Box::pin(run_activation(activation, services.clone(), message, trace));
                        return serve_inline(future, control, cpu, &self.inline_calls.demoted)
                            .await;
                    }
                }
                Err(_) => {}
            }
        }
        let (reply, rx) = oneshot::channel();
        self.deliver(
            services,
            key,
            partition,
            token,
            Envelope::Call {
                message,
                reply,
                via,
                trace,
            },
        )?;
        rx.await
            .map_err(|_| Error::KeyDied("the key process went away".to_owned()))?
    }

    /// The key's process, if the key is live and idle: its mailbox is empty,
    /// its task is not processing a message, and no one else holds it.
    fn try_inline(
        &self,
        key: &str,
        now: u64,
    ) -> std::result::Result<(ProcessGuard, Arc<KeyControl>, Arc<CpuMeter>), Miss> {
        let mut keys = lock(&self.keys);
        let handle = keys.get_mut(key).ok_or(Miss::Absent)?;
        // A key ordered to retire serves nothing more: its next process does.
        if handle.evicting {
            return Err(Miss::Busy);
        }
        handle.last_used = now;
        // Mailbox first, then `receiving`: a message the task took out
        // before the mailbox was read is still flagged (see `receive`).
        if handle.tx.capacity() != handle.tx.max_capacity() {
            return Err(Miss::Busy);
        }
        let mut process = handle
            .process
            .clone()
            .try_lock_owned()
            .map_err(|_| Miss::Busy)?;
        if handle.control.receiving.load(Ordering::SeqCst) {
            return Err(Miss::Busy);
        }
        // A key over its CPU budget waits on its own task, not a caller's.
        let running = process.as_mut().ok_or(Miss::Busy)?;
        if running.throttle().is_some() {
            return Err(Miss::Busy);
        }
        let cpu = running.cpu.clone();
        Ok((process, handle.control.clone(), cpu))
    }

    /// Activate `key` for a routed call to start on its caller's task, if it
    /// still has no entry (else `None`: the call goes through the mailbox).
    fn activate_for_call(
        self: &Arc<Self>,
        services: &Arc<KeyServices>,
        key: &str,
        partition: PartitionId,
        token: OwnershipToken,
    ) -> Result<Option<Activation>> {
        let mut keys = lock(&self.keys);
        if keys.contains(key) {
            return Ok(None);
        }
        self.activate(&mut keys, services, (key, partition, token), None, false)
    }

    /// Kill every live key whose partition `select` accepts. Returns how many.
    pub(crate) fn kill_where(
        &self,
        reason: &'static str,
        select: impl Fn(PartitionId) -> bool,
    ) -> usize {
        let keys = lock(&self.keys);
        keys.iter()
            .map(|(_, h)| h)
            .filter(|h| select(h.partition))
            .filter(|h| h.control.kill_one_of_many(reason))
            .count()
    }

    /// The fence, for this module's live keys: `terminate` keys are killed;
    /// `continue` and `callback` keys leave the kill tree for `limbo` (a
    /// callback key is also ordered to run `handle-fence`, and is killed if
    /// it has not answered by its deadline). Returns how many `terminate` keys
    /// the fence ended (by this sweep or on their own, [`KeyControl::kill_for_fence`]).
    pub(crate) fn fence_keys(&self, limbo: &Limbo) -> usize {
        let mut keys = lock(&self.keys);
        // The `terminate` keys (most, usually) are killed after the lock is
        // released: waking thousands of key tasks under it would stall every
        // worker that runs one of them into `remove_if_current`. No guest
        // code of theirs runs meanwhile: past the fence point the epoch
        // callback and the key loop refuse to run it (see `KeyProcess::start`).
        let mut doomed: Vec<Arc<KeyControl>> = Vec::with_capacity(keys.len());
        let mut survivors: Vec<Box<str>> = Vec::new();
        for (name, handle) in keys.iter() {
            if handle.on_fence == OnFence::Terminate {
                doomed.push(handle.control.clone());
            } else {
                survivors.push(name.clone());
            }
        }
        for name in survivors {
            let handle = self.take_entry(&mut keys, &name).expect("listed above");
            let mode = handle.on_fence;
            let deadline = handle.handle_fence_deadline;
            let callback = (mode == OnFence::Callback).then_some(deadline);
            handle.control.fence(callback);
            if callback.is_some() {
                let control = handle.control.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(deadline).await;
                    if !control.fence_answered.load(Ordering::SeqCst)
                        && control.kill("handle-fence did not answer by its deadline")
                    {
                        tracing::warn!("a key was killed: handle-fence overran its deadline");
                    }
                });
            }
            limbo.insert(Survivor {
                entry: LimboEntry {
                    module: self.name.to_string(),
                    key: name.to_string(),
                    partition: handle.partition.0,
                    since: SystemTime::now(),
                    mode: mode_name(mode),
                },
                generation: handle.generation,
                control: handle.control,
                mailbox: handle.tx,
            });
        }
        drop(keys);
        // Counted whoever noticed the fence first: a running key may have
        // killed itself before this sweep reached it.
        doomed
            .iter()
            .filter(|control| control.kill_for_fence())
            .count()
    }

    /// A live key's mailbox (its local handle on this node).
    pub(crate) fn mailbox(&self, key: &str) -> Option<Mailbox> {
        lock(&self.keys).peek(key).map(|h| {
            // Whoever takes the handle may send at once.
            h.control.start_task();
            h.tx.clone()
        })
    }

    /// Kill one key. Returns whether it was live.
    pub(crate) fn kill(&self, key: &str, reason: &'static str) -> bool {
        self.kill_generation(key, reason).is_some()
    }

    /// [`kill`](Self::kill), returning the killed process's generation (for
    /// [`holds_generation`](Self::holds_generation)) if it was live.
    pub(crate) fn kill_generation(&self, key: &str, reason: &'static str) -> Option<u64> {
        lock(&self.keys)
            .peek(key)
            .filter(|h| h.control.kill(reason))
            .map(|h| h.generation)
    }

    /// Whether `key`'s entry is still the process of `generation` (a killed
    /// process keeps it until its store is dropped).
    pub(crate) fn holds_generation(&self, key: &str, generation: u64) -> bool {
        lock(&self.keys)
            .peek(key)
            .is_some_and(|h| h.generation == generation)
    }

    /// Ask a live key to stop gracefully. `None` when the key is not live.
    pub(crate) fn stop(
        &self,
        key: &str,
        reason: StopReason,
    ) -> Option<oneshot::Receiver<Result<Option<Vec<u8>>>>> {
        let keys = lock(&self.keys);
        let handle = keys.peek(key)?;
        handle.control.start_task();
        let (reply, rx) = oneshot::channel();
        // A stop must not be refused for a full mailbox: wait for room off
        // the lock.
        let tx = handle.tx.clone();
        drop(keys);
        tokio::spawn(async move {
            // The key stopped on its own first (its process is gone, and
            // with it any state): there is nothing to hand on.
            if let Err(Envelope::Stop { reply, .. }) =
                tx.send_uncharged(Envelope::Stop { reason, reply }).await
            {
                let _ = reply.send(Ok(None));
            }
        });
        Some(rx)
    }

    /// The names of every live key, for a graceful shutdown.
    pub(crate) fn live_key_names(&self) -> Vec<String> {
        lock(&self.keys)
            .iter()
            .map(|(k, _)| k.to_string())
            .collect()
    }

    /// Remove `key`'s entry (under the table's lock, held as `keys`),
    /// keeping the count of evictions in flight.
    fn take_entry(&self, keys: &mut KeyTable, key: &str) -> Option<KeyHandle> {
        let handle = keys.pop(key)?;
        if handle.evicting {
            self.evicting.fetch_sub(1, Ordering::Relaxed);
        }
        Some(handle)
    }

    pub(super) fn remove_if_current(&self, key: &str, generation: u64) {
        let mut keys = lock(&self.keys);
        if keys.peek(key).is_some_and(|h| h.generation == generation) {
            self.take_entry(&mut keys, key);
        }
    }

    /// Whether an idle key may retire: its mailbox is empty and it is still
    /// the key's current process. Its entry stays until its store is
    /// dropped ([`retired`](Self::retired)): a message arriving meanwhile
    /// waits in its mailbox instead of starting a second process of the key
    /// beside the one running `terminate(idle)` (issue "One ownership state
    /// machine", guarantee 1).
    pub(super) fn may_retire(&self, key: &str, generation: u64, rx: &MailboxRx) -> bool {
        let keys = lock(&self.keys);
        rx.is_empty() && keys.peek(key).is_some_and(|h| h.generation == generation)
    }

    /// A retired key's store was dropped: remove its entry and give the
    /// calls and casts that arrived during its `terminate(idle)`, in their
    /// order, to a fresh process of the key (under the lock, so none
    /// overtakes them). One that cannot be delivered (the partition moved
    /// meanwhile) is dropped, so its caller hears that the process went
    /// away; a stop order is answered with no state (the key stopped on its
    /// own), and a publication for the old process's subscription is
    /// dropped with it.
    pub(super) fn retired(
        self: &Arc<Self>,
        services: &Arc<KeyServices>,
        env: &KeyEnv,
        rx: &mut MailboxRx,
    ) {
        let mut keys = lock(&self.keys);
        let Some(handle) = keys
            .peek(&*env.key)
            .filter(|h| h.generation == env.generation)
        else {
            return;
        };
        let partition = handle.partition;
        self.take_entry(&mut keys, &env.key);
        rx.close();
        while let Ok(envelope) = rx.try_recv() {
            match envelope {
                Envelope::Stop { reply, .. } => {
                    let _ = reply.send(Ok(None));
                }
                Envelope::Info(_) => {}
                routed @ (Envelope::Call { .. }
                | Envelope::Cast { .. }
                | Envelope::Alarm(_)
                | Envelope::Connection(_)) => {
                    let to = (&*env.key, partition, env.token);
                    if let Err(error) = self.deliver_in(&mut keys, services, to, routed, true) {
                        tracing::debug!(module = %self.name, key = %env.key, %error, "a message that arrived while the key retired was not delivered");
                    }
                }
            }
        }
    }
}
